"""What this process does at exit so that a job whose work succeeded exits 0.

The crash this prevents ("terminate called without an active exception", exit 1, after every result was written):
a gloo worker thread that finishes a collective, or drops one that already finished, releases the work's tensors;
in torch 2.13 that takes the GIL (the tensors have Python objects). A thread that starts waiting for the GIL before
the interpreter finalizes and gets it only during finalization is ended by Python 3.11 with ``pthread_exit``; the
forced unwind meets a ``noexcept`` destructor and C++ calls ``std::terminate``. A model keeps its process group
alive, so destroying the groups at exit does not stop those threads.

So at exit, while the interpreter is still whole, this module waits, with the GIL released, until every gloo worker
thread of the process is idle, then destroys the process groups this library created. Whether a worker is idle
comes from the kernel: an idle ``pt_gloo_runloop`` thread sleeps in a condition-variable wait with no timeout
(a futex wait with a NULL timeout in ``/proc/self/task/<tid>/syscall``); one that runs a collective, or waits for
the GIL, is running or in a wait with a timeout. The reading is checked once while the workers are known to be idle
(right after the library creates the default group); where it does not recognise them (another C library, say),
the wait at exit is capped at :data:`UNVERIFIED_WAIT_S`.

Limits: gloo only (NCCL's watchdog is stopped by ``destroy_process_group``); Linux only; a collective started after
this handler ran (by an ``atexit`` handler registered before the library set up, or a daemon thread) is not waited
for; a worker blocked on a lock with no timeout reads as idle.
"""

from __future__ import annotations

import atexit
import logging
import os
import platform
import sys
import time
from pathlib import Path
from typing import Optional

import torch.distributed as dist

__all__ = ["register_exit_handler", "exit_with_status", "busy_collective_threads", "collective_threads", "EXIT_WAIT_S"]

EXIT_WAIT_S = 60.0  # the longest wait at exit for gloo workers that the idle check recognises
UNVERIFIED_WAIT_S = 2.0  # the longest wait where the idle check could not be verified on this machine
_WARN_AFTER_S = 5.0
_WORKER_NAME = b"pt_gloo_runloop"  # the name torch gives gloo's worker threads
_FUTEX = {"x86_64": 202, "aarch64": 98, "ppc64le": 221, "s390x": 238, "riscv64": 98}.get(platform.machine())
# A condition-variable wait, once the PRIVATE / CLOCK_REALTIME flags are masked off: FUTEX_WAIT_BITSET in glibc 2.33
# and later, FUTEX_WAIT in older glibc and musl.
_FUTEX_WAITS = (9, 0)
_FUTEX_COMMAND_MASK = 0x7F

_our_group: Optional[dist.ProcessGroup] = None  # the default group this library created, destroyed at exit
_verified = False  # whether idle workers were seen as idle on this machine
_registered = False
_exit_status = 0  # set by `exit_with_status` from a handler that runs before this module's


def register_exit_handler(created: Optional[dist.ProcessGroup] = None) -> None:
    """Wait for gloo's workers at exit (registered once per process). ``created``: the default group, when this
    library has just created it. It is destroyed at exit, a group the user made is left to the user; and its workers,
    idle right now, check that this machine's idle reading is recognised."""
    global _registered, _our_group
    if created is not None:
        _our_group = created
        _verify_idle_reading()
    if _registered:
        return
    _registered = True
    # Python joins its non-daemon threads (DCP's background writers among them) before it runs `atexit` handlers,
    # so no background save is cut off by what this does.
    atexit.register(_at_exit)


def _verify_idle_reading(limit_s: float = 1.0) -> None:
    global _verified
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        threads = collective_threads()
        if not threads:  # no gloo group (NCCL), or no /proc: nothing to verify now
            return
        if all(threads.values()):  # new workers reach their idle wait within microseconds
            _verified = True
            return
        time.sleep(0.002)


def _at_exit() -> None:
    _wait_for_idle_collective_threads(EXIT_WAIT_S if _verified else UNVERIFIED_WAIT_S)
    if _our_group is not None and dist.is_initialized() and dist.group.WORLD is _our_group:
        # Every group (the default one, the mesh's, the background-save group), while the interpreter is whole:
        # NCCL warns about a group never destroyed.
        dist.destroy_process_group()
    if _exit_status:
        _end_process(_exit_status)


def exit_with_status(status: int) -> None:
    """End the process with ``status`` once this module's exit handler is done (called from an atexit handler that
    runs before it, e.g. when the last background save failed). A script that returned normally exits 0, and Python
    offers no other way to change that from an atexit handler than to end the process itself. Without this module's
    handler (no process group), the process ends now."""
    global _exit_status
    _exit_status = status
    if not _registered:
        _end_process(status)


def _end_process(status: int) -> None:
    # `os._exit` skips what is left of the shutdown (atexit handlers registered before this module's, the
    # interpreter's finalization): flush what a user would miss first.
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass
    os._exit(status)


def _wait_for_idle_collective_threads(limit_s: float) -> None:
    start = time.monotonic()
    warned = False
    while True:
        busy = busy_collective_threads()
        if not busy:
            # Idle on two readings in a row, a poll apart: work queued just before exit wakes a worker in that time.
            time.sleep(0.002)
            busy = busy_collective_threads()
            if not busy:
                return
        waited = time.monotonic() - start
        if waited >= limit_s:
            if _verified:
                print(f"lightning_fsdp: {len(busy)} gloo worker thread(s) still busy after {waited:.0f} s at exit;"
                      " exiting anyway, which may still abort.", file=sys.stderr, flush=True)
            return
        if waited >= _WARN_AFTER_S and not warned:
            warned = True
            print(f"lightning_fsdp: a gloo collective started before exit is still running after {waited:.0f} s;"
                  f" waiting up to {limit_s:.0f} s for it, so that the process exits cleanly. A peer rank that is"
                  " slower, hung or gone, or ranks that issued different collectives, keep it running.",
                  file=sys.stderr, flush=True)
        # Sleeping releases the GIL: a worker waiting for it to drop its tensors gets it now.
        time.sleep(0.002 if waited < 0.1 else 0.02)


def busy_collective_threads() -> list[int]:
    """The thread ids of gloo worker threads that are not idle (running a collective, or done with one and waiting
    for the GIL to drop it). Empty where the kernel does not say (not Linux, an unknown architecture)."""
    return [tid for tid, idle in collective_threads().items() if not idle]


def collective_threads() -> dict[int, bool]:
    """Every gloo worker thread of this process that the kernel shows, by thread id: whether it is idle."""
    tasks = Path("/proc/self/task")
    if _FUTEX is None or not tasks.is_dir():
        return {}
    threads = {}
    for task in tasks.iterdir():
        try:
            # Bytes: the kernel cuts names at 15 bytes, which can split a multi-byte character of another name.
            if (task / "comm").read_bytes().strip() != _WORKER_NAME:
                continue
            call = (task / "syscall").read_text().split()
            state = (task / "stat").read_text().rpartition(")")[2].split()[:1]
        except (OSError, ValueError):  # the thread ended, or the kernel does not show system calls
            continue
        threads[int(task.name)] = _idle(state, call)
    return threads


def _idle(state: list[str], call: list[str]) -> bool:
    # Asleep ("S"; a worker just woken for new work is "R" while its system call still shows the wait), in a futex
    # wait with no timeout. `syscall` reads "<nr> <arg1> ... <arg6> <sp> <pc>" while blocked in a system call; for a
    # futex, arg2 is the operation and arg4 the timeout.
    return (state == ["S"] and len(call) >= 5 and call[0] == str(_FUTEX)
            and _hex(call[2]) & _FUTEX_COMMAND_MASK in _FUTEX_WAITS and _hex(call[4]) == 0)


def _hex(word: str) -> int:
    try:
        return int(word, 16)
    except ValueError:
        return -1
