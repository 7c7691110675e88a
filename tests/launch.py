"""Pytest-side launcher for the multi-process workers in ``tests/workers``.

Fabric's own launcher re-executes ``sys.argv``, which under pytest would re-run pytest, so workers are started as
scripts under ``torch.distributed.run``. Results come back through files (see ``workers/harness.py``).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pytest

import forkserver

WORKERS = Path(__file__).parent / "workers"
LAUNCH_TIMEOUT_S = 900


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# What every Python process the suite starts gets, launches and scripts alike. One set of values, so that the same
# warm servers fork them all (a server serves one environment: tests/forkserver).
PROCESS_ENV = dict(
    OMP_NUM_THREADS="1",
    PYTHONUNBUFFERED="1",
    PYTHONWARNINGS="ignore::DeprecationWarning",
    # On an abort, Python prints every thread's stack: the only clue to which thread ends a process at exit.
    PYTHONFAULTHANDLER="1",
)


def script_env(**extra: str) -> dict[str, str]:
    """The environment of a script the test runs with ``forkserver.python()`` (an example, a litgpt command, a
    README snippet): this process's, with :data:`PROCESS_ENV` and the fork servers' variables."""
    return {**os.environ, **PROCESS_ENV, **forkserver.env(), **extra}


def worker_env(out: Path, *, forked: bool = True, full_exit: bool = False, **extra: str) -> dict[str, str]:
    """The environment of a launch's processes: torchrun forks its ranks from warm servers (``tests/forkserver``).
    ``full_exit=True`` for a launch whose test is about how its ranks exit: they end as a new interpreter does (see
    ``forkserver.env``). ``forked=False`` for ranks that must be real processes (see CONTRIBUTING.md, "Forked or
    real processes"); torchrun itself is forked either way, as :func:`torchrun` says."""
    env = dict(os.environ)
    env.update(
        LFSDP_TEST_OUT=str(out),
        PYTHONPATH=os.pathsep.join([str(WORKERS), env.get("PYTHONPATH", "")]),
        **PROCESS_ENV,
    )
    env.update(forkserver.env(ranks=forked, full_exit=full_exit))
    env.update(extra)
    return env


def torchrun(script: str, nproc: int, *, nnodes: int = 1, node_rank: int = 0, port: int | None = None,
             forked: bool = True) -> list[str]:
    """torchrun's command. torchrun itself is forked from a warm server (where the launch's environment has one):
    no test is about torchrun's own process, and a launch that must have real ranks says so in
    :func:`worker_env`. ``forked=False`` runs it as a real process."""
    return [
        forkserver.python() if forked else sys.executable, "-m", "torch.distributed.run",
        f"--nproc_per_node={nproc}", f"--nnodes={nnodes}", f"--node_rank={node_rank}",
        "--master_addr=127.0.0.1", f"--master_port={port or free_port()}",
        str(WORKERS / script),
    ]


# Every launch's results folder, for the summary of the slowest cases (conftest.py).
LAUNCHED: set[Path] = set()


@dataclass
class Launch:
    out: Path
    world_size: int
    log: str
    # torchrun's exit status (None for launches that do not report one). Every rank writing a passing result is
    # not enough: a rank that crashes at exit, after its last result file, makes torchrun exit non-zero, and a
    # user's script, CI and the benchmarks would see that exit code.
    returncode: int | None = None

    def __post_init__(self):
        LAUNCHED.add(self.out)

    def result(self, name: str, rank: int) -> dict:
        path = self.out / f"{name}.rank{rank}.json"
        if not path.is_file():
            if (self.out / f"{name}.rank{rank}.stacks.txt").is_file():
                why = f"rank {rank} ended inside this case (a crash or a kill; its stacks, if it had any, follow)"
            else:
                elsewhere = [str(p.relative_to(self.out.parent)) for p in _died_in(self.out.parent, rank)]
                why = (f"the case never started on rank {rank}; the rank ended earlier, in {', '.join(elsewhere)}"
                       if elsewhere else f"rank {rank} never reached it")
            pytest.fail(f"case {name!r} wrote no result on rank {rank}: {why}{self.stalls(name)}\nlaunch log tail:\n"
                        f"{self.log[-6000:]}")
        return json.loads(path.read_text())

    def stalls(self, name: str) -> str:
        """The stacks that faulthandler wrote for case ``name``: of a rank still in it after ``harness.STALL_S``, or
        of a rank that a fatal signal (a segfault, an abort) ended in it."""
        found = [*self.out.glob(f"{name}.rank*.crash.txt"), *self.out.glob(f"{name}.rank*.stacks.txt")]
        why = {"crash.txt": "a fatal signal in its first run", "stacks.txt": "a stall or a fatal signal"}

        def kind(path: Path) -> str:  # a case's name may hold dots (`docs-guides-huggingface.md-L105`)
            return why[".".join(path.name.rsplit(".", 2)[-2:])]

        return "".join(f"\n--- {path.name}: written by faulthandler ({kind(path)}) ---\n"
                       f"{path.read_text()[-4000:]}" for path in sorted(found) if path.stat().st_size)

    def check(self, name: str) -> list[dict]:
        """Fail unless the case passed on every rank; return each rank's details. A case that returned
        ``{"not_run": reason}`` on a rank checked nothing there, and fails: a test reads a case only where it runs
        (``{"skipped": reason}`` is for what the machine lacks, and :func:`case_tests` reports it as a skip)."""
        details = []
        for rank in range(self.world_size):
            record = self.result(name, rank)
            if not record["ok"]:
                pytest.fail(f"case {name!r} failed on rank {rank}:\n{record['error']}{self.stalls(name)}")
            if isinstance(record["details"], dict) and "not_run" in record["details"]:
                pytest.fail(f"case {name!r} did not run on rank {rank} of this {self.world_size}-rank launch"
                            f" ({record['details']['not_run']}), so it checked nothing. HINT: read it from a launch"
                            " where it runs, or make the case run here.")
            details.append(record["details"])
        if self.returncode not in (0, None) and not self._a_case_failed():
            pytest.fail(
                f"case {name!r} passed on every rank, but the launch exited with status {self.returncode} although"
                f" no case failed (a crash at exit?); launch log tail:\n{self.log[-6000:]}"
            )
        return details

    def _a_case_failed(self) -> bool:
        """Whether a rank meant to exit 1 because a case failed: that case reports it, the others need not."""
        markers = [self.out / f"_exit.rank{rank}.json" for rank in range(self.world_size)]
        return any(m.is_file() and json.loads(m.read_text())["code"] != 0 for m in markers)


def launch(script: str, nproc: int, tmp: Path, **env) -> Launch:
    """One launch of ``script`` on ``nproc`` ranks, results in ``tmp/<script stem>``; ``env``: :func:`worker_env`'s
    keywords."""
    out = tmp / Path(script).stem
    proc = subprocess.run(
        torchrun(script, nproc), env=worker_env(out, **env), capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S
    )
    return Launch(out=out, world_size=nproc, log=proc.stdout + proc.stderr, returncode=proc.returncode)


# The pools: worker scripts whose cases share one launch, keyed by (world size, environment). Filled as test files
# are collected (``case_tests`` at module level); SELECTED, set by conftest.py once collection is done, holds the
# test modules that have selected tests, so a run of one file or a `-k` selection launches only what it needs.
_POOLS: dict[tuple, list[tuple[str, str]]] = {}
_POOL_LAUNCHES: dict[tuple, tuple[Path, str, int, list[str]]] = {}
# Set when the background thread has run the pool of that key (or failed to): a test waits for its own pool, not for
# the pools after it.
_BACKGROUND: dict[tuple, threading.Event] = {}
SELECTED: set[str] | None = None
# Pools whose environment exists only once the session runs (a server the pytest process starts: the S3 server of
# tests/s3server.py, or a file the launch reads): the pool's key holds ENV_FROM=<name of a function>, and the function,
# called with the launch's folder when the pool's turn comes in the background thread (or when a test first needs it),
# gives the rest of its environment.
ENV_FROM = "LFSDP_TEST_ENV_FROM"
ALONE = "LFSDP_TEST_ALONE"  # in a pool's key: the one script of a pool of its own (``case_tests(..., alone=True)``)
_ENV_FROM: dict[str, Callable[[Path], dict[str, str]]] = {}
# The fixtures that give a pool's launch, by test module: a test that uses one waits for its pool (conftest.py runs
# such tests last).
POOL_FIXTURES: dict[str, set[str]] = {}
# Where the suite's time went, for the summary at its end (conftest.py): each pool's folder name, scripts and
# (start, end) in seconds after the pools were started, and how long tests waited for the background pools.
POOL_TIMES: dict[str, tuple[int, float, float]] = {}
POOL_WAIT_S = 0.0
_T0 = time.monotonic()


def start_pools(root: Path) -> None:
    """Start every pool of selected scripts now, one after another in a background thread, so that they run while
    the tests that need no pool do (conftest.py runs the tests that read a pool's results last, and the tests marked
    ``single_process`` first, which would leave a core idle without a pool beside them)."""
    keys = _selected_pools()
    if not keys:
        return

    global _T0
    _T0 = time.monotonic()
    # A server for torchrun and its ranks (one serves them all), before the pools start, so that their first
    # launches are forked.
    server = forkserver.prewarm({k: v for k, v in worker_env(root).items() if k not in ("RANK", "LOCAL_RANK")})

    def run_all() -> None:
        forkserver.wait_until_serving(server)
        for key in keys:
            try:
                scripts = [s for s, module in _POOLS[key] if SELECTED is None or module in SELECTED]
                _POOL_LAUNCHES[key] = run_pool(key, root / f"pool{key[0]}-{keys.index(key)}",
                                               list(dict.fromkeys(scripts)))
            finally:
                _BACKGROUND[key].set()

    for key in keys:
        _BACKGROUND[key] = threading.Event()
    threading.Thread(target=run_all, name="pools", daemon=True).start()


def _selected_pools() -> list[tuple]:
    """The keys of the pools with a selected script, in the order the background thread runs them."""
    return [key for key, members in sorted(_POOLS.items())
            if any(SELECTED is None or module in SELECTED for _, module in members)]


def reads_a_pool(item) -> bool:
    """Whether the pytest item uses a fixture that gives a pool's launch (it waits for that pool)."""
    module = getattr(getattr(item, "module", None), "__name__", "")
    return bool(POOL_FIXTURES.get(module, set()) & set(getattr(item, "fixturenames", ())))


def last_pool_of(module: str) -> int:
    """The position, in the order the pools run, of the last pool that runs a script of test module ``module``
    (conftest.py runs the tests that read the first pools first: they need not wait for the later ones)."""
    keys = sorted(_POOLS)
    return max((keys.index(key) for key, members in _POOLS.items() if any(m == module for _, m in members)),
               default=-1)


# The niceness of a pool's ranks (``workers/pool.py``). The pools run in the background while the other tests run, and
# most of those leave a core idle part of the time; at normal priority the pools took an equal share of the CPU,
# ended well before the other tests did and left those to run alone, idle cores and all, for the last third of the
# suite. At a lower priority they take mostly the CPU the other tests leave idle, and last about as long as those. A
# niceness of 10 gives a pool rank about a tenth of a busy core: no pooled case has a time limit close to that.
POOL_NICE = 10

# A pool whose rank died inside a case (a segfault, say) is started again this many times at most: first for that case
# and the ones after it, then, if the case ends a rank again, for the ones after it alone. A case that ends a rank
# twice fails, showing its stacks; the cases after it still run and report.
POOL_RESTARTS = 4


# Runs that a test module starts in the background ahead of its tests, with the first test after the single_process
# group (conftest.py), instead of when its first test needs them: for runs that wait more than they compute (the README's command: real processes starting, then 2 ranks
# waiting on each other's collectives, 31 s of wall time for 23 s of CPU on the 2-core reference machine), whose wall
# time in the foreground would leave a core idle. Keyed by test module; each value is what the module's start function
# returned, taken by its fixture (:func:`early`).
_EARLY: dict[str, Callable[[Path], Any]] = {}
_EARLY_STARTED: dict[str, Any] = {}
_EARLY_DONE: threading.Event | None = None  # set once the thread of start_early_runs has started every run
_BACKGROUND_PROCS: list[subprocess.Popen] = []


def start_early(start: Callable[[Path], Any]) -> Callable[[Path], Any]:
    """Decorator, at a test module's top level: ``start(folder)`` starts the module's runs ahead of its tests, if a
    test of the module is selected (:func:`start_early_runs`); the module's fixture takes what it returned with
    ``early(__name__)``, or calls ``start`` itself where nothing was started (a run that did not start the pools)."""
    _EARLY[sys._getframe(1).f_globals.get("__name__", "")] = start
    return start


def start_early_runs(root: Path) -> None:
    """Call the start function of every selected module that registered one (conftest.py, with the first test after the
    single_process group), in a background thread, once a warm server serves the scripts' environment (:func:`script_env`), so that the processes
    they start with ``forkserver.python()`` are forked rather than real."""
    selected = {module: start for module, start in _EARLY.items() if SELECTED is None or module in SELECTED}
    if not selected:
        return
    global _EARLY_DONE
    _EARLY_DONE = done = threading.Event()

    def start_all() -> None:
        try:
            forkserver.wait_until_serving(
                forkserver.prewarm({k: v for k, v in script_env().items() if k not in ("RANK", "LOCAL_RANK")}))
            for module, start in selected.items():
                folder = root / module
                folder.mkdir(parents=True, exist_ok=True)
                _EARLY_STARTED[module] = start(folder)
        finally:
            done.set()

    threading.Thread(target=start_all, name="early-runs", daemon=True).start()


def early(module: str) -> Any:
    """What ``module``'s start function returned in :func:`start_early_runs`, or None if it was not called there."""
    if _EARLY_DONE is not None:
        _EARLY_DONE.wait(timeout=120)  # its thread waits for a server at most 60 s
    return _EARLY_STARTED.pop(module, None)


def popen_in_background(command: list[str], **kwargs) -> subprocess.Popen:
    """``subprocess.Popen(command, **kwargs)`` in a session of its own, so that :func:`stop_background` can kill it
    with everything it started. At normal priority: started beside the launches of the tests after the single_process
    group, which keep both cores busy much of the time, a run at the pools' priority got so little CPU that the README
    command's test still waited 39 s for it (2026-11-29)."""
    proc = subprocess.Popen(command, start_new_session=True, **kwargs)
    _BACKGROUND_PROCS.append(proc)
    return proc


def stop_background(procs: list[subprocess.Popen] | None = None) -> None:
    """Kill the process group of each of ``procs`` (default: every background run) that is still running: a test that
    failed before waiting for it, a session that ended before its test."""
    for proc in _BACKGROUND_PROCS if procs is None else procs:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()


def run_pool(key: tuple, out: Path, scripts: list[str]) -> tuple[Path, str, int | None, list[str]]:
    """Run ``scripts``' cases in one ``workers/pool.py`` launch into ``out``; return ``(out, log, torchrun's exit
    status, scripts)``."""
    started = time.monotonic() - _T0
    try:
        try:
            env = _resolved(dict(key[1]), out)
        except Exception as err:  # noqa: BLE001 - every test of the pool fails with this, the other pools still run
            return out, f"the pool's environment could not be made ({dict(key[1]).get(ENV_FROM)}): {err!r}", None, scripts
        return _run_pool_attempts(key[0], env, out, scripts)
    finally:
        POOL_TIMES[out.name] = (len(scripts), started, time.monotonic() - _T0)


def _run_pool_attempts(nproc: int, env: dict[str, str], out: Path,
                       scripts: list[str]) -> tuple[Path, str, int | None, list[str]]:
    logs, skip = [], out / "_skip.txt"
    env = {"LFSDP_TEST_NICE": str(POOL_NICE), **env}  # a pool whose key says otherwise keeps its own niceness
    for attempt in range(1 + POOL_RESTARTS):
        extra = {"LFSDP_TEST_SKIP_FILE": str(skip)} if attempt else {}
        try:
            proc = subprocess.run(torchrun("pool.py", nproc),
                                  env=worker_env(out, LFSDP_TEST_SCRIPTS=",".join(scripts), **extra, **env),
                                  capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)
        except subprocess.TimeoutExpired as err:
            logs.append(f"the pool ran past {LAUNCH_TIMEOUT_S} s: {err}")
            return out, "\n".join(logs), None, scripts
        logs.append(proc.stdout + proc.stderr)
        if proc.returncode == 0 or attempt == POOL_RESTARTS:
            break
        died_in = _first_unfinished(out, nproc)
        if died_in is None:  # every case that started ended on every rank: cases failed, no rank died in one
            break
        logs.append(f"=== the pool lost a rank in case {died_in}; started again for the cases it had not finished")
    return out, "\n".join(logs), proc.returncode, scripts


def _first_unfinished(out: Path, nproc: int) -> str | None:
    """The first case (``<script stem>/<case>``, in the order the pool ran them) that a rank died in (:func:`_died_in`),
    not counting the cases skipped already. Before the pool starts again, the cases before it go into the skip file,
    and the case itself too if it has ended a rank before, so the next start runs, on every rank alike, the rest; what
    the surviving ranks wrote for those (failures to reach the dead rank, mostly) is removed, to be written again."""
    skip = out / "_skip.txt"
    skipped = set(skip.read_text().split()) if skip.is_file() else set()
    logs = [out / f"_started.rank{rank}.txt" for rank in range(nproc)]
    started = max((log.read_text().split() if log.is_file() else [] for log in logs), key=len)
    order = [name for name in dict.fromkeys(started) if name not in skipped]
    died_in = {f"{stacks.parent.name}/{stacks.name[:-len(f'.rank{rank}.stacks.txt')]}"
               for rank in range(nproc) for stacks in _died_in(out, rank)}
    if not died_in & set(order):
        return None
    first = min(order.index(name) for name in died_in & set(order))
    dead = order[first]
    if any(out.glob(f"{dead}.rank*.crash.txt")):  # it ended a rank twice: it stays a failure, with its stacks
        ran = order[:first + 1]
    else:
        # The case a rank ended in runs once more, first in the next start: a crash of native code that the same
        # case does not repeat (three times in about twenty runs of the pool, each in a native thread; the one core
        # dump showed heap corruption caught in gloo's transport thread: CONTRIBUTING.md) then costs no test, while
        # the first crash's stacks stay beside the case, and the summary lists it (conftest.py).
        ran = order[:first]
        for path in out.glob(f"{dead}.rank*.stacks.txt"):
            path.rename(path.with_name(path.name.replace(".stacks.txt", ".crash.txt")))
        for path in out.glob(f"{dead}.rank*.json"):
            path.unlink()
    skip.write_text("\n".join(sorted(skipped | set(ran))))
    for name in order[first + 1:]:
        for path in out.glob(f"{name}.rank*.*"):
            path.unlink()
    return dead


def _died_in(root: Path, rank: int) -> list[Path]:
    """The cases under ``root`` (a launch's folder, or a pool's) that rank ``rank`` started and never finished: their
    stacks file, which ``harness.run_cases`` removes when a case ends, is there and their result is not."""
    return [stacks for stacks in sorted(root.glob(f"**/*.rank{rank}.stacks.txt"))
            if not stacks.with_name(stacks.name.replace(".stacks.txt", ".json")).is_file()]


def _key_env(env: dict[str, str], env_from: Callable[[Path], dict[str, str]] | None) -> dict[str, str]:
    """``env`` as a pool's key holds it: with ``env_from``'s name where one is given (registered for
    :func:`_resolved`), so that the scripts of every module naming the same function share one pool."""
    if env_from is None:
        return env
    name = f"{env_from.__module__}.{env_from.__qualname__}"
    _ENV_FROM[name] = env_from
    return {**env, ENV_FROM: name}


def _resolved(env: dict[str, str], out: Path) -> dict[str, str]:
    """A pool's key environment with the variables of its ``env_from`` function (:func:`_key_env`), called with the
    launch's folder ``out`` (made here) for the files it may write."""
    name = env.get(ENV_FROM)
    if not name:
        return env
    out.mkdir(parents=True, exist_ok=True)
    return {**env, **_ENV_FROM[name](out)}


def pooled_launch(script: str, nproc: int, tmp_path_factory, env: dict[str, str]) -> Launch:
    """The launch that ran ``script``'s cases: one ``workers/pool.py`` launch for every selected script of the same
    world size and environment, started in the background when collection ends (:func:`start_pools`) or else by
    the first test that needs it."""
    key = (nproc, tuple(sorted(env.items())))
    if key in _BACKGROUND:
        global POOL_WAIT_S
        waited = time.monotonic()
        _BACKGROUND[key].wait(timeout=2 * LAUNCH_TIMEOUT_S * len(_BACKGROUND))
        POOL_WAIT_S += time.monotonic() - waited
    if key not in _POOL_LAUNCHES:
        members = [s for s, module in _POOLS.get(key, []) if SELECTED is None or module in SELECTED]
        scripts = list(dict.fromkeys(members + [script]))
        if len(scripts) == 1:
            out = tmp_path_factory.mktemp(Path(script).stem)
            return launch(script, nproc, out, **_resolved(env, out))
        _POOL_LAUNCHES[key] = run_pool(key, tmp_path_factory.mktemp(f"pool{nproc}"), scripts)
    out, log, returncode, scripts = _POOL_LAUNCHES[key]
    if script not in scripts:  # not selected when the pool started (cannot happen in one session; kept safe)
        out = tmp_path_factory.mktemp(Path(script).stem)
        return launch(script, nproc, out, **_resolved(env, out))
    return Launch(out=out / Path(script).stem, world_size=nproc, log=log, returncode=returncode)


def pooled(script: str, nproc: int, *, name: str, env_from: Callable[[Path], dict[str, str]] | None = None,
           **env: str):
    """A module-scoped fixture ``name`` giving the :class:`Launch` that ran ``script``'s cases in its pool, for a test
    file that checks the cases itself (``name.check(case)``) rather than through :func:`case_tests`; ``env_from``:
    as there."""
    env = _key_env(env, env_from)
    module = sys._getframe(1).f_globals.get("__name__", "")
    _POOLS.setdefault((nproc, tuple(sorted(env.items()))), []).append((script, module))
    POOL_FIXTURES.setdefault(module, set()).add(name)

    @pytest.fixture(scope="module", name=name)
    def fixture(tmp_path_factory):
        return pooled_launch(script, nproc, tmp_path_factory, env)

    return fixture


def case_tests(script: str, nproc: int, cases: list[str], *, pooled: bool = True, alone: bool = False,
               env_from: Callable[[Path], dict[str, str]] | None = None, **env: str):
    """The fixture and the parametrized test for a worker script: one launch, one pytest result per case.

    Use at module level: ``results, test_case = case_tests("fabric_core.py", 2, CASES)``; ``env`` goes to the
    workers' environment. A case whose every rank passed but one reported ``{"skipped": reason}`` (it needs what
    this machine lacks, such as a tmpfs mount) is reported as skipped, not passed.

    The script's cases run in one launch with those of the other selected scripts of the same world size and ``env``
    (``workers/pool.py``): a launch costs seconds of imports and rendezvous, a case often less. ``pooled=False`` gives
    the script a launch of its own: for cases that measure their process (its memory), or that the cases of other
    scripts must not share a process with (see CONTRIBUTING.md).

    ``alone=True``: a launch of the script's own, with processes of its own as ``pooled=False`` gives, but started in
    the background with the pools (a pool of one script, ``workers/pool.py`` running it as ``__main__``), not by the
    first test that reads it: for the scripts that must not share a process with others' cases, and need no process
    of their own for anything else (real ranks, an exit status, signals).

    ``env_from``: a function that returns more of the environment when the launch starts, called with the launch's
    folder, for what exists only once the session runs (``s3server.pool_env``: the S3 server's endpoint and a bucket;
    ``test_docs.py``: the file listing the snippets). It is part of the pool's key, by its name: the scripts of every
    module that names it (with the same ``env``) share one launch.
    """
    env = _key_env(env, env_from)
    if alone:  # its own key: no other script shares the pool
        env = {**env, ALONE: Path(script).stem}
    if pooled:
        module = sys._getframe(1).f_globals.get("__name__", "")
        _POOLS.setdefault((nproc, tuple(sorted(env.items()))), []).append((script, module))
        POOL_FIXTURES.setdefault(module, set()).add("results")

    @pytest.fixture(scope="module")
    def results(tmp_path_factory):
        if not pooled:
            out = tmp_path_factory.mktemp(Path(script).stem)
            return launch(script, nproc, out, **_resolved(env, out))
        return pooled_launch(script, nproc, tmp_path_factory, env)

    @pytest.mark.parametrize("name", cases)
    def test_case(results, name):
        details = results.check(name)
        skipped = [d["skipped"] for d in details if isinstance(d, dict) and "skipped" in d]
        if skipped:
            pytest.skip(skipped[0])

    return results, test_case
