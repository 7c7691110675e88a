"""The test side of the fault runs with two replica groups (test_ft_fabric.py, test_ft_trainer_fault.py,
test_ft_tp.py): a lighthouse in the pytest process; group 0 started once, never stopped; group 1 started once per
planned kill, each attempt with the same replica id, then once more to finish; each group's log, pids and final record
in the run's folder (the workers' side: workers/ft_common.py)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

import forkserver
from launch import WORKERS, torchrun, worker_env

# Bounds a hang only: each attempt of a group takes a few seconds.
ATTEMPT_TIMEOUT_S = 120


def load_module(path: Path, name: str) -> ModuleType:
    """The module at ``path``, imported as ``name``, with its own folder importable while it imports: a worker imports
    workers/ft_common.py beside it, as it does when it runs as a script."""
    folder = str(path.parent)
    sys.path.insert(0, folder)
    try:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(folder)
    return module


def load_worker(name: str) -> ModuleType:
    return load_module(WORKERS / f"{name}.py", name)


def sgd_reference(worker: ModuleType, steps: int) -> dict[str, torch.Tensor]:
    """``steps`` steps of the worker's ``Net`` on its ``batch``es in this process, without FSDP, TP or faults: every
    group trains on the step's batch, so the average of the groups' gradients is the batch's."""
    torch.manual_seed(0)
    net = worker.Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    for step in range(steps):
        opt.zero_grad()
        net(worker.batch(step)).square().mean().backward()
        opt.step()
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


def one_process_group(script: str, out: Path, steps: int) -> Callable[[int, str], list[str]]:
    """A group of one rank: the worker script, forked, as ``script REPLICA_ID OUT STEPS KILL``."""
    return lambda group, kill: [forkserver.python(), str(WORKERS / script), str(group), str(out), str(steps), kill]


def torchrun_group(script: str, nproc: int, out: Path, steps: int) -> Callable[[int, str], list[str]]:
    """A group of ``nproc`` ranks under torchrun (it stops the group when a rank dies), with the same arguments."""
    return lambda group, kill: torchrun(script, nproc) + [str(group), str(out), str(steps), kill]


@dataclass
class GroupRuns:
    out: Path
    codes: list[int]  # the exit status of each attempt of group 1 in order, then group 0's

    def output(self) -> str:
        """The end of both groups' logs, for an assertion's message."""
        return "\n".join((self.out / f"group{g}.log").read_text()[-4000:] for g in (0, 1))

    def log(self, group: int) -> str:
        return (self.out / f"group{group}.log").read_text()

    def pids(self, group: int) -> list[str]:
        """Every pid that a process of the group recorded, in start order (one per rank and attempt)."""
        return (self.out / f"pids{group}").read_text().split()

    def records(self) -> tuple[dict, dict]:
        """Group 0's and group 1's final records (``group<id>.pt``)."""
        first, second = (torch.load(self.out / f"group{g}.pt") for g in (0, 1))
        return first, second


def run_two_groups(out: Path, command: Callable[[int, str], list[str]], kills: list[str], *,
                   no_kill: str = "") -> GroupRuns:
    """Start group 0, then group 1 once per entry of ``kills`` (``command(1, kill)``: that attempt dies as ``kill``
    says), one attempt after the other, then group 1 once more and wait for both. ``no_kill`` is the kill argument
    that the worker reads as none (group 0's and the last attempt's)."""
    os.environ.setdefault("RUST_LOG", "warn")  # torchft's Rust side logs every quorum at INFO otherwise
    from torchft.coordination import LighthouseServer

    env = worker_env(out)
    # A warm server for the ranks' environment first: otherwise the first attempts start as real processes.
    forkserver.wait_until_serving(forkserver.prewarm({k: v for k, v in env.items() if k not in ("RANK", "LOCAL_RANK")}),
                                  timeout_s=120)
    # min_replicas=2 as the groups have it: a quorum waits for the restarted group instead of spinning without it.
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2, join_timeout_ms=200, quorum_tick_ms=20,
                                  heartbeat_timeout_ms=1000)
    (out / "lighthouse").write_text(lighthouse.address())
    logs = {}

    def start(group: int, kill: str) -> subprocess.Popen:
        log = logs.setdefault(group, open(out / f"group{group}.log", "a"))  # noqa: SIM115 - closed below
        return subprocess.Popen(command(group, kill), env=env, stdout=log, stderr=subprocess.STDOUT)

    procs = []
    try:
        procs.append(start(0, no_kill))
        codes = []
        for kill in kills:  # each attempt of group 1 dies at its point; the next one heals and goes on
            procs.append(start(1, kill))
            codes.append(procs[-1].wait(timeout=ATTEMPT_TIMEOUT_S))
        procs.append(start(1, no_kill))
        codes += [procs[-1].wait(timeout=ATTEMPT_TIMEOUT_S), procs[0].wait(timeout=ATTEMPT_TIMEOUT_S)]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for log in logs.values():
            log.close()
        lighthouse.shutdown()
    return GroupRuns(out, codes)
