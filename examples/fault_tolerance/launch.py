"""Run a fault-tolerant job of 2 replica groups x 2 ranks on this machine, lose one rank of group 1 mid-run, and check
that the job finishes anyway with the same weights in both groups.

    python examples/fault_tolerance/launch.py                 # 20 steps, group 1 loses a rank at step 8
    python examples/fault_tolerance/launch.py --kill-at-step -1   # the same job without a fault

What it starts, as a real job would (one command each):

1. the lighthouse: ``lightning-fsdp lighthouse --min-replicas 2`` (here on a free port);
2. one ``torchrun --nproc-per-node 2 --max-restarts 3 --master-port <its own>`` per group, running ``train.py`` with
   ``REPLICA_GROUP_ID``, ``NUM_REPLICA_GROUPS`` and ``TORCHFT_LIGHTHOUSE`` set. Group 1's rank 1 SIGKILLs itself at
   ``--kill-at-step``; its torchrun stops the group's other rank and starts the group again, which heals from group 0.

With ``--min-replicas 2`` a step needs both groups, so group 0 waits in its quorum (at most the quorum timeout) while
group 1 restarts; with 1 it trains on alone meanwhile (and a short run may end before group 1 is back). Each group's
output is in ``<out>/group<id>.log``. Exit status 0 when both groups finished every step with equal weights.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_lighthouse(min_replicas: int, log: Path) -> tuple[subprocess.Popen, str]:
    """``lightning-fsdp lighthouse`` on a free port; returns the process and the address it serves at."""
    # sys.executable -m: the same Python (and installation) as this script, whether or not its bin/ is on PATH.
    # A short join timeout: the quorum does not wait long for a group beyond --min-replicas. A short heartbeat timeout:
    # a dead group stops counting as live after a second.
    env = {**os.environ, "RUST_LOG": os.environ.get("RUST_LOG", "warn")}  # torchft logs every quorum at INFO otherwise
    errors = open(log, "w")  # noqa: SIM115 - the child's stderr, for as long as it runs
    proc = subprocess.Popen([sys.executable, "-m", "lightning_fsdp", "lighthouse", "--min-replicas", str(min_replicas),
                             "--bind", "[::]:0", "--join-timeout-ms", "500", "--heartbeat-timeout-ms", "1000"],
                            stdout=subprocess.PIPE, stderr=errors, text=True, env=env)
    line = proc.stdout.readline()  # "lighthouse serving at http://<host>:<port> ..."
    found = re.search(r"http://\S+", line)
    if found is None:
        proc.kill()
        raise SystemExit(f"the lighthouse did not start: {line!r}; see {log}")
    return proc, found.group(0)


def start_group(replica_id: int, args: argparse.Namespace, lighthouse: str) -> subprocess.Popen:
    env = {**os.environ, "REPLICA_GROUP_ID": str(replica_id), "NUM_REPLICA_GROUPS": "2",
           "TORCHFT_LIGHTHOUSE": lighthouse, "RUST_LOG": os.environ.get("RUST_LOG", "warn")}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.nproc),
               "--max-restarts", str(args.max_restarts), "--master-addr", "127.0.0.1",
               "--master-port", str(free_port()),  # a rendezvous of its own: each group is a torch world
               str(HERE / "train.py"), "--steps", str(args.steps), "--out", str(args.out),
               "--min-replicas", str(args.min_replicas)]
    if replica_id == 1:
        command += ["--kill-at-step", str(args.kill_at_step), "--kill-rank", str(args.kill_rank),
                    "--kill-in", args.kill_in]
    log = open(args.out / f"group{replica_id}.log", "w")  # noqa: SIM115 - the child's; closed at exit
    return subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)


def check(out: Path, steps: int) -> list[str]:
    """What went wrong, from the groups' records (empty: both finished every step with equal weights)."""
    import torch

    records = {g: torch.load(out / f"group{g}.pt") for g in (0, 1) if (out / f"group{g}.pt").is_file()}
    if len(records) < 2:
        return [f"group{g}.pt is missing" for g in (0, 1) if g not in records]
    problems = [f"group {g} finished {record['steps']} steps, not {steps}"
                for g, record in records.items() if record["steps"] != steps]
    first, second = records[0]["weights"], records[1]["weights"]
    problems += [f"{name} differs between the groups" for name in first if not torch.equal(first[name], second[name])]
    for g, record in records.items():
        pids = (out / f"pids{g}").read_text().split()
        restarts = len(pids) // len(record["pids"]) - 1
        print(f"group {g}: {record['steps']} steps, restarted {restarts} time(s), healed {record['healed'] or 'never'},"
              f" {len(record['uncommitted'])} step(s) not committed, longest step {record['longest_step_s']:.2f} s")
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--kill-at-step", type=int, default=8, help="-1: no fault")
    parser.add_argument("--kill-rank", type=int, default=1, help="which rank of group 1 dies")
    parser.add_argument("--kill-in", choices=["step", "backward"], default="step",
                        help="where in the step: before its forward, or in the middle of its backward")
    parser.add_argument("--nproc", type=int, default=2, help="ranks per group")
    parser.add_argument("--max-restarts", type=int, default=3, help="torchrun's restarts of a group")
    parser.add_argument("--min-replicas", type=int, default=2, help="groups a step needs")
    parser.add_argument("--out", type=Path, default=Path("runs/fault_tolerance"))
    parser.add_argument("--timeout", type=float, default=600.0, help="give up after this many seconds")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for stale in [*args.out.glob("group*.pt"), *args.out.glob("pids*")]:  # a previous run's records
        stale.unlink()

    started = time.monotonic()
    lighthouse, address = start_lighthouse(args.min_replicas, args.out / "lighthouse.log")
    print(f"lighthouse at {address}", flush=True)
    groups = []
    try:
        groups = [start_group(g, args, address) for g in (0, 1)]
        deadline = started + args.timeout
        codes = []
        for group in groups:
            try:
                codes.append(group.wait(timeout=max(1.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                codes.append(None)
    finally:
        for group in groups:
            if group.poll() is None:
                group.send_signal(signal.SIGTERM)  # torchrun stops its ranks on SIGTERM
                group.wait(timeout=30)
        lighthouse.send_signal(signal.SIGTERM)
        lighthouse.wait(timeout=30)
    problems = [f"group {g}'s torchrun exited with {code} (see {args.out}/group{g}.log)"
                for g, code in enumerate(codes) if code != 0]
    problems += check(args.out, args.steps)
    for problem in problems:
        print(f"FAILED: {problem}")
    if not problems:
        print(f"both groups finished {args.steps} steps with equal weights in {time.monotonic() - started:.1f} s")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
