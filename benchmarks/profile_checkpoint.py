"""Where the time of our sharded save or load to S3 goes (issue 43 item 6): the model and server of
``object_storage.py`` (2 CPU ranks, GPT with AdamW, 86 MB per rank, moto behind the counting middleware), one save,
then ``--reps`` saves or loads, each timed on every rank with three instruments:

- the ranged reads' share of a load (a ``ranged_read.Fetch``, from when it is made, in DCP's local planning, to the
  end of its ``serve``: when it started after the load did, how long it took);
- every full collection of Python's cyclic collector during the runs (``gc.callbacks``: when, how long), which
  walks every object of the process and so costs a rank with torch and Lightning imported a quarter of a second;
- with ``--py-spy FILE``, rank 0 sampled by py-spy during the runs (``--format raw``, every thread, idle too: read it
  with any flame-graph tool, or count frames).

Run (take the CPU lock on a shared machine; py-spy is on PyPI):

    flock /tmp/cpu.lock .venv/bin/python benchmarks/profile_checkpoint.py --mode load --reps 10 [--py-spy load.raw]

Found with it (2026-11-28): a full collection every second load (0.23-0.37 s in a 0.36 s load; the load now runs
with the collector paused, ``checkpoint/io/collector.py``); rank 0's ~100 small GETs of replicated scalars in rank
1's shard (small requests now run more at once); botocore's request path (0.3 s of a 1.0 s load; the GETs now go
through obstore). What is left of a load: DCP's planning and its gathers (~0.1 s before the first GET), the copy of
each piece into the DTensors, and the server.

Found with it (2026-11-29, 3 x 10 loads interleaved with the code before): rank 0 sent 114 ranged GETs, 103 of them
under 64 KiB (replicated scalars DCP saved among rank 1's tensors), and ended its reads ~60 ms after rank 1: the
server spends ~1.2 ms per request whatever its size, so more in flight did not help (SMALL_REQUESTS 4, 16 or 32;
windows of 2 to 8 ranges of 4 to 16 MiB: all within the noise). Gaps up to 256 KiB now merge
within 1/256 of the fetch's bytes (45 requests): load 0.364 -> 0.319 s median. Before the first GET, ``.metadata``
was unpickled three times and the manifest read twice, and the small objects fetched one after another through
s3fs: now once, once, and side by side through obstore: the first GET 0.081 -> 0.066 s, the load 0.377 -> 0.350 s.

Save, measured on ``object_storage.py --rounds 2`` (2026-11-28, save vs a plain s3fs put, median (range); today's
defaults 8 MiB x 4 parts: 0.41x (0.39-0.53) in 3 rounds): 16 MiB x 3 parts 0.40x (0.33-0.47), 8 MiB x 8 parts
0.37x (0.33-0.40), both over the memory bound (0.90x and 1.01x of the shard above start; the bound is 0.88x), so
the part size and the window are not the lever. The whole shard buffered and sent as ONE PutObject (no multipart
complete, which moto answers by re-reading and hashing the object): 0.68x (0.53-0.82), RSS 1.62x the shard. That is
the ceiling of a streamed single PUT of known length; the rest of the gap is the per-item ``torch.save`` through the
tee and the hashing, which a plain put of ready bytes does not pay.
"""

from __future__ import annotations

import argparse
import gc
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import object_storage as bench  # noqa: E402  (its server and model)


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=("load", "save"), default="load")
    parser.add_argument("--reps", type=int, default=8)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--dim", type=int, default=384)
    parser.add_argument("--py-spy", default=None, help="sample rank 0 with py-spy into this file (raw format)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args()


def main() -> None:
    args = _parse()
    if args.worker:
        _worker(args)
        return
    bench.launch_on_server([__file__, "--worker", *sys.argv[1:]])


def _worker(args: argparse.Namespace) -> None:
    rank = int(os.environ["RANK"])
    os.environ["AWS_ACCESS_KEY_ID"] = f"w2r{rank}"
    import warnings

    import torch
    import torch.nn.functional as F
    from lightning.fabric import Fabric

    sys.path.insert(0, str(HERE.parent / "examples"))
    from train_gpt import GPT, Block, GPTConfig, make_optimizer

    from lightning_fsdp.checkpoint.io import ranged_read
    from lightning_fsdp.fabric import FSDPStrategy

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    fabric = Fabric(accelerator="cpu", devices=2, strategy=FSDPStrategy(auto_wrap_policy={Block}))
    fabric.launch()
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=64, block_size=64, n_layer=args.layers, n_head=6, n_embd=args.dim)
    with fabric.init_module(empty_init=True):
        plain = GPT(config)
    model, optimizer = fabric.setup(plain, make_optimizer(plain, 1e-4))
    batch = torch.randint(0, 64, (4, 65))
    fabric.backward(F.cross_entropy(model(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten()))
    optimizer.step()
    state = {"model": model, "optimizer": optimizer, "step": 0}
    url = f"s3://{bench.BUCKET}/{fabric.broadcast(f'run-{os.getpid()}')}/ckpt"

    began = [0.0]
    fetches: list[tuple[float, float]] = []
    collections: list[tuple[float, float]] = []
    # A load's requests start when its Fetch is made (in DCP's local planning) and end when `serve` has handed the
    # last bytes over: that span is the ranged reads' share.
    original_init, original_serve = ranged_read.Fetch.__init__, ranged_read.Fetch.serve

    def noted_init(self, *a, **k):
        self._profile_started = time.perf_counter()
        original_init(self, *a, **k)

    def timed_serve(self, *a, **k):
        try:
            return original_serve(self, *a, **k)
        finally:
            fetches.append((self._profile_started - began[0], time.perf_counter() - self._profile_started))

    ranged_read.Fetch.__init__, ranged_read.Fetch.serve = noted_init, timed_serve
    collecting = [0.0]

    def noted(phase: str, info: dict) -> None:
        if phase == "start":
            collecting[0] = time.perf_counter()
        elif info["generation"] == 2 and began[0]:
            collections.append((collecting[0] - began[0], time.perf_counter() - collecting[0]))

    gc.callbacks.append(noted)
    fabric.save(url, state)
    fabric.load(url, state)  # warm: connections, caches
    spy = None
    if rank == 0 and args.py_spy:
        here = Path(sys.executable).with_name("py-spy")  # the venv's, else the PATH's
        spy = subprocess.Popen([str(here) if here.exists() else "py-spy", "record", "--pid", str(os.getpid()),
                                "-r", "250", "--format", "raw",
                                "-o", args.py_spy, "--threads", "--idle"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(1.5)  # attached
    times = []
    for _ in range(args.reps):
        fabric.barrier()
        began[0] = time.perf_counter()
        (fabric.load if args.mode == "load" else fabric.save)(url, state)
        times.append(time.perf_counter() - began[0])
    fabric.barrier()
    if spy is not None:
        spy.send_signal(2)
        spy.wait()
    lines = [f"rank {rank} {args.mode} s: {[round(t, 3) for t in times]}",
             f"rank {rank} full collections (s into the run, s):"
             f" {[(round(a, 3), round(b, 3)) for a, b in collections]}"]
    if args.mode == "load":
        lines.append(f"rank {rank} ranged reads (s into the load, s):"
                     f" {[(round(a, 3), round(b, 3)) for a, b in fetches[-args.reps:]]}")
    for rank_turn in range(2):
        fabric.barrier()
        if rank_turn == rank:
            print("\n".join(lines), flush=True)


if __name__ == "__main__":
    main()
