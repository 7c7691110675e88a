"""Peak memory of a block of code on Linux, the honest way:

- ``reset_peak()``: ``gc.collect()``, glibc's ``malloc_trim(0)`` (freed heap pages stay resident otherwise, and new
  allocations reuse them without raising RSS, so the block would read near zero), then ``5 > /proc/self/clear_refs``,
  which sets the kernel's peak RSS (``VmHWM``) to the current RSS; returns that RSS in KiB.
- ``status_kib("VmHWM")`` after the block: the peak; the difference is the block's extra peak.
"""

from __future__ import annotations

import ctypes
import gc
from pathlib import Path

__all__ = ["status_kib", "reset_peak"]

_LIBC = ctypes.CDLL(None)


def status_kib(field: str) -> int:
    """A ``/proc/self/status`` field in KiB (``VmRSS``, ``VmHWM``, ``RssAnon``, ...)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(f"{field} not in /proc/self/status")


def reset_peak() -> int:
    """Return freed memory to the kernel and restart ``VmHWM`` from the current RSS; returns that RSS in KiB."""
    gc.collect()
    _LIBC.malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")
    return status_kib("VmRSS")
