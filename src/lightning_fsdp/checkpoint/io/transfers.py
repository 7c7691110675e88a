"""How many bytes a rank keeps in flight to and from object storage: the sizes and windows of streaming saves and
loads (issue 43), one value per process.

- ``part_size``: the bytes of one upload part (S3 multipart; 5 MiB..5 GiB, S3's own limits). A save holds at most
  ``(parts_in_flight + 1) * part_size`` of upload buffers per rank.
- ``parts_in_flight``: upload parts sent at once per object.
- ``ranges_in_flight``: ranged GETs at once per rank during a load.
- ``range_size``: the largest byte range one GET asks for (neighbouring ranges are merged up to it).

The strategy sets them once from its arguments (:func:`set_transfers`); everything that moves bytes reads
:func:`transfers`. A value out of range is refused with the argument's name, the range and the fix.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

__all__ = ["Transfers", "transfers", "set_transfers", "check_transfers"]

MiB = 2**20
_LIMITS = {  # argument: (smallest, largest, what it is)
    "part_size": (5 * MiB, 5 * 2**30, "bytes per upload part (S3 accepts 5 MiB to 5 GiB)"),
    "parts_in_flight": (1, 64, "upload parts in flight per object"),
    "ranges_in_flight": (1, 64, "ranged reads in flight per rank"),
    "range_size": (MiB, 2**30, "bytes per ranged read"),
}


@dataclass(frozen=True)
class Transfers:
    part_size: int = 8 * MiB
    parts_in_flight: int = 4
    ranges_in_flight: int = 8
    range_size: int = 32 * MiB


_current = Transfers()


def check_transfers(**values: Any) -> Transfers:
    """A :class:`Transfers` from ``values`` (the others at their defaults), each checked: ``ValueError`` naming the
    argument, the value, the allowed range and the fix."""
    known = {f.name for f in fields(Transfers)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise TypeError(f"Unknown transfer setting(s) {unknown}. HINT: use one of {sorted(known)}.")
    for name, value in values.items():
        low, high, what = _LIMITS[name]
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise ValueError(f"`{name}={value!r}` is not allowed: it is the {what}, an integer from {low} to {high}."
                             f" HINT: leave it out for the default ({getattr(Transfers(), name)}), or pass a value in"
                             " that range.")
    return replace(Transfers(), **values)


def transfers() -> Transfers:
    """The settings in force in this process."""
    return _current


def set_transfers(settings: Transfers) -> None:
    global _current
    _current = settings
