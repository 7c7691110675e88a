"""Fault-tolerance figures of issue 44, each a ratio against a baseline measured in the same invocation:

1. **step time with fault tolerance vs the same groups without it** (goal <= 1.10x): two replica groups of one rank
   each, two processes side by side, trained with Fabric and ``FSDPStrategy(fault_tolerance=...)`` (a per-step quorum
   at a lighthouse in this process, the cross-group gradient average, the vote), against the same two processes
   without it (each group alone: no quorum, no cross-group average, so no communication at all).
   Also, reported only: against the same two processes as one world of two ranks that all-reduces its gradients
   (``NO_SHARD``): the same communication without torchft, so the ratio is torchft's own cost (quorum, vote, its
   process group).
2. **restart to first committed step vs a cold start without fault tolerance**: group 1 is SIGKILLed while both
   groups train, and started again with the same replica id; the clock runs from its new process's start to its
   first committed step (imports, setup, joining the quorum, the heal from group 0, one step). The baseline is the
   same group's cold start without fault tolerance to its first step, beside group 0 training without it too.
3. **bytes moved to heal vs the group's state** (goal <= 1.1x): what the restarted group's heal transport received
   (``HealTransport.bytes_received``: the JSON header and every tensor message) over the bytes of the tensors of the
   state it heals (parameter shards, AdamW state, random generators: ``heal.state_bytes``).

    python benchmarks/fault_tolerance.py [--rounds 6] [--json out.json]

Each round runs every side once, in an order that alternates from round to round (``rows.alternate``); a side is
two fresh processes (one per group), then, but for the replicated side, a restarted group 1. The processes run on
CPU with gloo, one thread each. The lighthouse has the defaults of ``lightning-fsdp lighthouse`` (torchft's) but for
``--heartbeat-timeout-ms`` (see its comment), and ``min_replicas=1``, so group 0 never stops while group 1
restarts. A process is told when to go on through files in the round's directory (``ready<id>``, ``go``, ``stop``),
so that the timed steps of both groups overlap on every side. Each row's ``detail`` has the per-round seconds and
where they went (forward with the quorum's wait, backward with the average, the step with the vote; a restart's
imports, setup, first forward with the quorum and heal, first step).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from rows import alternate, emit, figure, ratios  # noqa: E402

WAIT_S = 300.0  # bound on any wait for a worker (a hang, not a measurement): a round takes about 30 s here


# ------------------------------------------------------------------------------------------------------ worker


def _wait_for(path: Path, what: str, procs: tuple = ()) -> None:
    deadline = time.monotonic() + WAIT_S
    while not path.exists():
        dead = [p for p in procs if p.poll() is not None]
        if dead:
            log = getattr(dead[0], "log_path", None)
            tail = log.read_text()[-3000:] if log is not None and log.exists() else "(no log)"
            raise SystemExit(f"[fault_tolerance] {what}: a worker exited with {dead[0].returncode} before {path.name}"
                             f" appeared; the end of its log:\n{tail}")
        if time.monotonic() > deadline:
            raise SystemExit(f"[fault_tolerance] {what}: {path} did not appear within {WAIT_S:.0f} s")
        time.sleep(0.005)


def _write(path: Path, data: dict) -> None:
    """Whole or not at all: the driver polls for the file and reads it as soon as it exists."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def worker(args: argparse.Namespace) -> None:
    """One replica group of one rank. ``--role pair``: set up, meet the other group (``go``), warm up, time
    ``--steps`` steps, then keep training. ``--role restart``: train until the first committed step and note when.
    Both train on until the driver writes ``stop`` (a thread then ends the process at once, wherever it is)."""
    import threading

    import torch
    from lightning.fabric import Fabric

    from gpt import GPT, Block, GPTConfig, batch, loss_of
    from lightning_fsdp.engine.fault_tolerance import heal
    from lightning_fsdp.fabric import FSDPStrategy

    marks = {"imported": time.monotonic()}  # where a restart's time goes (system-wide clock, as the driver's)

    torch.set_num_threads(1)
    out, rid = Path(args.dir), args.replica_id
    cfg = GPTConfig(vocab=args.vocab, dim=args.dim, layers=args.layers, heads=args.heads, seq=args.seq,
                    batch=args.batch)
    ft = None
    if args.ft:
        ft = {"replica_id": rid, "num_replica_groups": 2, "lighthouse": (out / "lighthouse").read_text(),
              "min_replicas": 1}
    if args.replicated:  # one world of both processes (launched as torchrun would), gradients all-reduced in it
        strategy = FSDPStrategy(sharding_strategy="NO_SHARD", auto_wrap_policy={Block})
    else:
        strategy = FSDPStrategy(fault_tolerance=ft, auto_wrap_policy={Block})
    fabric = Fabric(accelerator="cpu", devices=2 if args.replicated else 1, strategy=strategy)
    fabric.launch()
    torch.manual_seed(0)
    net = GPT(cfg)
    model, optimizer = fabric.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-4))
    marks["set_up"] = time.monotonic()
    if fabric.world_size != (2 if args.replicated else 1):
        raise SystemExit(f"[fault_tolerance] a world of {fabric.world_size} ranks, not the side's")
    group = fabric.strategy.replica_group if args.ft else None
    transport = group.manager._checkpoint_transport if group is not None else None  # torchft keeps it private
    if transport is not None and not hasattr(transport, "bytes_received"):
        raise SystemExit(f"[fault_tolerance] the manager's transport is a {type(transport).__name__}, not the"
                         " strategy's HealTransport: torchft renamed `_checkpoint_transport`?")

    def state_bytes() -> int:
        return heal.state_bytes(heal.produce(model.module, [optimizer.optimizer], strategy=heal.rng_state()))

    def on_stop() -> None:
        _wait_for(out / "stop", f"group {rid} waiting for the end")
        if transport is not None:
            _write(out / f"end{rid}.{args.role}.json", {"bytes_sent": transport.bytes_sent})
        os._exit(0)  # wherever the training loop is: the round is over, and nothing of it is kept

    threading.Thread(target=on_stop, daemon=True).start()

    phases: list[list[float]] = []  # per timed step: forward (with the quorum's wait), backward (with the cross-group
    # average), optimizer step (with the vote)

    def step(i: int) -> bool:
        t0 = time.perf_counter()
        loss = loss_of(model, batch(cfg, i, rid))
        t1 = time.perf_counter()
        marks.setdefault("first_forward", time.monotonic())  # with the quorum and, in a restart, the heal
        fabric.backward(loss)
        t2 = time.perf_counter()
        voted = optimizer.step()  # under fault tolerance the vote; otherwise whatever the optimizer returns
        committed = voted if args.ft else True
        optimizer.zero_grad()
        phases.append([t1 - t0, t2 - t1, time.perf_counter() - t2])
        return bool(committed)

    i = 0
    if args.role == "restart":
        committed = False
        while not committed:
            committed = step(i)
            i += 1
        done = time.monotonic()  # system-wide clock: the driver took its own reading before starting this process
        result = {"first_commit": done, "attempts": i, "marks": marks}
        if group is not None:
            if transport.bytes_received == 0 or group.current_step <= i:
                raise SystemExit(f"[fault_tolerance] the restarted group did not heal (step {group.current_step} after"
                                 f" {i} attempts, {transport.bytes_received} bytes received)")
            result.update(bytes_received=transport.bytes_received, state_bytes=state_bytes(),
                          step=group.current_step, participants=group.manager.num_participants())
        _write(out / f"restart{rid}.json", result)
    else:
        _write(out / f"ready{rid}", {})
        _wait_for(out / "go", f"group {rid} waiting for the other")
        for _ in range(args.warmup):
            step(i)
            i += 1
        phases.clear()
        times, lone, uncommitted = [], 0, 0
        for _ in range(args.steps):
            start = time.perf_counter()
            committed = step(i)
            times.append(time.perf_counter() - start)
            i += 1
            uncommitted += not committed
            if group is not None and group.manager.num_participants() != 2:
                lone += 1
        result = {"step_s": times, "uncommitted": uncommitted, "steps_without_the_other_group": lone,
                  "phases_s": [statistics.median(p[k] for p in phases) for k in range(3)]}
        if group is not None:
            result["state_bytes"] = state_bytes()
        _write(out / f"pair{rid}.json", result)
    while True:  # load beside the other group's restart, until `stop`
        step(i)
        i += 1


# ------------------------------------------------------------------------------------------------------ driver


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Side:
    """One side of one round: two groups side by side (``ft``: with fault tolerance, ``plain``: each alone), then
    group 1 killed and restarted; or (``replicated``) the same two processes as one world of two ranks that
    all-reduces its gradients (NO_SHARD), timed only."""

    def __init__(self, args: argparse.Namespace, root: Path, mode: str, n: int) -> None:
        self.args, self.mode, self.ft = args, mode, mode == "ft"
        self.dir = root / f"{mode}{n}"
        self.dir.mkdir()
        self.port = _port()

    def start(self, rid: int, role: str) -> subprocess.Popen:
        a = self.args
        cmd = [sys.executable, __file__, "--worker", "--dir", str(self.dir), "--replica-id", str(rid), "--role", role,
               "--steps", str(a.steps), "--warmup", str(a.warmup), "--vocab", str(a.vocab), "--dim", str(a.dim),
               "--layers", str(a.layers), "--heads", str(a.heads), "--seq", str(a.seq), "--batch", str(a.batch),
               *(["--ft"] if self.ft else []), *(["--replicated"] if self.mode == "replicated" else [])]
        # A port of its own for each process's one-rank world; one thread per process, two processes on the cores.
        env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_port()),
                   RUST_LOG=os.environ.get("RUST_LOG", "warn"), PYTHONUNBUFFERED="1")
        if self.mode == "replicated":  # what torchrun would set: Lightning then launches nothing itself
            env.update(MASTER_PORT=str(self.port), RANK=str(rid), LOCAL_RANK=str(rid), WORLD_SIZE="2",
                       LOCAL_WORLD_SIZE="2", GROUP_RANK="0", TORCHELASTIC_RUN_ID="fault_tolerance_benchmark")
        log_path = self.dir / f"{role}{rid}.log"
        with open(log_path, "a") as log:
            proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        proc.log_path = log_path  # type: ignore[attr-defined]
        self.procs.append(proc)
        return proc

    def run(self) -> dict:
        self.procs: list[subprocess.Popen] = []
        lighthouse = None
        if self.ft:
            from torchft.coordination import LighthouseServer

            lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, **lighthouse_settings(self.args))
            (self.dir / "lighthouse").write_text(lighthouse.address())
        try:
            first = [self.start(0, "pair"), self.start(1, "pair")]
            for rid in (0, 1):
                _wait_for(self.dir / f"ready{rid}", "setup", tuple(self.procs))
            (self.dir / "go").touch()
            pair = []
            for rid in (0, 1):
                _wait_for(self.dir / f"pair{rid}.json", "the timed steps", tuple(self.procs))
                pair.append(json.loads((self.dir / f"pair{rid}.json").read_text()))
            restart, started = {"first_commit": float("nan")}, 0.0
            if self.mode != "replicated":
                first[1].send_signal(signal.SIGKILL)
                first[1].wait()
                started = time.monotonic()
                self.start(1, "restart")
                _wait_for(self.dir / "restart1.json", "the restart", (first[0], self.procs[-1]))
                restart = json.loads((self.dir / "restart1.json").read_text())
            (self.dir / "stop").touch()
            for proc in (first[0], self.procs[-1]):
                proc.wait(timeout=WAIT_S)
            end = self.dir / "end0.pair.json"
            sent = json.loads(end.read_text())["bytes_sent"] if end.exists() else None
        finally:
            for proc in self.procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
            if lighthouse is not None:
                lighthouse.shutdown()
        for rid, p in enumerate(pair):
            if p["uncommitted"] or p["steps_without_the_other_group"]:
                raise SystemExit(f"[fault_tolerance] group {rid} had {p['uncommitted']} uncommitted timed steps and"
                                 f" {p['steps_without_the_other_group']} without the other group: not the row's"
                                 f" setting; logs in {self.dir}")
        phases = {}
        if "marks" in restart:  # seconds from the process's start to each mark, and between them
            points = [("start", started), *restart["marks"].items(), ("first_commit", restart["first_commit"])]
            phases = {f"{a}_to_{b}": round(tb - ta, 3) for (a, ta), (b, tb) in zip(points, points[1:])}
        return {"step_s": statistics.mean(statistics.median(p["step_s"]) for p in pair), "restart_phases_s": phases,
                "phases_ms": [round(statistics.mean(p["phases_s"][k] for p in pair) * 1e3, 1) for k in range(3)],
                "restart_s": restart["first_commit"] - started, "restart": restart, "bytes_sent_by_group0": sent,
                "state_bytes": pair[0].get("state_bytes")}


def lighthouse_settings(args: argparse.Namespace) -> dict:
    """The lighthouse a user starts with `lightning-fsdp lighthouse` (its defaults are torchft's), but for
    ``--heartbeat-timeout-ms``."""
    import inspect

    from lightning_fsdp.engine.fault_tolerance import lighthouse

    settings = {k: v.default for k, v in inspect.signature(lighthouse.serve).parameters.items() if k.endswith("_ms")}
    settings["heartbeat_timeout_ms"] = args.heartbeat_timeout_ms
    return settings


def _median_phases(rounds: list[dict]) -> dict:
    return {k: round(statistics.median(r[k] for r in rounds), 3) for k in rounds[0]} if rounds else {}


def _median_ms(results: list[dict], what: str) -> dict:
    """Medians over the rounds of a side's step time and of each of its phases, in ms, each addressable by name
    (``detail.median_ms_ft.backward``) for the docs' record markers."""
    phases = {name: round(statistics.median(r["phases_ms"][k] for r in results), 1)
              for k, name in enumerate(("forward", "backward", "optimizer"))}
    return {f"median_ms_{what}": {"step": round(statistics.median(r["step_s"] for r in results) * 1e3, 1), **phases}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=6, help="even: each side goes first as often as last")
    parser.add_argument("--steps", type=int, default=16, help="timed steps per group and side")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps of both groups together first")
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=4)
    # How long a killed group's old process still counts as live. `lightning-fsdp lighthouse` defaults to torchft's
    # 5000; here a restarted group reaches its first quorum about 3.8 s after its process starts (imports), so with
    # 5000 its quorum waits out the rest of the old process's 5 s and the restart figure measures that setting
    # (1.21-1.39x in three runs of 2026-11-29, about 1.5 s of it waiting), not the join, heal and step.
    parser.add_argument("--heartbeat-timeout-ms", type=int, default=1000,
                        help="the lighthouse's heartbeat timeout (`lightning-fsdp lighthouse --heartbeat-timeout-ms`)")
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    parser.add_argument("--replica-id", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--role", choices=["pair", "restart"], help=argparse.SUPPRESS)
    parser.add_argument("--ft", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--replicated", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    os.environ.setdefault("RUST_LOG", "warn")  # torchft's Rust side logs every quorum at INFO otherwise

    from gpt import GPTConfig, num_params

    params = num_params(GPTConfig(vocab=args.vocab, dim=args.dim, layers=args.layers, heads=args.heads,
                                  seq=args.seq, batch=args.batch))
    results: dict[str, list[dict]] = {"ft": [], "plain": [], "replicated": []}
    with tempfile.TemporaryDirectory() as tmp:
        counter = iter(range(10**6))

        def side(mode: str) -> float:
            result = Side(args, Path(tmp), mode, next(counter)).run()
            results[mode].append(result)
            print(f"[fault_tolerance] {mode}: step {result['step_s'] * 1e3:.1f} ms (forward, backward, optimizer"
                  f" {result['phases_ms']} ms), restart to first step {result['restart_s']:.2f} s", flush=True)
            return result["step_s"]

        alternate(args.rounds, {mode: (lambda mode=mode: side(mode)) for mode in results})
    ft, plain, replicated = results["ft"], results["plain"], results["replicated"]
    state = ft[0]["restart"]["state_bytes"]
    model = (f"GPT of {params / 1e6:.2f}M parameters (dim {args.dim}, {args.layers} layers, batch"
             f" {args.batch}x{args.seq})")
    setting = ("2 replica groups x 1 rank, CPU/gloo, 1 thread each, AdamW, Fabric; lighthouse in the driver,"
               f" min_replicas=1, {', '.join(f'{k}={v}' for k, v in lighthouse_settings(args).items())}")
    rows = [
        figure("step time with fault tolerance vs the same groups without it (2 groups x 1 rank)",
               ratios([r["step_s"] for r in ft], [r["step_s"] for r in plain]),
               baseline="each group alone (no quorum, no cross-group average)", target=("<=", 1.10),
               detail={"setting": setting, "model": model, "params": params,
                       "step_ms_ft": [round(r["step_s"] * 1e3, 1) for r in ft],
                       "step_ms_plain": [round(r["step_s"] * 1e3, 1) for r in plain],
                       "phases": "median ms of forward (with the quorum's wait), backward (with the cross-group"
                                 " average), optimizer step (with the vote), per round",
                       "phases_ms_ft": [r["phases_ms"] for r in ft],
                       "phases_ms_plain": [r["phases_ms"] for r in plain],
                       **_median_ms(ft, "ft"), **_median_ms(plain, "plain")}),
        figure("step time with fault tolerance vs the same 2 processes as one replicated world (NO_SHARD)",
               ratios([r["step_s"] for r in ft], [r["step_s"] for r in replicated]),
               baseline="one world of 2 ranks all-reducing its gradients (the same communication, no torchft)",
               detail={"setting": setting, "model": model, "params": params,
                       "step_ms_replicated": [round(r["step_s"] * 1e3, 1) for r in replicated],
                       "phases_ms_replicated": [r["phases_ms"] for r in replicated],
                       **_median_ms(ft, "ft"), **_median_ms(replicated, "replicated")}),
        figure("fault tolerance: restart to first committed step vs a cold start to first step",
               ratios([r["restart_s"] for r in ft], [r["restart_s"] for r in plain]),
               baseline="the same group's cold start without fault tolerance to its first step",
               detail={"setting": setting, "model": model, "state_bytes": state,
                       "notes": f"group 1 SIGKILLed and restarted; from its process start: imports, setup, quorum,"
                                f" a heal of {state / 2**20:.1f} MiB of state from group 0, one step",
                       "restart_s_ft": [round(r["restart_s"], 2) for r in ft],
                       "cold_start_s_plain": [round(r["restart_s"], 2) for r in plain],
                       "phases_s_ft": _median_phases([r["restart_phases_s"] for r in ft]),
                       "phases_s_plain": _median_phases([r["restart_phases_s"] for r in plain]),
                       "median_restart_s_ft": round(statistics.median(r["restart_s"] for r in ft), 2),
                       "median_cold_start_s_plain": round(statistics.median(r["restart_s"] for r in plain), 2)}),
        figure("fault tolerance: bytes moved to heal vs the group's state",
               [r["restart"]["bytes_received"] / r["restart"]["state_bytes"] for r in ft],
               baseline="tensor bytes of the healed state (parameter shards, AdamW state, random generators)",
               target=("<=", 1.1),
               detail={"setting": setting, "model": model, "state_bytes": state,
                       "bytes_received": [r["restart"]["bytes_received"] for r in ft],
                       "bytes_sent_by_group0": [r["bytes_sent_by_group0"] for r in ft]}),
    ]
    emit(rows, args.json)


if __name__ == "__main__":
    main()
