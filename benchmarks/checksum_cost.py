"""What checksums add to a save and to a load, sharded and full, on 2 ranks.

Saves one model (about 300 MB of fp32 weights, 4 MiB to 16 MiB tensors) once sharded and once full, then times
``fabric.load`` of each with verification and without, in two regimes:

- **warm**: the checkpoint's files are in the page cache (just written or read), so a load is pure CPU and memory
  bandwidth, and the checksum's CPU cost shows at its largest share;
- **cold**: before each timed load, every file of the checkpoint is evicted from the page cache (``fsync`` then
  ``posix_fadvise(DONTNEED)``), so the load reads the disk, as a job resuming on a fresh node does.

It also times the save with checksums recorded and without (sharded: DCP's plain writer; full: torch's zip writer
with its CRC-32 switched off, ``torch.serialization.set_crc32_options(False)``), both including the fsync.

Sides alternate round by round (with/without, then without/with) so drifting machine load hits both alike. Prints
the median, min and max of the per-round ratio (with / without) and the median seconds of each side. Before the
cold rounds it checks that eviction works: it times reading the checkpoint's files right after an eviction and
again from the page cache.

    python -m torch.distributed.run --nproc_per_node=2 benchmarks/checksum_cost.py [--rounds 7] [--layers 18]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterator

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from lightning.fabric import Fabric
from torch import nn

from lightning_fsdp.checkpoint import checksums, load, save
from lightning_fsdp.checkpoint.safe_pickle import SafeFileSystemReader
from lightning_fsdp.fabric import FSDPStrategy


def _model(layers: int, dim: int) -> nn.Module:
    return nn.Sequential(*[nn.Linear(dim, dim) for _ in range(layers)])


@contextlib.contextmanager
def _unverified_loads() -> Iterator[None]:
    """Loads inside it skip verification (the baseline side): the sharded load reads through the allow-list reader
    alone, the full load opens its file without checking the zip records."""

    def plain_reader(path, *, allow_pickle=False, verify=True):
        return SafeFileSystemReader(path, allow_pickle=allow_pickle)

    saved = checksums.VerifyingReader, checksums.verify_loaded
    checksums.VerifyingReader, checksums.verify_loaded = plain_reader, lambda path, contents: True
    try:
        yield
    finally:
        checksums.VerifyingReader, checksums.verify_loaded = saved


@contextlib.contextmanager
def _unrecorded_saves() -> Iterator[None]:
    """Saves inside it record no checksums (the baseline side): DCP's own writer, torch's zip writer without CRC-32."""
    saved = save._checksum_writer, torch.serialization.get_crc32_options()
    save._checksum_writer = lambda staged, comm: dcp.FileSystemWriter(staged)
    torch.serialization.set_crc32_options(False)
    try:
        yield
    finally:
        save._checksum_writer = saved[0]
        torch.serialization.set_crc32_options(saved[1])


def _files(path: Path) -> list[Path]:
    return sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]


def _evict(path: Path) -> None:
    """Drop the checkpoint's files from the page cache (the cache is the machine's, so one rank does it)."""
    for file in _files(path):
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fsync(fd)  # dirty pages cannot be dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _read_all(path: Path) -> tuple[float, int]:
    start, size, buffer = time.perf_counter(), 0, bytearray(8 * 2**20)
    for file in _files(path):
        with open(file, "rb", buffering=0) as f:
            while count := f.readinto(buffer):
                size += count
    return time.perf_counter() - start, size


def _timed(fabric: Fabric, action: Callable[[], None], before: Callable[[], None] = lambda: None) -> float:
    if fabric.global_rank == 0:
        before()
    fabric.barrier()
    start = time.perf_counter()
    action()
    fabric.barrier()
    elapsed = torch.tensor(time.perf_counter() - start)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item()


def _alternate(rounds: int, run: Callable[[str], float]) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {"with": [], "without": []}
    for round_ in range(rounds):
        for side in ("with", "without") if round_ % 2 == 0 else ("without", "with"):
            times[side].append(run(side))
    return times


def _report(fabric: Fabric, label: str, times: dict[str, list[float]]) -> None:
    ratios = [a / b for a, b in zip(times["with"], times["without"])]
    if fabric.global_rank == 0:
        print(f"{label:22s} ratio median {statistics.median(ratios):.3f} (min {min(ratios):.3f}, max"
              f" {max(ratios):.3f}); median {statistics.median(times['with']):.3f} s with,"
              f" {statistics.median(times['without']):.3f} s without", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--save-rounds", type=int, default=5)
    parser.add_argument("--layers", type=int, default=18)
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--algorithm", default=checksums.ALGORITHM, help="the digest new checkpoints record:"
                        " crc32 (what this package recorded before xxh3) or xxh3_64")
    parser.add_argument("--regimes", default="warm,cold,save", help="comma-separated: warm, cold, save")
    args = parser.parse_args()
    regimes = args.regimes.split(",")
    checksums.ALGORITHM = args.algorithm
    torch.set_num_threads(1)
    fabrics = {kind: Fabric(accelerator="cpu", devices=2, strategy=FSDPStrategy(state_dict_type=kind))
               for kind in ("sharded", "full")}
    for fabric in fabrics.values():
        fabric.launch()
    fabric = fabrics["sharded"]
    torch.manual_seed(0)
    model = fabric.setup_module(_model(args.layers, args.dim))
    size_mb = sum(p.numel() * p.element_size() for p in _model(1, args.dim).parameters()) * args.layers / 1e6
    root = Path(fabric.broadcast(tempfile.mkdtemp(dir=os.environ.get("BENCH_DIR"))))
    if fabric.global_rank == 0:
        print(f"model {size_mb:.0f} MB, {args.rounds} load rounds, {args.save_rounds} save rounds, files in {root}")
    paths = {"sharded": root / "sharded", "full": root / "full.pt"}
    try:
        for kind, path in paths.items():
            fabrics[kind].save(path, {"model": model})
            assert checksums.verify_checkpoint(path), f"{path} carries no checksums"
        if "cold" in regimes and fabric.global_rank == 0:
            for kind, path in paths.items():
                _evict(path)
                cold, size = _read_all(path)
                warm, _ = _read_all(path)
                print(f"eviction check, {kind:7s}: read {size / 1e6:.0f} MB at {size / cold / 1e6:.0f} MB/s right"
                      f" after eviction, {size / warm / 1e6:.0f} MB/s from the page cache", flush=True)

        def load_side(kind: str, evict: bool) -> Callable[[str], float]:
            def run(side: str) -> float:
                before = (lambda: _evict(paths[kind])) if evict else (lambda: None)
                action = lambda: fabrics[kind].load(paths[kind], {"model": model})  # noqa: E731
                if side == "with":
                    return _timed(fabric, action, before)
                with _unverified_loads():
                    return _timed(fabric, action, before)
            return run

        def save_side(kind: str) -> Callable[[str], float]:
            counter = iter(range(10**6))

            def run(side: str) -> float:
                target = root / f"save-{kind}-{next(counter)}"
                action = lambda: fabrics[kind].save(target, {"model": model})  # noqa: E731
                try:
                    if side == "with":
                        return _timed(fabric, action)
                    with _unrecorded_saves():
                        return _timed(fabric, action)
                finally:
                    fabric.barrier()
                    if fabric.global_rank == 0:
                        shutil.rmtree(target) if target.is_dir() else target.unlink()
            return run

        for kind in paths:
            if "warm" in regimes:
                _timed(fabric, lambda: fabrics[kind].load(paths[kind], {"model": model}))  # page cache, allocator
                _report(fabric, f"{kind} load, warm", _alternate(args.rounds, load_side(kind, evict=False)))
            if "cold" in regimes:
                _report(fabric, f"{kind} load, cold", _alternate(args.rounds, load_side(kind, evict=True)))
            if "save" in regimes:
                _report(fabric, f"{kind} save", _alternate(args.save_rounds, save_side(kind)))
    finally:
        fabric.barrier()
        if fabric.global_rank == 0:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
