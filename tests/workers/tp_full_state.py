"""Full (unsharded) checkpoints under tensor parallelism, 4 ranks (issue 37, item 2): every placement list a
tensor-parallel model's parameters get (``_StridedShard`` from FSDP over a column split, ``Shard`` over "tp",
``Replicate``), cut by ``local_shard`` exactly as DTensor lays it out; a full save with optimizer loads back on
(shard=2, tp=2) and (shard=1, tp=4), the weights and the optimizer state equal to what was saved, and the next step
equal to the step that would have followed; the Trainer resumes under TP from its default (full) checkpoint."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard
from torch.utils.data import DataLoader

from common import full, make_fabric, shared_tmpdir
from harness import TIMEOUT, case, run_cases
from lightning_fsdp.engine.full_state_load import local_shard
from lightning_fsdp.trainer import FSDPStrategy as TrainerFSDPStrategy
from tp_models import GPT, PLAN, Block, TiedGPT
from tp_training import BATCH, WORLD, Lit, Tokens, adamw, dp_rank, loss_of, tokens


def _placements() -> list[tuple[tuple[int, ...], tuple[Any, ...]]]:
    """(mesh shape, placements) pairs: what FSDP over TP gives a column-split weight, a row-split weight, a
    replicated one, hybrid sharding's replica axis (with and without TP), and the (1, 4) layout."""
    return [
        ((2, 2), (_StridedShard(0, split_factor=2), Shard(0))),
        ((2, 2), (Shard(0), Shard(1))),
        ((2, 2), (Shard(0), Replicate())),
        ((2, 2), (Replicate(), Shard(0))),
        ((2, 2), (Shard(1), Shard(0))),
        ((1, 4), (_StridedShard(0, split_factor=4), Shard(0))),
        ((1, 4), (Shard(0), Shard(1))),
        ((2, 1, 2), (Replicate(), Shard(0), Shard(0))),  # HYBRID_SHARD with TP: (replicate, shard, tp)
        ((1, 2, 2), (Replicate(), _StridedShard(0, split_factor=2), Shard(0))),
        ((4,), (Shard(0),)),
        ((4,), (Replicate(),)),
    ]


@case
def local_shard_cuts_every_tensor_parallel_placement_as_dtensor_does():
    """Against ``distribute_tensor(full, src_data_rank=None)`` (DTensor's own split, no communication), for shapes
    that divide and shapes that do not: equal values, a view of the full tensor, and the same DTensor layout."""
    checked = 0
    for shape, placements in _placements():
        mesh = init_device_mesh("cpu", shape)
        for size in ((8, 6), (16, 4), (4, 8), (10, 6), (5, 3), (3, 9), (8,) if len(placements) == 1 else (12, 4)):
            full_tensor = torch.arange(float(torch.tensor(size).prod())).reshape(size)
            if any(getattr(p, "dim", 0) >= full_tensor.ndim for p in placements):
                continue
            expected = distribute_tensor(full_tensor, mesh, placements, src_data_rank=None)
            got = local_shard(full_tensor, expected)
            assert isinstance(got, DTensor) and got.placements == expected.placements, (placements, got.placements)
            assert torch.equal(got.to_local(), expected.to_local()), (shape, placements, size)
            assert got.to_local().untyped_storage().data_ptr() == full_tensor.untyped_storage().data_ptr(), \
                f"{placements}: the piece is a copy, not a view of the full tensor"
            owned = local_shard(full_tensor, expected, own_storage=True)
            assert torch.equal(owned.to_local(), expected.to_local())
            assert owned.to_local().untyped_storage().data_ptr() != full_tensor.untyped_storage().data_ptr()
            checked += 1
    return {"checked": checked}


def _train(fabric, model, opt, steps, first: int = 0) -> None:
    for step in range(first, first + steps):
        fabric.backward(loss_of(model, tokens(step, fabric.global_rank // fabric.strategy.device_mesh["tp"].size())))
        opt.step()
        opt.zero_grad()


def _full_state(model, opt) -> dict[str, torch.Tensor]:
    state = {f"model.{k}": full(v).detach().clone() for k, v in model.state_dict().items()}
    for key, entry in opt.state_dict()["state"].items():
        for name, value in entry.items():
            if isinstance(value, torch.Tensor) and value.ndim:
                state[f"opt.{key}.{name}"] = full(value).detach().clone()
    return state


@case
def full_checkpoint_with_optimizer_round_trips_on_2x2_and_1x4():
    """Saved full (one file, rank 0) after 2 steps on each layout, loaded into a fresh model and optimizer on the
    same layout: every weight and optimizer tensor equal, and one more step equal to the step the saved run takes."""
    out = {}
    for tp in (2, 4):
        fabric = make_fabric(WORLD, auto_wrap_policy={Block}, tensor_parallel_size=tp, tensor_parallel_plan=PLAN,
                             state_dict_type="full")
        root = shared_tmpdir(fabric)
        torch.manual_seed(0)
        module = GPT()
        model, opt = fabric.setup(module, adamw(module.parameters()))
        _train(fabric, model, opt, 2)
        fabric.save(root / "full.pt", {"model": model, "optimizer": opt})
        saved = _full_state(model, opt)
        _train(fabric, model, opt, 1, first=2)
        after = _full_state(model, opt)
        torch.manual_seed(1)
        fresh_module = GPT()
        fresh, fresh_opt = fabric.setup(fresh_module, adamw(fresh_module.parameters()))
        fabric.load(root / "full.pt", {"model": fresh, "optimizer": fresh_opt})
        loaded = _full_state(fresh, fresh_opt)
        assert sorted(loaded) == sorted(saved), sorted(set(loaded) ^ set(saved))[:5]
        for key, value in saved.items():
            assert torch.equal(loaded[key], value), f"tp={tp}: {key} differs after the load"
        _train(fabric, fresh, fresh_opt, 1, first=2)
        stepped = _full_state(fresh, fresh_opt)
        diff = max((stepped[k] - after[k]).abs().max().item() for k in after)
        assert diff <= 1e-6, f"tp={tp}: the step after the load differs by {diff}"
        out["1x4" if tp == 4 else "2x2"] = {"entries": len(saved), "step_diff": diff}
    return out


class _Record(L.Callback):
    """The full weights and optimizer tensors as training starts (after a checkpoint is restored) and as it ends."""

    def __init__(self) -> None:
        self.start: dict = {}
        self.end: dict = {}

    def on_train_start(self, trainer, lit) -> None:
        self.start = _full_state(lit.model, trainer.optimizers[0])
        assert lit.model.head.weight is lit.model.wte.weight, "the tied weight is two parameters"

    def on_train_end(self, trainer, lit) -> None:
        self.end = _full_state(lit.model, trainer.optimizers[0])


def _trainer(max_steps: int, record: _Record, root) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu", devices=WORLD, max_steps=max_steps, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[record], default_root_dir=root,
        strategy=TrainerFSDPStrategy(auto_wrap_policy={Block}, tensor_parallel_size=2,
                                     tensor_parallel_plan={**PLAN, "head": "colwise_rep"}, timeout=TIMEOUT),
    )


@case
def trainer_resumes_under_tensor_parallel_from_its_default_full_checkpoint():
    """``fit`` 2 steps, ``save_checkpoint`` with the strategy's default (``state_dict_type="full"``), then a new
    Trainer's ``fit(ckpt_path=...)``: training starts from exactly the saved weights and optimizer state, at step 2.
    The model's head is tied to its embedding and split with it, so the tie goes through the round trip too."""
    first = _Record()
    trainer = _trainer(2, first, None)
    trainer.fit(Lit(TiedGPT), DataLoader(Tokens(), batch_size=BATCH))
    assert trainer.strategy.config.state_dict_type == "full"
    root = shared_tmpdir(trainer.strategy)
    trainer.save_checkpoint(root / "last.ckpt")
    if dist.get_rank() == 0:
        assert (root / "last.ckpt").is_file(), "the default checkpoint is not one full file"
    second = _Record()
    resumed = _trainer(3, second, root)
    resumed.fit(Lit(TiedGPT), DataLoader(Tokens(), batch_size=BATCH), ckpt_path=root / "last.ckpt")
    assert sorted(second.start) == sorted(first.end)
    for key, value in first.end.items():
        assert torch.equal(second.start[key], value), f"{key} differs after the resume"
    assert resumed.global_step == 3, resumed.global_step
    return {"entries": len(first.end), "dp_rank": dp_rank()}


if __name__ == "__main__":
    run_cases()
