"""Fixtures shared by several test files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import forkserver
import launch
import skips


def pytest_configure(config):
    """Every skip listed with its reason, and one not about the installed versions fails the run (tests/skips.py)."""
    config.pluginmanager.register(skips.SkipRule(), "lfsdp-skip-rule")
    # torch sets TORCHINDUCTOR_CACHE_DIR in os.environ the first time something asks for its cache folder (the
    # fault-tolerance tests do, in this process). Set before any process starts, the environments this process hands
    # out stay one: set midway, every later launch's environment differed from the fork servers' already started,
    # and each needed a server of its own (4-5 s of imports each). The value is torch's own default.
    try:
        from torch._inductor.runtime.cache_dir_utils import cache_dir
    except ImportError:  # a torch without that module: nothing sets the variable midway either
        pass
    else:
        cache_dir()


# The ids of the tests this session collected but will not run (`-k`, `--deselect`), and, once collection is done, of
# every test it collected: the whole suite's when no path was given (fixture ``suite_ids``).
_DESELECTED: list[str] = []
_SUITE_IDS: list[str] | None = None


def pytest_deselected(items):
    _DESELECTED.extend(item.nodeid for item in items)


@pytest.fixture(scope="session")
def suite_ids() -> list[str] | None:
    """The id of every test in the suite, selected or not, where this session collected the whole suite (no path
    given); None otherwise."""
    return _SUITE_IDS


def _group(item) -> tuple[int, int]:
    """Where ``pytest_collection_modifyitems`` puts the test: its group, then its pool's place for the pool readers."""
    module = getattr(getattr(item, "module", None), "__name__", "")
    if item.get_closest_marker("single_process") and not launch.reads_a_pool(item):
        return 0, 0
    if module in launch.POOL_FIXTURES:
        return 2, launch.last_pool_of(module)
    return (3 if item.get_closest_marker("fills_both_cores") else 1), 0


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session, config, items):
    """Order the tests so that both cores stay busy while the pools run in the background (``launch.start_pools``,
    from the end of collection), and no core idles once they are done:

    1. tests marked ``single_process`` (they keep one core busy: the pytest process, or one subprocess at a time),
       so that they run beside the pools, which fill the other core;
    2. the other tests of the files that have no pooled script: most start launches of several processes, one
       after another, and leave a core idle part of the time (start-up, rendezvous, saving), which the pools fill;
    3. the files with a pooled script (``case_tests`` or ``launch.pooled``): their tests read a pool's results, the
       files of the first pool to end first (``launch.last_pool_of``), so that they run while the later pools do. A
       marked test that reads a pool's results stays here. Many of them check on one core (the planner's accuracy
       tests plan in this process), and the pools still running fill the other;
    4. the tests marked ``fills_both_cores`` (several processes at once, busy throughout), last: they need no pool
       beside them, and leave no core idle once the pools are done. Before the pool readers (until 2026-11-29) they
       ran while the last pool did, starving it, and the readers' one-core checks then ran with the other core idle:
       about 40 s at 50 to 60 % of the machine at the end of the suite.

    The order within each group stays as collected. A file stays in one piece except for its marked tests: a
    module-scoped fixture shared by tests in two groups would be set up twice, so mark a whole file
    (``pytestmark``) where its tests share one."""
    items.sort(key=_group)
    global _SUITE_IDS
    if config.args_source == pytest.Config.ArgsSource.TESTPATHS:
        _SUITE_IDS = [item.nodeid for item in items] + _DESELECTED


def pytest_collection_finish(session):
    """Tell the launch pools which test modules have selected tests, and start the pools (see
    ``launch.start_pools``)."""
    launch.SELECTED = {item.module.__name__ for item in session.items if getattr(item, "module", None) is not None}
    if session.items and not session.config.option.collectonly:
        launch.start_pools(session.config._tmp_path_factory.mktemp("pools"))


_EARLY_RUNS_STARTED = False


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Start the selected modules' early runs (``launch.start_early``) with the first test after the single_process
    group: beside that group's tests they would compete with those that bound a wait by a short timeout (torchft's
    quorum timeout of a few seconds, in the fault-tolerance tests), which only the pools, at a lower priority, run
    beside. The later groups start launches of their own at normal priority anyway."""
    global _EARLY_RUNS_STARTED
    if not _EARLY_RUNS_STARTED and _group(item)[0] != 0:
        _EARLY_RUNS_STARTED = True
        launch.start_early_runs(item.session.config._tmp_path_factory.mktemp("early"))


def pytest_sessionfinish(session):
    """Kill the background runs that no test waited for (a session stopped early: ``-x``, an interrupt), and stop the
    S3 server where a pool started it without the ``s3_server`` fixture (``s3server.pool_env``)."""
    launch.stop_background()
    if "s3server" in sys.modules:
        sys.modules["s3server"].stop()


# LFSDP_TEST_TIMELINE=<file>: one line per test, "<start s> <duration s> <busy %> <test id>", where busy is how much
# of both cores the whole machine used while the test ran (/proc/stat). Run a file alone with it to see whether its
# tests keep both cores busy (``fills_both_cores``) or one (``single_process``); run the suite with it to see where
# cores idle (CONTRIBUTING.md).
_TIMELINE = os.environ.get("LFSDP_TEST_TIMELINE")
_STARTED: dict[str, tuple[float, list[int]]] = {}
_T0 = time.monotonic()


def _cpu_ticks() -> list[int]:
    with open("/proc/stat") as stat:
        return [int(v) for v in stat.readline().split()[1:]]


def pytest_runtest_logstart(nodeid, location):
    if _TIMELINE:
        _STARTED[nodeid] = (time.monotonic(), _cpu_ticks())


def pytest_runtest_logfinish(nodeid, location):
    if not _TIMELINE or nodeid not in _STARTED:
        return
    started, before = _STARTED.pop(nodeid)
    spent = [after - was for after, was in zip(_cpu_ticks(), before)]
    idle = spent[3] + spent[4]  # idle and iowait
    busy = 100 * (sum(spent) - idle) / max(1, sum(spent))
    with open(_TIMELINE, "a") as timeline:
        timeline.write(f"{started - _T0:8.1f} {time.monotonic() - started:7.2f} {busy:4.0f} {nodeid}\n")


def pytest_terminal_summary(terminalreporter):
    """The slowest cases inside launches: ``--durations`` shows a launch's cost on the test that started it."""
    timed = []
    for out in launch.LAUNCHED:
        for path in out.glob("*.rank0.json"):
            try:
                seconds = json.loads(path.read_text()).get("seconds")
            except (OSError, ValueError):
                continue
            if seconds is not None:
                timed.append((seconds, f"{out.name}::{path.name[:-len('.rank0.json')]}"))
    if timed:
        terminalreporter.write_sep("=", "slowest 15 cases inside launches (rank 0)")
        for seconds, name in sorted(timed, reverse=True)[:15]:
            terminalreporter.write_line(f"{seconds:7.2f}s {name}")
    crashes = sorted(path for out in launch.LAUNCHED for path in out.glob("*.crash.txt") if path.stat().st_size)
    if crashes:
        terminalreporter.write_sep("=", "cases that ended a rank once and were run again (launch.run_pool)")
        for path in crashes:
            first = next((line for line in path.read_text().splitlines() if line.strip()), "")
            terminalreporter.write_line(f"{path.parent.name}::{path.name}: {first} (stacks in {path})")
    if launch.POOL_TIMES:
        terminalreporter.write_sep("=", "the launch pools (seconds after they started)")
        for name, (scripts, start, end) in launch.POOL_TIMES.items():
            terminalreporter.write_line(f"{name}: {scripts} scripts, {start:.0f} s to {end:.0f} s ({end - start:.0f} s)")
        terminalreporter.write_line(f"tests waited {launch.POOL_WAIT_S:.0f} s for the background pools")
    if forkserver.summary():
        terminalreporter.write_line(f"forkserver: {forkserver.summary()}")


@pytest.fixture()
def tmpfs(tmp_path):
    """Mount a tmpfs at a fresh directory: ``tmpfs(size, read_only=False)`` returns it; unmounted afterwards. Where
    this machine refuses the mount (it needs root; CI runs as root) the test is skipped, saying why, and that skip
    fails the run (tests/skips.py): a disk-full or read-only test never passes by not running."""
    mounted = []

    def make(size: str, read_only: bool = False) -> Path:
        where = tmp_path / f"mnt{len(mounted)}"
        where.mkdir()
        run = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                             capture_output=True, text=True)
        if run.returncode:
            pytest.skip(f"cannot mount a tmpfs here: {run.stderr.strip()}")
        mounted.append(where)
        if read_only:
            run = subprocess.run(["mount", "-o", "remount,ro", str(where)], capture_output=True, text=True)
            if run.returncode:
                pytest.skip(f"cannot remount read-only: {run.stderr.strip()}")
        return where

    yield make
    for where in mounted:
        subprocess.run(["umount", "-l", str(where)], check=False)


@pytest.fixture(scope="session")
def s3_server():
    """moto's S3 server on 127.0.0.1, started once per session (``tests/s3server.py`` says how to use it). A missing
    ``moto[server]`` (the test extra) fails the tests that need it: a missing extra is never a skip."""
    from skips import require

    require("moto.server")
    import s3server

    yield s3server.server()
    s3server.stop()


@pytest.fixture(scope="session")
def ledger_server():
    """moto's S3 app behind a middleware that counts each request's bytes per access key and injects faults
    (``tests/ledger.py``), started once per session. Module-scoped fixtures (a launch) use this one; tests use
    ``ledger``."""
    from skips import require

    require("moto.server")
    import ledger as ledger_module

    server = ledger_module.Ledger()
    yield server
    server.stop()


@pytest.fixture()
def ledger(ledger_server):
    """The session's ledger (``ledger_server``), its records and fault rules forgotten before this test."""
    ledger_server.reset()
    return ledger_server
