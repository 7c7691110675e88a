"""Fixtures shared by several test files."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

import launch


def pytest_collection_finish(session):
    """Tell the launch pools which test modules have selected tests (see ``launch.pooled_launch``)."""
    launch.SELECTED = {item.module.__name__ for item in session.items if getattr(item, "module", None) is not None}


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
