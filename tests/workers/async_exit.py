"""A Fabric script whose last save is a background one, still in flight when the script ends (issue 21, item 9).

Not a harness script: what is under test is the process's own exit, so the script simply ends, and the pytest side
(``tests/test_async_exit.py``) reads torchrun's exit status, the output and the checkpoint left behind.

It trains one step, saves to ``$LFSDP_EXIT_DIR/ckpt`` in the background, trains one more and saves again to the same
path; the second save is still being written when the script's last line has run. ``$LFSDP_TEST_OUT`` receives, from
rank 0, the state each save held (``saved-1.pt``, ``saved-2.pt``: full tensors), so the pytest side can tell which
one the checkpoint holds. Where ``$LFSDP_EXIT_DIR`` is a small tmpfs, only one checkpoint fits and the second save
fails with ENOSPC.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

from common import full_params, make_fabric, train_steps
from models import TinyTransformer

WHERE = Path(os.environ["LFSDP_EXIT_DIR"])
OUT = Path(os.environ["LFSDP_TEST_OUT"])


def full_state(model, opt) -> dict:
    """Every tensor the checkpoint holds, in full (collective): the model's and the optimizer's, by name."""
    optimizer = get_optimizer_state_dict(model.module, opt.optimizer, options=StateDictOptions(full_state_dict=True))
    return {"model": full_params(model), "optimizer": optimizer["state"]}


fabric = make_fabric(2, async_save=True)
OUT.mkdir(parents=True, exist_ok=True)
torch.manual_seed(0)
plain = TinyTransformer(dim=64)
model, opt = fabric.setup(plain, torch.optim.AdamW(plain.parameters(), lr=1e-2))
for step in (1, 2):
    train_steps(fabric, model, opt, steps=1, start=step - 1)
    fabric.save(WHERE / "ckpt", {"model": model, "optimizer": opt})
    state = full_state(model, opt)
    if fabric.global_rank == 0:
        torch.save(state, OUT / f"saved-{step}.pt")
print(f"rank {fabric.global_rank}: the script's last line ran", flush=True)
