"""A process's peak resident memory, resettable: Linux's ``VmHWM`` after ``malloc_trim(0)`` and a ``clear_refs``
reset, so the peak of one phase can be read on its own and file pages a reader maps count too."""

from __future__ import annotations

import ctypes
from pathlib import Path

_LIBC = ctypes.CDLL(None)


def hwm_kb() -> int:
    """The peak resident set since the last reset, in KiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise RuntimeError("no VmHWM in /proc/self/status")


def reset_peak() -> int:
    """Return freed heap to the system, reset the peak to the current resident set, and return it in KiB."""
    _LIBC.malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")
    return hwm_kb()
