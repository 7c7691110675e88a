"""What checksum verification adds to a load, sharded and full, on 2 ranks.

Saves one model (about 300 MB of fp32 weights, 4 MiB to 16 MiB tensors) once sharded and once full, then times
``fabric.load`` of each with verification and without (the reader's verification hook and the full file's
check switched off), alternating the two sides round by round so drifting machine load hits both alike. Both
sides read from the page cache (the files were just written), which shows the CPU cost at its largest share.
Prints the median, min and max of the per-round ratio (with / without) and the median seconds of each side.

    python -m torch.distributed.run --nproc_per_node=2 benchmarks/checksum_cost.py [--rounds 7] [--layers 18]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from lightning.fabric import Fabric
from torch import nn

from lightning_fsdp.checkpoint import checksums
from lightning_fsdp.checkpoint.safe_pickle import SafeFileSystemReader
from lightning_fsdp.fabric import FSDPStrategy


def _model(layers: int, dim: int) -> nn.Module:
    return nn.Sequential(*[nn.Linear(dim, dim) for _ in range(layers)])


class _Unverified:
    """Switches verification off for the loads inside it (the baseline side)."""

    def __enter__(self):
        self.slice, self.zip = checksums.VerifyingReader._slice_file, checksums.verify_zip
        checksums.VerifyingReader._slice_file = SafeFileSystemReader._slice_file
        checksums.verify_zip = lambda path: True

    def __exit__(self, *exc):
        checksums.VerifyingReader._slice_file, checksums.verify_zip = self.slice, self.zip


def _timed_load(fabric: Fabric, path: Path, model: nn.Module) -> float:
    fabric.barrier()
    start = time.perf_counter()
    fabric.load(path, {"model": model})
    fabric.barrier()
    elapsed = torch.tensor(time.perf_counter() - start)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--layers", type=int, default=18)
    parser.add_argument("--dim", type=int, default=2048)
    args = parser.parse_args()
    torch.set_num_threads(1)
    fabrics = {kind: Fabric(accelerator="cpu", devices=2, strategy=FSDPStrategy(state_dict_type=kind))
               for kind in ("sharded", "full")}
    for fabric in fabrics.values():
        fabric.launch()
    fabric = fabrics["sharded"]
    torch.manual_seed(0)
    model = fabric.setup_module(_model(args.layers, args.dim))
    size_mb = sum(p.numel() * p.element_size() for p in _model(1, args.dim).parameters()) * args.layers / 1e6
    root = Path(fabric.broadcast(tempfile.mkdtemp()))
    paths = {"sharded": root / "sharded", "full": root / "full.pt"}
    for kind, path in paths.items():
        fabrics[kind].save(path, {"model": model})
    for kind, path in paths.items():
        assert checksums.verify_checkpoint(path), f"{path} carries no checksums"
        times: dict[str, list[float]] = {"with": [], "without": []}
        _timed_load(fabric, path, model)  # warm-up: page cache, allocator
        for round_ in range(args.rounds):
            order = ("with", "without") if round_ % 2 == 0 else ("without", "with")
            for side in order:
                if side == "with":
                    times[side].append(_timed_load(fabric, path, model))
                else:
                    with _Unverified():
                        times[side].append(_timed_load(fabric, path, model))
        ratios = [a / b for a, b in zip(times["with"], times["without"])]
        if fabric.global_rank == 0:
            print(f"{kind:8s} {size_mb:.0f} MB, {args.rounds} rounds: load with/without verification ratio median"
                  f" {statistics.median(ratios):.3f} (min {min(ratios):.3f}, max {max(ratios):.3f}); median"
                  f" {statistics.median(times['with']):.3f} s with, {statistics.median(times['without']):.3f} s"
                  " without", flush=True)


if __name__ == "__main__":
    main()
