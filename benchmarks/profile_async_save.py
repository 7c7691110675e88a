"""Where the time of a background save's call goes: cProfile of the 4th ``fabric.save`` with ``async_save=True`` on
rank 0 (the first saves allocate the host buffers and fill DCP's plan cache), 17M-parameter GPT, 2 CPU ranks.

    flock /tmp/cpu.lock python -m torch.distributed.run --nproc_per_node=2 benchmarks/profile_async_save.py
"""

from __future__ import annotations

import cProfile
import pstats
import sys
import tempfile
import time
from pathlib import Path

import torch
from lightning.fabric import Fabric

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpt import SIZES, GPT, Block, batch, loss_of  # noqa: E402

from lightning_fsdp.fabric import FSDPStrategy  # noqa: E402


def main() -> None:
    torch.set_num_threads(1)
    fabric = Fabric(accelerator="cpu", devices=2, strategy=FSDPStrategy(auto_wrap_policy={Block}, async_save=True))
    fabric.launch()
    cfg = SIZES["17m"]
    model = GPT(cfg)
    model, opt = fabric.setup(model, torch.optim.AdamW(model.parameters()))
    root = fabric.broadcast(tempfile.mkdtemp())
    saves = fabric.strategy._background_saves

    def step(i: int) -> None:
        fabric.backward(loss_of(model, batch(cfg, i, fabric.global_rank)))
        opt.step()
        opt.zero_grad()

    step(0)
    profile = cProfile.Profile()
    for i in range(4):
        step(i + 1)
        saves.wait(fabric.strategy._engine)  # no save in flight when the timed call starts
        fabric.barrier()
        measured = i == 3 and fabric.global_rank == 0
        start = time.perf_counter()
        if measured:
            profile.enable()
        fabric.save(f"{root}/ckpt-{i}", {"model": model, "optimizer": opt})
        if measured:
            profile.disable()
        fabric.print(f"save {i}: the call blocked {time.perf_counter() - start:.4f} s")
    saves.wait(fabric.strategy._engine)
    if fabric.global_rank == 0:
        pstats.Stats(profile).sort_stats("cumulative").print_stats(25)


if __name__ == "__main__":
    main()
