"""What checksum verification adds to a load, sharded and full, on 2 CPU ranks (issue 12: at most about 5%).

Saves one model (``--layers`` x ``--dim``^2 fp32 weights, 201 MB by default) once sharded and once full, then times
``fabric.load`` of each with verification on and off, in two regimes:

- **warm**: the checkpoint's files are in the page cache (just written or read), so a load is pure CPU and memory
  bandwidth, and the checksum's CPU cost shows at its largest share;
- **cold**: before each timed load, every file of the checkpoint is dropped from the page cache (``fsync``, then
  ``posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED)``), so the load reads the disk, as a job resuming on a fresh node.

"Off" is the same load with the verifying pieces swapped for plain ones (DCP's allow-list reader; the full load
without its record check). Each round times both sides in alternating order; each figure is the median of the
per-round ratio on/off (``benchmarks/rows.py``), each side's sample the total time of ``--loads`` loads. Timings
are never asserted: a missed target reads ``met: false``.

    python benchmarks/checksum_cost.py [--json PATH] [--rounds 15] [--loads 3] [--layers 12] [--dim 2048]

Started without ``torchrun``, it launches itself on 2 ranks.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterator

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rows import alternate, emit, figure, ratios  # noqa: E402

TARGET = ("<=", 1.05)


def _model(layers: int, dim: int) -> torch.nn.Module:
    return torch.nn.Sequential(*[torch.nn.Linear(dim, dim) for _ in range(layers)])


@contextlib.contextmanager
def _verification_off() -> Iterator[None]:
    """Loads inside it skip verification: the sharded load reads through the allow-list reader alone, the full
    load opens its file without checking its records."""
    from lightning_fsdp.checkpoint import load
    from lightning_fsdp.checkpoint.integrity.safe_pickle import SafeFileSystemReader
    from lightning_fsdp.checkpoint.integrity.zipfiles import LoadVerifier

    def plain_reader(path, *, allow_pickle=False, verify=True):
        return SafeFileSystemReader(path, allow_pickle=allow_pickle)

    saved = load.VerifyingReader, LoadVerifier.open  # where the load looks them up
    load.VerifyingReader = plain_reader
    LoadVerifier.open = classmethod(lambda cls, path, contents: LoadVerifier.unchecked())
    try:
        yield
    finally:
        load.VerifyingReader, LoadVerifier.open = saved


def _files(path: Path) -> list[Path]:
    return sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]


def _drop_from_cache(path: Path) -> None:
    """Drop every file of the checkpoint from the page cache (the cache is the machine's, so one rank does it)."""
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


def _timed(fabric, action: Callable[[], None], before: Callable[[], None]) -> float:
    if fabric.global_rank == 0:
        before()
    fabric.barrier()
    start = time.perf_counter()
    action()
    fabric.barrier()
    elapsed = torch.tensor(time.perf_counter() - start)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the load ends when the slowest rank is done
    return elapsed.item()


def measure(args: argparse.Namespace) -> None:
    from lightning.fabric import Fabric

    from lightning_fsdp.checkpoint.integrity.verify import verify_checkpoint
    from lightning_fsdp.fabric import FSDPStrategy

    torch.set_num_threads(1)
    fabrics = {kind: Fabric(accelerator="cpu", devices=2, strategy=FSDPStrategy(state_dict_type=kind))
               for kind in ("sharded", "full")}
    for fabric in fabrics.values():
        fabric.launch()
    fabric = fabrics["sharded"]
    torch.manual_seed(0)
    model = fabric.setup_module(_model(args.layers, args.dim))
    model_bytes = args.layers * (args.dim * args.dim + args.dim) * 4
    root = Path(fabric.broadcast(tempfile.mkdtemp(dir=os.environ.get("BENCH_DIR"))))
    paths = {"sharded": root / "sharded", "full": root / "full.pt"}
    rows = []
    try:
        for kind, path in paths.items():
            fabrics[kind].save(path, {"model": model})
            assert verify_checkpoint(path), f"{path} carries no checksums"
        if fabric.global_rank == 0:
            print(f"model {model_bytes / 1e6:.0f} MB, {args.rounds} rounds per figure, files in {root}", flush=True)
            for kind, path in paths.items():  # eviction must work, or "cold" measures the cache
                _drop_from_cache(path)
                cold, size = _read_all(path)
                warm, _ = _read_all(path)
                print(f"eviction check, {kind}: {size / cold / 1e6:.0f} MB/s right after dropping the pages,"
                      f" {size / warm / 1e6:.0f} MB/s from the page cache", flush=True)

        def side(kind: str, verify: bool, cold: bool) -> Callable[[], float]:
            def run() -> float:  # one sample: the sum of --loads loads, each timed alone (eviction untimed)
                before = (lambda: _drop_from_cache(paths[kind])) if cold else (lambda: None)
                action = lambda: fabrics[kind].load(paths[kind], {"model": model})  # noqa: E731
                with contextlib.nullcontext() if verify else _verification_off():
                    return sum(_timed(fabric, action, before) for _ in range(args.loads))
            return run

        for kind in paths:
            for regime in ("warm", "cold"):
                if regime == "warm":  # page cache and allocator warmed up, for both sides alike
                    _timed(fabric, lambda: fabrics[kind].load(paths[kind], {"model": model}), lambda: None)
                times = alternate(args.rounds, {"on": side(kind, True, regime == "cold"),
                                                "off": side(kind, False, regime == "cold")})
                rows.append(figure(
                    f"{kind} load, verify on vs off ({regime})", ratios(times["on"], times["off"]),
                    baseline=f"the same {kind} load without verification", target=TARGET,
                    detail={"model_bytes": model_bytes, "loads_per_sample": args.loads,
                            "seconds_on": times["on"], "seconds_off": times["off"]}))
    finally:
        fabric.barrier()
        if fabric.global_rank == 0:
            shutil.rmtree(root, ignore_errors=True)
    if fabric.global_rank == 0:
        emit(rows, args.json)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the rows to this file")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--loads", type=int, default=3, help="loads summed into one sample: a load takes only"
                        " 0.05 to 0.25 s here, too short for one to give a stable ratio on a shared machine")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--dim", type=int, default=2048)
    args = parser.parse_args()
    if "LOCAL_RANK" not in os.environ:  # started directly: run this script on 2 ranks
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", __file__, *sys.argv[1:]]
        sys.exit(subprocess.run(command).returncode)
    measure(args)


if __name__ == "__main__":
    main()
