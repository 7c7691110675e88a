"""One-process cases: resume, on a world size of 1, from the checkpoints that ``trainer_checkpoints.py`` wrote on 2
ranks (its output folder is ``$LFSDP_TRAINER_CHECKPOINTS``). What was saved must be what is loaded: the parameters,
every key of the optimizer state, the LR schedule and the step count; and the epoch trained after the resume ends
where the uninterrupted 2-rank run ended."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from lightning.fabric.utilities.load import _load_distributed_checkpoint
from lightning.pytorch import Callback
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

from common import full
from harness import case, run_cases
from trainer_common import LitGPT, compare_params, gathered, loader, make_trainer, strategy

SAVED = Path(os.environ["LFSDP_TRAINER_CHECKPOINTS"])


class _AtTrainStart(Callback):
    """What the Trainer restored, seen before the first step: full parameters, full optimizer state by name."""

    def on_train_start(self, trainer, pl_module):
        self.step = trainer.global_step
        self.lr = trainer.optimizers[0].param_groups[0]["lr"]
        self.params = gathered(pl_module)
        state = get_optimizer_state_dict(pl_module, trainer.optimizers[0])["state"]
        # Every key (step, exp_avg, exp_avg_sq); a copy: on 1 rank a full tensor is a view of the live state.
        self.optimizer = {f"{name}/{k}": full(v).clone() for name, s in state.items() for k, v in s.items()}


def _saved_epoch0(kind: str) -> dict:
    path = SAVED / "ckpt" / f"resume_{kind}" / "epoch=0.ckpt"
    if kind == "sharded":
        contents = _load_distributed_checkpoint(path)
        state = contents["optimizer_0"]["state"]
        return {"path": path, "params": contents["model"], "step": contents["global_step"],
                "optimizer": {f"{name}/{k}": v for name, s in state.items() for k, v in s.items()},
                "lr": contents["optimizer_0"]["param_groups"][0]["lr"]}
    contents = torch.load(path, weights_only=True)
    names = [k for k in contents["state_dict"]]
    osd = contents["optimizer_states"][0]
    # The full file keys the optimizer state by position; position j is the j-th parameter of the module.
    return {"path": path, "params": contents["state_dict"], "step": contents["global_step"],
            "optimizer": {f"{names[j]}/{k}": v for j, s in osd["state"].items() for k, v in s.items()},
            "lr": osd["param_groups"][0]["lr"]}


def _resume_on_one_process(kind: str) -> dict:
    saved = _saved_epoch0(kind)
    seen = _AtTrainStart()
    model = LitGPT(optimizer="adamw", scheduler=True)
    trainer = make_trainer(strategy(state_dict_type=kind), devices=1, callbacks=[seen])
    # Batches of 4 on 1 process are the 2 + 2 samples the two ranks' DistributedSamplers gave one step (same seed
    # and epoch, rank r takes every 2nd index from r), so the resumed run can be held against the uninterrupted one.
    trainer.fit(model, loader(batch_size=4), ckpt_path=saved["path"])
    assert trainer.world_size == 1 and seen.step == saved["step"] == 4, (trainer.world_size, seen.step)
    assert seen.lr == saved["lr"], (seen.lr, saved["lr"])
    params = compare_params(seen.params, saved["params"], atol=0.0)
    kinds = {k.rsplit("/", 1)[1] for k in saved["optimizer"]}
    assert kinds == {"step", "exp_avg", "exp_avg_sq"}, kinds
    optimizer = compare_params(seen.optimizer, saved["optimizer"], atol=0.0)
    assert trainer.global_step == 4 + 4, trainer.global_step  # one more epoch: 4 steps of 4 samples
    # The continued training: the same parameters as the 2-rank run that was never interrupted (up to the order in
    # which the gradient mean is summed), and far from where the resume started.
    uninterrupted = torch.load(SAVED / "handoff" / f"final_{kind}.pt", weights_only=True)
    continued = compare_params(gathered(model.model), uninterrupted, atol=1e-5)
    moved = max((uninterrupted[k] - saved["params"][f"model.{k}"]).abs().max().item() for k in uninterrupted)
    assert moved > 1e-3, f"the epoch after the resume changed nothing ({moved:.2e})"
    return {"params": params, "optimizer": optimizer, "lr": seen.lr, "continued_vs_uninterrupted": continued,
            "moved": moved}


@case
def sharded_checkpoint_from_2_ranks_resumes_on_1():
    return _resume_on_one_process("sharded")


@case
def full_checkpoint_from_2_ranks_resumes_on_1():
    return _resume_on_one_process("full")


@case
def validate_on_1_process_from_a_2_rank_sharded_directory():
    expected = torch.load(SAVED / "handoff" / "final_sharded.pt", weights_only=True)
    model = LitGPT()
    make_trainer(strategy(), devices=1).validate(
        model, loader(8), ckpt_path=SAVED / "ckpt" / "resume_sharded" / "epoch=1.ckpt", verbose=False
    )
    return {"param_diff": compare_params(gathered(model.model), expected, atol=0.0)}


if __name__ == "__main__":
    run_cases()
