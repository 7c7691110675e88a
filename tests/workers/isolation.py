"""The isolation guard: what one test case may not leave behind for the next case in the same process.

Many cases share one process (``harness.run_cases`` runs every case of a worker script in one launch, and
``tests/inprocess.py`` runs the command line in pytest's own process), so a case that leaks state could make a later
case pass or fail for the wrong reason. :func:`snapshot` before a case and :func:`leaks` after it name what changed:

- environment variables set, changed or removed;
- signal handlers replaced and not restored;
- threads that are not daemons and still run (after a short grace for a pool that is winding down);
- the default ``torch.distributed`` process group destroyed or replaced (a case may create the launch's one group,
  as the first ``Fabric.launch()`` does; it may not take it away from the cases after it), or created where the
  caller said no case may create one (``allow_new_group=False``, the in-process command line);
- regular files left open (a file descriptor of this process that points at a file and was not open before);
- the working directory, and ``sys.path`` entries added or removed.

``sys.modules`` is not compared here: a case importing a module lazily is normal. The in-process command line,
which imports the user's model files, removes what it imported from those files itself (``tests/inprocess.py``).

This module imports only the standard library (and torch, only if the process has imported it already), so both the
workers and the pytest side can use it.
"""

from __future__ import annotations

import gc
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

# Set by torch itself, once per process, the first time something needs them (a CUDA availability check, the first
# torch.compile): process-wide caches, not a case's state. Only their first appearance is allowed, not a change.
TORCH_SETS_ONCE = {"PYTORCH_NVML_BASED_CUDA_CHECK", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"}
# A pool's worker thread (DCP's async save, for one) ends a moment after its last task: wait this long for it. The
# wait ends when the thread does, so the bound costs nothing but for a thread that leaks: generous, for busy machines.
THREAD_GRACE_S = float(os.environ.get("LFSDP_TEST_THREAD_GRACE_S", "30"))
_SIGNALS = [s for s in signal.valid_signals() if s not in (signal.SIGKILL, signal.SIGSTOP)]


@dataclass
class Snapshot:
    env: dict[str, str]
    handlers: dict[int, Any]
    threads: set[int]
    group: Any
    files: dict[str, str]
    cwd: str
    path: list[str]


def snapshot() -> Snapshot:
    return Snapshot(env=dict(os.environ), handlers=_handlers(), threads={t.ident for t in _live_threads()},
                    group=_default_group(), files=_open_files(), cwd=os.getcwd(), path=list(sys.path))


def leaks(before: Snapshot, *, allow_new_group: bool = True) -> list[str]:
    """What the case run since ``before`` left behind, one line each; empty when it left nothing."""
    found = []
    env = dict(os.environ)
    for key in sorted(set(env) | set(before.env)):
        if env.get(key) != before.env.get(key) and not (key in TORCH_SETS_ONCE and key not in before.env):
            found.append(f"environment variable {key}: {before.env.get(key)!r} -> {env.get(key)!r}")
    handlers = _handlers()
    for sig in _SIGNALS:
        if handlers.get(sig) is not before.handlers.get(sig) and handlers.get(sig) != before.handlers.get(sig):
            found.append(f"signal handler of {signal.Signals(sig).name}: {before.handlers.get(sig)!r} ->"
                         f" {handlers.get(sig)!r}")
    deadline = time.monotonic() + THREAD_GRACE_S
    for thread in _live_threads():
        if thread.ident not in before.threads:
            thread.join(max(0.0, deadline - time.monotonic()))
            if thread.is_alive():
                found.append(f"non-daemon thread still running: {thread.name!r}")
    group = _default_group()
    if before.group is not None and group is not before.group:
        found.append(f"the default process group was {'destroyed' if group is None else 'replaced'}")
    elif before.group is None and group is not None and not allow_new_group:
        found.append("a default process group was created and left initialized")
    opened = _new_files(before)
    if opened:  # a file object nobody holds any more is closed by its finalizer, not leaked (collect only then: slow)
        gc.collect()
        opened = _new_files(before)
    found += [f"file left open: {target} (fd {fd})" for fd, target in opened]
    if os.getcwd() != before.cwd:
        found.append(f"working directory: {before.cwd} -> {os.getcwd()}")
    added = [p for p in sys.path if p not in before.path]
    removed = [p for p in before.path if p not in sys.path]
    if added or removed:
        found.append(f"sys.path: added {added}, removed {removed}")
    return found


def _new_files(before: Snapshot) -> list[tuple[str, str]]:
    return [(fd, target) for fd, target in sorted(_open_files().items()) if before.files.get(fd) != target]


def _handlers() -> dict[int, Any]:
    return {sig: signal.getsignal(sig) for sig in _SIGNALS}


def _live_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.is_alive() and not t.daemon and t is not threading.main_thread()]


def _default_group() -> Any:
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    return dist.distributed_c10d._get_default_group()


def _open_files() -> dict[str, str]:
    """fd -> path, for this process's descriptors that point at regular files (not sockets, pipes, devices)."""
    found = {}
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:  # not Linux: nothing to compare
        return found
    for fd in fds:
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the descriptor listdir itself used, closed since
            continue
        if target.startswith("/") and not target.startswith(("/dev/", "/proc/")) and os.path.isfile(target):
            found[fd] = target
    return found
