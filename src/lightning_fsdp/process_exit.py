"""What this process does at exit so that a job whose work succeeded exits 0.

The crash this prevents (seen as "terminate called without an active exception", exit 1, after every result was
written): a gloo collective that the program issued but did not wait for (an FSDP2 prefetch all-gather whose
module never ran, say) finishes on one of gloo's worker threads while the interpreter is already finalizing. The
worker then drops its references to the collective's tensors; in torch 2.13 that takes the GIL (the tensors still
have Python objects), and Python 3.11 ends any thread that takes the GIL during finalization with
``pthread_exit``. The forced unwind runs into a ``noexcept`` destructor, and C++ calls ``std::terminate``.

So at exit, while the interpreter is still whole, this module waits, with the GIL released, until every gloo worker
thread of the process is idle, then destroys the process groups. A collective that never completes (the ranks
issued different ones) is given up on after :data:`EXIT_WAIT_S`, with a warning: the worker then stays blocked and
the process ends around it, which does not crash.

Whether a worker is idle comes from the kernel: an idle ``pt_gloo_runloop`` thread sleeps in a condition-variable
wait with no timeout (``futex(FUTEX_WAIT_BITSET, timeout=NULL)`` in ``/proc/self/task/<tid>/syscall``), while one
that runs a collective or waits for the GIL is running or in a wait with a timeout.
"""

from __future__ import annotations

import atexit
import platform
import sys
import time
from pathlib import Path
import torch.distributed as dist

__all__ = ["register_exit_handler", "busy_collective_threads", "collective_threads", "EXIT_WAIT_S"]

EXIT_WAIT_S = 60.0  # the longest wait for an unfinished collective at exit
_WARN_AFTER_S = 5.0
_POLL_S = 0.002
_WORKER_NAME = "pt_gloo_runloop"  # the name torch gives gloo's worker threads
_FUTEX = {"x86_64": 202, "aarch64": 98, "ppc64le": 221}.get(platform.machine())
_FUTEX_WAIT_BITSET = 9  # what a condition-variable wait is, once the PRIVATE / CLOCK_REALTIME flags are masked off
_FUTEX_COMMAND_MASK = 0x7F

_registered = False


def register_exit_handler(*, destroy: bool) -> None:
    """Wait for gloo's workers at exit (once per process), and destroy the process groups if ``destroy``: pass
    True only when this library created the default group, so that a group the user made stays the user's."""
    global _registered
    if _registered:
        return
    _registered = True
    # Python joins its non-daemon threads (DCP's background writers among them) before it runs `atexit` handlers,
    # so no background save is cut off by what this does.
    atexit.register(_at_exit, destroy)


def _at_exit(destroy: bool) -> None:
    _wait_for_idle_collective_threads()
    if destroy and dist.is_initialized():
        # Every group (the default one, the mesh's, the background-save group), while the interpreter is whole:
        # NCCL warns about a group never destroyed.
        dist.destroy_process_group()


def _wait_for_idle_collective_threads(limit_s: float = EXIT_WAIT_S) -> None:
    start = time.monotonic()
    warned = False
    while busy := busy_collective_threads():
        waited = time.monotonic() - start
        if waited >= limit_s:
            print(f"lightning_fsdp: exiting with {len(busy)} gloo collective(s) unfinished after {waited:.0f} s",
                  file=sys.stderr, flush=True)
            return
        if waited >= _WARN_AFTER_S and not warned:
            warned = True
            print(f"lightning_fsdp: a collective started before exit is still running after {waited:.0f} s; waiting"
                  f" up to {limit_s:.0f} s for it so that the process exits cleanly. If it never finishes, the ranks"
                  " issued different collectives before they exited.", file=sys.stderr, flush=True)
        time.sleep(_POLL_S)  # releases the GIL: a worker waiting for it to drop its tensors gets it now


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
            if (task / "comm").read_text().strip() != _WORKER_NAME:
                continue
            call = (task / "syscall").read_text().split()
        except OSError:  # the thread ended, or the kernel does not show system calls
            continue
        threads[int(task.name)] = _idle(call)
    return threads


def _idle(call: list[str]) -> bool:
    # "<nr> <arg1> ... <arg6> <sp> <pc>" while blocked in a system call, "running" otherwise.
    return (len(call) >= 5 and call[0] == str(_FUTEX) and _hex(call[2]) & _FUTEX_COMMAND_MASK == _FUTEX_WAIT_BITSET
            and _hex(call[4]) == 0)


def _hex(word: str) -> int:
    try:
        return int(word, 16)
    except ValueError:
        return -1
