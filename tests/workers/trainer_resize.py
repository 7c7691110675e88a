"""One-process cases: resume, on a world size of 1, from the checkpoints that ``trainer_checkpoints.py`` wrote on 2
ranks (its output folder is ``$LFSDP_TRAINER_CHECKPOINTS``). What was saved must be what is loaded: the parameters,
the optimizer state, the LR schedule and the step count."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from lightning.fabric.utilities.load import _load_distributed_checkpoint
from lightning.pytorch import Callback
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

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
        self.exp_avg = {k: v["exp_avg"].full_tensor().clone() for k, v in state.items()}  # a copy: on 1 rank it is a view


def _saved_epoch0(kind: str) -> dict:
    path = SAVED / "ckpt" / f"resume_{kind}" / "epoch=0.ckpt"
    if kind == "sharded":
        contents = _load_distributed_checkpoint(path)
        return {"path": path, "params": contents["model"], "exp_avg": contents["optimizer_0"]["state"],
                "step": contents["global_step"], "lr": contents["optimizer_0"]["param_groups"][0]["lr"]}
    contents = torch.load(path, weights_only=True)
    names = [k for k in contents["state_dict"]]
    osd = contents["optimizer_states"][0]
    # The full file keys the optimizer state by position; position j is the j-th parameter of the module.
    return {"path": path, "params": contents["state_dict"], "step": contents["global_step"],
            "exp_avg": {f"{names[j]}": {"exp_avg": s["exp_avg"]} for j, s in osd["state"].items()},
            "lr": osd["param_groups"][0]["lr"]}


def _resume_on_one_process(kind: str) -> dict:
    saved = _saved_epoch0(kind)
    seen = _AtTrainStart()
    model = LitGPT(optimizer="adamw", scheduler=True)
    trainer = make_trainer(strategy(state_dict_type=kind), devices=1, callbacks=[seen])
    trainer.fit(model, loader(), ckpt_path=saved["path"])
    assert trainer.world_size == 1 and seen.step == saved["step"] == 4, (trainer.world_size, seen.step)
    assert seen.lr == saved["lr"], (seen.lr, saved["lr"])
    params = compare_params(seen.params, saved["params"], atol=0.0)
    expected_avg = {k: v["exp_avg"] for k, v in saved["exp_avg"].items()}
    optimizer = compare_params(seen.exp_avg, expected_avg, atol=0.0)
    assert trainer.global_step == 4 + 8, trainer.global_step  # one more epoch: 8 batches of 2 on 1 process
    return {"params": params, "optimizer": optimizer, "lr": seen.lr}


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
