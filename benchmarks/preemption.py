"""Preemption and restarts, measured on examples/preemptible_train.py under torchrun (2 CPU processes by default).

Two figures:

1. **Signal to exit**: SIGTERM is sent to the worker processes (one rank only, then both) at a random point in a
   step; the clock runs until the last rank has exited. It covers the rest of the step, the agreement, the
   emergency save and the exit. Steps lost to a preemption: the step counter of the emergency save minus the last
   step the job had reached, which is 0 when the save covers every completed step.
2. **Steps lost per SIGKILL vs checkpoint interval K**: a rank is SIGKILLed at a random step under
   ``torchrun --max-restarts``; the job resumes from the newest good checkpoint. Lost = steps done before the kill
   minus the step resumed from; the figure is lost / K (at most 1, about 0.5 on average).

    python benchmarks/preemption.py --width 1024 --every 20 --kills 3

Prints one JSON object per measurement and a summary.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "preemptible_train.py"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(out: Path, args: argparse.Namespace, steps: int, restarts: int = 0) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={args.nproc}",
           f"--max-restarts={restarts}", "--monitor-interval=0.2", "--master_addr=127.0.0.1",
           f"--master_port={_port()}", str(EXAMPLE), "--steps", str(steps), "--every", str(args.every),
           "--out", str(out), "--width", str(args.width), "--log-every", "1"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _workers(launcher: subprocess.Popen, n: int) -> list[psutil.Process]:
    # torchrun starts each worker in a session of its own: signal them by PID, not by process group.
    while True:
        kids = [p for p in psutil.Process(launcher.pid).children(recursive=True) if "preemptible_train" in " ".join(p.cmdline())]
        if len(kids) == n:
            return kids
        time.sleep(0.05)


def _read_until(proc: subprocess.Popen, pattern: str, log: list[str]) -> re.Match:
    for line in proc.stdout:  # type: ignore[union-attr]
        log.append(line)
        match = re.search(pattern, line)
        if match:
            return match
    raise RuntimeError("the job ended before " + pattern + ":\n" + "".join(log[-30:]))


def signal_to_exit(args: argparse.Namespace, both: bool) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        proc = _start(Path(tmp) / "ckpt", args, steps=10_000)
        log: list[str] = []
        target = random.randint(args.every + 2, args.every * 2)
        _read_until(proc, rf"step {target} loss", log)
        workers = _workers(proc, args.nproc)
        time.sleep(random.uniform(0, 0.05))  # somewhere inside a step
        t0 = time.perf_counter()
        for w in workers if both else workers[-1:]:
            w.send_signal(signal.SIGTERM)
        psutil.wait_procs(workers, timeout=300)
        elapsed = time.perf_counter() - t0
        proc.wait(timeout=60)
        log.extend(proc.stdout.readlines())  # type: ignore[union-attr]
        text = "".join(log)
        reached = max(int(m) for m in re.findall(r"step (\d+) loss", text))
        saved = int(re.findall(r"saving step (\d+)", text)[-1])
        return {"measure": "signal_to_last_exit_s", "ranks_signalled": "all" if both else "one",
                "seconds": round(elapsed, 3), "steps_lost": max(0, reached - saved), "last_logged_step": reached,
                "saved_step": saved}


def kill_and_restart(args: argparse.Namespace) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        proc = _start(Path(tmp) / "ckpt", args, steps=args.every * (2 * args.kills + 4), restarts=args.kills)
        log: list[str] = []
        rows = []
        _read_until(proc, r"starting from scratch", log)
        start = 0
        for _ in range(args.kills):
            at = start + random.randint(1, args.every * 2)
            _read_until(proc, rf"step {at} loss", log)
            victim = random.choice(_workers(proc, args.nproc))
            t0 = time.perf_counter()
            victim.send_signal(signal.SIGKILL)
            resumed = int(_read_until(proc, r"resumed from .* at step (\d+)", log).group(1))
            rows.append({"measure": "steps_lost_per_kill", "killed_after_step": at, "resumed_at_step": resumed,
                         "lost": at - resumed, "K": args.every, "lost_over_K": round((at - resumed) / args.every, 2),
                         "kill_to_resumed_s": round(time.perf_counter() - t0, 2)})
            start = resumed
        proc.communicate(timeout=600)
        rows.append({"measure": "job_exit_code", "code": proc.returncode})
        return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--every", type=int, default=20)
    parser.add_argument("--kills", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    random.seed(args.seed)
    rows = []
    for _ in range(args.repeats):
        for both in (False, True):
            rows.append(signal_to_exit(args, both))
            print(json.dumps(rows[-1]), flush=True)
    for row in kill_and_restart(args):
        rows.append(row)
        print(json.dumps(row), flush=True)
    exits = [r["seconds"] for r in rows if r["measure"] == "signal_to_last_exit_s"]
    lost = [r["lost_over_K"] for r in rows if r["measure"] == "steps_lost_per_kill"]
    print(json.dumps({"summary": True, "signal_to_last_exit_s_max": max(exits),
                      "steps_lost_on_signal_max": max(r["steps_lost"] for r in rows if "steps_lost" in r),
                      "lost_over_K_per_kill": lost, "lost_over_K_max": max(lost) if lost else None}), flush=True)


if __name__ == "__main__":
    main()
