"""Fixtures shared by several test files."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

import forkserver
import launch


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session, config, items):
    """Run the test files whose cases share a pool last: their pools run in the background meanwhile (see
    ``pytest_collection_finish``). The order within each group stays as collected."""
    selected = {item.module.__name__ for item in items if getattr(item, "module", None) is not None}
    pooled = launch.pool_modules(selected)
    items.sort(key=lambda item: getattr(getattr(item, "module", None), "__name__", "") in pooled)


def pytest_collection_finish(session):
    """Tell the launch pools which test modules have selected tests, and start the pools (see
    ``launch.start_pools``)."""
    launch.SELECTED = {item.module.__name__ for item in session.items if getattr(item, "module", None) is not None}
    if session.items and not session.config.option.collectonly:
        launch.start_pools(session.config._tmp_path_factory.mktemp("pools"))


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
    if forkserver.summary():
        terminalreporter.write_line(f"forkserver: {forkserver.summary()}")


@pytest.fixture()
def tmpfs(tmp_path):
    """Mount a tmpfs at a fresh directory: ``tmpfs(size, read_only=False)`` returns it; unmounted afterwards. A test
    that needs one is skipped, saying why, where this machine refuses the mount (it needs root)."""
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
