"""Two ranks: write real checkpoints with the strategy, then load converted ones back (for ``tests/test_cli.py``).

The same trained model and optimizer are saved twice, sharded and full, into ``$LFSDP_TEST_OUT/ckpt``. The pytest
side converts them offline and compares files; here rank 0 converts each into the other format with the pure
conversion functions, and every rank loads the results into a fresh model and optimizer through ``fabric.load``.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from common import loss_fn, make_fabric
from harness import case, run_cases
from lightning_fsdp.checkpoint.convert import convert
from models import TinyTransformer, make_batch

WORLD = 2
CKPT = Path(os.environ["LFSDP_TEST_OUT"]) / "ckpt"
SAVED: dict = {}


def _setup(fabric, seed: int):
    torch.manual_seed(seed)
    plain = TinyTransformer()
    return fabric.setup(plain, torch.optim.AdamW(plain.parameters(), lr=1e-2, weight_decay=0.1))


def _local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def _lists(value):
    return list(value) if isinstance(value, tuple) else value


@case
def save_sharded_and_full_checkpoints():
    fabric = make_fabric(WORLD, state_dict_type="sharded")
    model, opt = _setup(fabric, seed=0)
    for step in range(2):  # two steps: `step` counters and moments differ from any fresh state
        fabric.backward(loss_fn(model, make_batch(step, fabric.global_rank)))
        opt.step()
        opt.zero_grad()
    state = {"model": model, "optimizer": opt, "step": 3, "note": {"run": "cli-test", "lr": 0.01}}
    fabric.save(CKPT / "sharded", state)
    # A second Fabric shares the process group; it saves the very same model and optimizer as one file.
    make_fabric(WORLD, state_dict_type="full").save(CKPT / "full.pt", state)
    SAVED.update(fabric=fabric, model=model, opt=opt)
    return {"files": sorted(p.name for p in CKPT.iterdir())}


@case
def converted_checkpoints_load_back_exactly():
    fabric, model, opt = SAVED["fabric"], SAVED["model"], SAVED["opt"]
    if fabric.global_rank == 0:
        convert(CKPT / "full.pt", CKPT / "converted-sharded", to="sharded")
        convert(CKPT / "sharded", CKPT / "converted-full.pt", to="full")
    fabric.barrier()
    checked = {}
    for name in ("converted-sharded", "converted-full.pt", "full.pt"):
        fresh_model, fresh_opt = _setup(fabric, seed=1)  # other initial values: every tensor must come from disk
        state = {"model": fresh_model, "optimizer": fresh_opt, "step": 0}
        remainder = fabric.load(CKPT / name, state)
        assert state["step"] == 3 and remainder == {"note": {"run": "cli-test", "lr": 0.01}}, (state, remainder)
        compared = 0
        for (pname, p), (_, q) in zip(model.named_parameters(), fresh_model.named_parameters()):
            assert torch.equal(_local(p), _local(q)), f"{name}: parameter {pname} differs"
            for key, value in opt.state[p].items():
                assert torch.equal(_local(value), _local(fresh_opt.state[q][key])), f"{name}: {pname}.{key} differs"
                compared += 1
        for group, fresh_group in zip(opt.param_groups, fresh_opt.param_groups):
            # Tuples compared as lists: loading any full checkpoint turns `betas` into a list (the state-dict
            # API's broadcast from rank 0 does), the strategy's own full file included.
            expected = {k: _lists(v) for k, v in group.items() if k != "params"}
            actual = {k: _lists(v) for k, v in fresh_group.items() if k != "params"}
            assert actual == expected, f"{name}: param_groups differ: {actual} != {expected}"
        checked[name] = {"state_tensors": compared, "betas": type(fresh_opt.param_groups[0]["betas"]).__name__}
    return checked


if __name__ == "__main__":
    run_cases()
