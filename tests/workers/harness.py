"""Worker-side harness: run many test cases in one multi-process launch.

A worker script defines cases with ``@case`` and calls :func:`run_cases`. Each case runs on every rank; each
rank writes ``<case>.rank<r>.json`` into ``$LFSDP_TEST_OUT`` with ``ok`` and either ``details`` or the traceback.
The pytest side (``tests/launch.py``) turns every (case, rank) file into one test outcome, so a launch of a few
seconds covers many cases and a missing file is a failure, never a silent pass.

Cases that share a process must not leak state into each other: after each case, the isolation guard
(``isolation.py``) compares the environment, signal handlers, non-daemon threads, the default process group, open
files, the working directory and ``sys.path`` with what they were before it, and fails the case that changed them,
naming what it left behind. ``tests/test_isolation.py`` shows the guard failing cases that leak on purpose.
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch

import isolation

CASES: list[Callable[[], Any]] = []
# Set by ``pool.py``, which runs several scripts' cases in one launch: run_cases then returns instead of exiting,
# and POOL_FAILED says whether any case failed.
POOLED = False
POOL_FAILED = False
TIMEOUT = timedelta(seconds=float(os.environ.get("LFSDP_TEST_PG_TIMEOUT", "120")))
# A case still running after this long has its threads' stacks written to ``<case>.rank<r>.stacks.txt`` (the pytest
# side shows them with the failure): the clue to where a rank stalls while the other waits out a collective's timeout.
STALL_S = 0.75 * TIMEOUT.total_seconds()
# Set by ``pool.py``: the file where this rank appends "<script stem>/<case>" as each case starts. A pool that lost a
# rank inside a case is started again (``launch.run_pool``): that case runs once more, then the ones after it, every
# rank alike skipping the cases named in the file LFSDP_TEST_SKIP_FILE.
STARTED = None
SKIP_FILE = os.environ.get("LFSDP_TEST_SKIP_FILE")


def case(fn: Callable[[], Any]) -> Callable[[], Any]:
    CASES.append(fn)
    return fn


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def run_cases() -> None:
    out = Path(os.environ["LFSDP_TEST_OUT"])
    out.mkdir(parents=True, exist_ok=True)
    only = set(filter(None, os.environ.get("LFSDP_TEST_ONLY", "").split(",")))
    done = set(Path(SKIP_FILE).read_text().split()) if SKIP_FILE else set()
    torch.set_num_threads(1)
    failed = False
    for fn in CASES:
        if (only and fn.__name__ not in only) or f"{out.name}/{fn.__name__}" in done:
            continue
        # The stacks file exists while the case runs, so a rank that dies in the case leaves it behind (the pytest
        # side tells the case it died in from the cases it never reached). faulthandler writes every thread's stack
        # there on a fatal signal (a segfault, an abort) as well as on a stall.
        stacks = open(out / f"{fn.__name__}.rank{rank()}.stacks.txt", "w")  # noqa: SIM115 - closed below
        if STARTED is not None:
            print(f"{out.name}/{fn.__name__}", file=STARTED, flush=True)
        faulthandler.enable(file=stacks, all_threads=True)
        faulthandler.dump_traceback_later(STALL_S, file=stacks)
        before = isolation.snapshot()
        started = time.perf_counter()
        try:
            record = {"ok": True, "details": _jsonable(fn())}
        except BaseException:  # noqa: BLE001 - the traceback goes to the pytest side
            record = {"ok": False, "error": traceback.format_exc()}
        # What the case cost inside its launch: pytest sees only the launch (conftest.py lists the slowest cases).
        record["seconds"] = round(time.perf_counter() - started, 3)
        left = isolation.leaks(before)
        faulthandler.cancel_dump_traceback_later()
        faulthandler.enable(file=sys.stderr, all_threads=True)
        stacks.close()
        if not os.path.getsize(stacks.name):
            os.unlink(stacks.name)
        if left:
            message = f"case {fn.__name__} leaked state into the cases after it:\n  " + "\n  ".join(left)
            record = {"ok": False, "error": record.get("error", "") + message + "\n"}
        if not record["ok"]:
            failed = True
            print(f"[rank {rank()}] case {fn.__name__} failed:\n{record['error']}", file=sys.stderr, flush=True)
        (out / f"{fn.__name__}.rank{rank()}.json").write_text(json.dumps(record))
    if POOLED:
        global POOL_FAILED
        POOL_FAILED = POOL_FAILED or failed
        return
    # The exit status this rank means to have: the pytest side holds torchrun's real one against it, so a crash at
    # exit, after every result is written, still fails the launch.
    code = 1 if failed else 0
    (out / f"_exit.rank{rank()}.json").write_text(json.dumps({"code": code}))
    sys.exit(code)


def _jsonable(value: Any) -> Any:
    try:
        json.dumps(value)
        return value
    except TypeError:
        return repr(value)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, atol: float, what: str) -> float:
    """Assert and return the max abs difference, so the result file records how close it was."""
    diff = (actual.detach().float() - expected.detach().float()).abs().max().item() if actual.numel() else 0.0
    if not diff <= atol:
        raise AssertionError(f"{what}: max abs diff {diff:.3e} > atol {atol:.1e}")
    return diff
