"""A short job that touches everything that keeps threads or process groups alive until exit: the default gloo
group, the background-save group and DCP's writer threads, a full save and a load. ``tests/test_clean_exit.py``
launches it repeatedly and requires exit status 0 every time."""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from common import loss_fn, make_fabric
from harness import case, run_cases
from models import TinyTransformer, make_batch


@case
def train_save_and_load():
    fabric = make_fabric(2, async_save=True)
    full = make_fabric(2, state_dict_type="full")
    torch.manual_seed(0)
    plain = TinyTransformer()
    model, opt = fabric.setup(plain, torch.optim.AdamW(plain.parameters(), lr=1e-2))
    fabric.backward(loss_fn(model, make_batch(0, fabric.global_rank)))
    opt.step()
    root = Path(fabric.broadcast(tempfile.mkdtemp()))
    fabric.save(root / "sharded", {"model": model, "optimizer": opt})  # in the background
    full.save(root / "full.pt", {"model": model, "optimizer": opt})
    fabric.load(root / "sharded", {"model": model, "optimizer": opt})
    fabric.save(root / "again", {"model": model})  # still in flight when the script ends: the exit waits for it
    return "done"


if __name__ == "__main__":
    run_cases()
