"""Where the time of a background save's call goes: cProfile of the 4th ``fabric.save`` with ``async_save=True`` on
rank 0 (the first saves allocate the host buffers and fill DCP's plan cache), 17M-parameter GPT, 2 CPU ranks; to a
local folder, or with ``--s3`` to the S3 server of ``object_storage.py`` (moto behind its counting middleware, started
in this process), where the benchmark's "async save stall" row is measured.

    flock /tmp/cpu.lock python -m torch.distributed.run --nproc_per_node=2 benchmarks/profile_async_save.py
    flock /tmp/cpu.lock python benchmarks/profile_async_save.py --s3

Found with ``--s3`` (2026-11-29, the call ~0.1 s on rank 0): rank 0's checks of the target before anything is
staged (``check_target``, the commit orders of the directory: S3 round trips, ~0.05 s, which rank 1 waits for in
the agreement), DCP's staging copy into the reused host buffers (~0.015 s), the state dicts (~0.01 s), the scan of
the temporary folder for stale staging folders (~0.006 s here, where it holds 15,000 entries).
"""

from __future__ import annotations

import cProfile
import os
import pstats
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def _serve_and_launch() -> None:
    """The S3 server in this process, the two ranks under torchrun, signing as the benchmark's ranks do."""
    import object_storage as bench

    bench.launch_on_server([__file__], {"PROFILE_ASYNC_URL": f"s3://{bench.BUCKET}/async-{os.getpid()}"})


def main() -> None:
    if "--s3" in sys.argv[1:]:
        _serve_and_launch()
        return
    import torch
    from lightning.fabric import Fabric

    from gpt import SIZES, GPT, Block, batch, loss_of
    from lightning_fsdp.fabric import FSDPStrategy

    if os.environ.get("PROFILE_ASYNC_URL"):
        os.environ["AWS_ACCESS_KEY_ID"] = f"w2r{os.environ['RANK']}"  # before any client exists, as the benchmark
    torch.set_num_threads(1)
    fabric = Fabric(accelerator="cpu", devices=2, strategy=FSDPStrategy(auto_wrap_policy={Block}, async_save=True))
    fabric.launch()
    cfg = SIZES["17m"]
    model = GPT(cfg)
    model, opt = fabric.setup(model, torch.optim.AdamW(model.parameters()))
    root = os.environ.get("PROFILE_ASYNC_URL") or fabric.broadcast(tempfile.mkdtemp())
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
