"""Where one step of each side of ``tensor_parallel_figures.py`` goes, on rank 0: the strategy's TP inside FSDP and
Lightning's ``ModelParallelStrategy`` with the same plan by hand, the same model (``--size``) on 4 gloo ranks.

    flock /tmp/cpu.lock python benchmarks/profile_tensor_parallel.py [--size full] [--steps 8]

For each side, after two warm-up steps: the Python function calls of one step (cProfile; a count, so free of the
machine's noise), the torch operators of one step that the two sides run a different number of times (none, if both
compute and communicate alike), the collectives of one step, and the mean of ``--steps`` single steps timed in
alternating order between barriers. It prints the report; it is not part of the run of record.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

COLLECTIVE_MARKS = ("gloo:", "c10d::", "_c10d_functional::all_reduce", "FSDP::all_gather (", "FSDP::post_backward")


def worker(args) -> dict:
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    from rows import alternate
    from tensor_parallel_figures import SIZES, TP, batches, set_up, train_step

    torch.set_num_threads(1)
    cfg = SIZES[args.size]
    sides = set_up(cfg)
    tokens = batches(cfg, int(os.environ["RANK"]) // TP)[0]
    step = {name: (lambda s=side: train_step(s, tokens, cfg.vocab)) for name, side in sides.items()}
    for name in sides:
        step[name]()
        step[name]()
    report: dict = {}
    for name in sides:
        dist.barrier()
        profiler = cProfile.Profile()
        profiler.enable()
        step[name]()
        profiler.disable()
        stats = pstats.Stats(profiler)
        ours = {f"{Path(f).name}:{line}:{fn}": v[1] for (f, line, fn), v in stats.stats.items()
                if "lightning_fsdp" in f}
        dist.barrier()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step[name]()
        report[name] = {"python_calls": stats.total_calls, "calls_in_lightning_fsdp": ours,
                        "ops": {e.key: e.count for e in prof.key_averages()}}

    def timed(name: str) -> float:
        dist.barrier()
        start = time.perf_counter()
        step[name]()
        dist.barrier()
        return time.perf_counter() - start

    report["seconds"] = alternate(args.steps, {name: (lambda n=name: timed(n)) for name in sides})
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="full", choices=("full", "tiny"))
    parser.add_argument("--steps", type=int, default=8, help="single steps timed per side, alternating")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        report = worker(args)
        if os.environ["RANK"] == "0":
            Path(args.out).write_text(json.dumps(report))
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "report.json"
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
                   PYTHONPATH=os.pathsep.join(filter(None, [str(HERE.parent / "src"), os.environ.get("PYTHONPATH")])))
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=4",
                               "--master_addr=127.0.0.1", f"--master_port={port}", __file__, "--worker", "--out",
                               str(out), "--size", args.size, "--steps", str(args.steps)],
                              env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"the launch failed (exit {proc.returncode}):\n{(proc.stdout + proc.stderr)[-4000:]}")
        report = json.loads(out.read_text())
    ours, theirs = report["ours"], report["lightning"]
    for name in ("ours", "lightning"):
        seconds = sorted(report["seconds"][name])
        print(f"{name:>9}: {report[name]['python_calls']} Python calls per step; step time median"
              f" {seconds[len(seconds) // 2]:.3f} s (min {seconds[0]:.3f}, max {seconds[-1]:.3f})")
    different = {k: (ours["ops"].get(k, 0), theirs["ops"].get(k, 0)) for k in set(ours["ops"]) | set(theirs["ops"])
                 if ours["ops"].get(k, 0) != theirs["ops"].get(k, 0)}
    print(f"torch operators run a different number of times: {different or 'none'}")
    collectives = {k: v for k, v in ours["ops"].items() if k.startswith(COLLECTIVE_MARKS)}
    print("collectives per step (both sides):", json.dumps(collectives, sort_keys=True))
    print("calls into lightning_fsdp per step:", json.dumps(ours["calls_in_lightning_fsdp"], sort_keys=True))


if __name__ == "__main__":
    main()
