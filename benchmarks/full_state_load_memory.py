"""Each rank's extra host memory while a set-up (sharded) model loads a full state dict, against the model's size.

Three routes, 2 ranks, a stack of square Linear layers (fp32):

- ``load_state_dict``: every rank holds the full state dict already (the caller gave it) and calls
  ``model.load_state_dict(full)``; each full tensor is cut to a view of this rank's shard and copied in place, so the
  extra memory should stay near zero (a gather or a ``clone()`` of the full tensors would add the model's size).
- ``assign``: the same with ``assign=True``; each rank allocates new shards (its shard bytes), never a full tensor.
- ``load_raw``: ``fabric.load_raw(path, model)`` of a ``torch.save`` file; rank 0 maps the file and broadcasts one
  tensor at a time, so each rank holds at most one full tensor (the largest) beyond its shards.

Printed per rank and route, in MB: the peak RSS extra (``VmHWM`` after ``malloc_trim(0)`` and a ``clear_refs``
reset, so file pages the reader maps count too), the model's full bytes, the rank's shard bytes, the largest tensor,
and ``ratio = peak extra / model bytes``.

    python benchmarks/full_state_load_memory.py [--dim 2048 --layers 8 --routes load_state_dict,assign,load_raw]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peak_memory import reset_peak, status_kib  # noqa: E402


def _model(args: argparse.Namespace, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(*(nn.Linear(args.dim, args.dim) for _ in range(args.layers)))


def worker(args: argparse.Namespace) -> None:
    from lightning.fabric import Fabric
    from torch.distributed.tensor import DTensor

    from lightning_fsdp.fabric import FSDPStrategy

    torch.set_num_threads(1)
    fabric = Fabric(accelerator="cpu", devices=2, strategy=FSDPStrategy(auto_wrap_policy={nn.Linear}))
    fabric.launch()
    model = fabric.setup_module(_model(args, seed=0))
    full_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    shard_bytes = sum(p.to_local().numel() * p.element_size() for p in model.parameters() if isinstance(p, DTensor))
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    full = _model(args, seed=1).state_dict()  # what the caller holds: the full state dict, on every rank
    rows = []
    for route in args.routes.split(","):
        fabric.barrier()
        start = reset_peak()
        if route == "load_raw":
            fabric.load_raw(args.path, model)
        else:
            model.load_state_dict(full, assign=route == "assign")
        peak = status_kib("VmHWM")
        extra = (peak - start) * 1024
        rows.append({
            "rank": fabric.global_rank, "route": route, "peak_extra_MB": round(extra / 1e6, 1),
            "model_MB": round(full_bytes / 1e6, 1), "shard_MB": round(shard_bytes / 1e6, 1),
            "largest_tensor_MB": round(largest / 1e6, 1), "ratio": round(extra / full_bytes, 3),
        })
    # Exactness, so the numbers are of a load that worked: the file holds other values (seed 2) than `full`.
    del full
    if "load_raw" in args.routes:
        loaded = {k: v.full_tensor() for k, v in model.state_dict().items()}
        assert all(torch.equal(loaded[k], v) for k, v in _model(args, seed=2).state_dict().items()), "wrong values"
    everyone = [None] * 2
    torch.distributed.all_gather_object(everyone, rows)
    if fabric.global_rank == 0:
        for rank_rows in everyone:
            for row in rank_rows:
                print(json.dumps(row))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--routes", default="load_state_dict,assign,load_raw")
    parser.add_argument("--path", type=Path, help=argparse.SUPPRESS)  # set for the workers
    args = parser.parse_args()
    if args.path is not None:
        worker(args)
        return
    directory = Path(tempfile.mkdtemp(prefix="full_state_load_memory_"))
    try:
        path = directory / "full.pth"
        torch.save(_model(args, seed=2).state_dict(), path)
        print(f"full state dict: {path.stat().st_size / 1e6:.0f} MB, 2 ranks")
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", __file__,
                   "--dim", str(args.dim), "--layers", str(args.layers), "--routes", args.routes,
                   "--path", str(path)]
        subprocess.run(command, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    finally:
        shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()
