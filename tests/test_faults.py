"""Save/load failures raise on every rank, from the fault and not the timeout, naming cause, path and failing rank
(``workers/faults.py``, 2 ranks, process-group timeout 60 s); the CLI turns filesystem failures into one line;
``timeout`` is checked at construction."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest

from inprocess import run_cli
from launch import case_tests

CASES = [
    "strict_key_mismatch_raises_on_every_rank_in_both_formats",
    "shape_mismatch_names_the_tensor_in_both_formats",
    "an_unreadable_full_file_raises_everywhere",
    "save_onto_a_read_only_filesystem_fails_everywhere_promptly",
    "save_onto_a_full_disk_says_so_and_frees_the_space",
    "a_disk_that_fills_inside_a_record_says_so_in_every_format",
    "a_write_that_fails_on_rank_1_only_names_rank_1",
    "a_nan_gradient_on_one_rank_raises_everywhere_for_every_norm_type",
    "make_cli_input",
]


# The timeout bounds how long a fault may take to raise (`workers/faults.py`, `_fails_everywhere`): 60 s, four times
# the slowest prompt failure seen on a busy 2-core machine; a fault that waited for it fails the case.
results, test_case = case_tests("faults.py", 2, CASES, LFSDP_TEST_PG_TIMEOUT="60")


# ------------------------------------------------------------------------------------------------------------ CLI


def _digest(path: Path) -> str:
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    h = hashlib.sha256()
    for f in files:
        h.update(str(f.relative_to(path) if path.is_dir() else f.name).encode())
        h.update(f.read_bytes())
    return h.hexdigest()


def _convert(src: Path, dst: Path, to: str, *, process: bool):
    """`lightning-fsdp convert`: as a new process (`python -m lightning_fsdp`), or in this one (``run_cli``)."""
    if not process:
        return run_cli(["convert", src, dst, "--to", to])
    return subprocess.run([sys.executable, "-m", "lightning_fsdp", "convert", str(src), str(dst), "--to", to],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("fault", ["read_only", "full_disk"])
@pytest.mark.parametrize("to", ["full", "sharded"])
def test_cli_convert_fault_is_one_line_and_leaves_nothing(results, tmpfs, fault, to):
    results.check("make_cli_input")
    src = results.out / ("cli_src" if to == "full" else "cli_src.pt")
    before = _digest(src)
    where = tmpfs("8k" if fault == "full_disk" else "1m", read_only=fault == "read_only")
    free = os.statvfs(where).f_bavail
    # One of the four runs is a real process, for the exit status 1 of the command itself; the rest run in this
    # process, where `main`'s return value is that status.
    run = _convert(src, where / "out", to, process=(fault, to) == ("full_disk", "sharded"))
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 1 and len(lines) == 1, (run.returncode, run.stderr[-3000:])
    cause = "read-only file system" if fault == "read_only" else "no space left on device"
    assert cause in lines[0].lower() and str(where) in lines[0] and "HINT:" in lines[0], lines[0]
    assert _digest(src) == before, "the input changed"
    assert list(where.iterdir()) == [], f"partial output left behind: {list(where.iterdir())}"
    assert os.statvfs(where).f_bavail == free, "the failed conversion still holds disk space"


# -------------------------------------------------------------------------------------------------------- timeout


@pytest.mark.parametrize("front", ["fabric", "trainer"])
def test_timeout_accepts_seconds_and_timedelta_and_refuses_the_rest(front):
    if front == "fabric":
        from lightning_fsdp.fabric import FSDPStrategy
    else:
        from lightning_fsdp.trainer import FSDPStrategy
    assert FSDPStrategy(timeout=30).config.timeout == timedelta(seconds=30)
    assert FSDPStrategy(timeout=2.5).config.timeout == timedelta(seconds=2.5)
    assert FSDPStrategy(timeout=timedelta(minutes=1)).config.timeout == timedelta(minutes=1)
    assert FSDPStrategy(timeout=None).config.timeout is None
    for bad, kind in (("30", TypeError), (True, TypeError), ([30], TypeError), (0, ValueError), (-1.0, ValueError),
                      (float("inf"), ValueError), (float("nan"), ValueError), (timedelta(0), ValueError)):
        with pytest.raises(kind) as info:
            FSDPStrategy(timeout=bad)
        message = str(info.value)
        assert f"Invalid `timeout={bad!r}`" in message and "number of seconds" in message and "HINT:" in message, message
