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

from lightning_fsdp.engine.config import TRANSFER_LIMITS, check_transfer

__all__ = ["Transfers", "transfers", "set_transfers", "check_transfers", "MiB"]

MiB = 2**20


@dataclass(frozen=True)
class Transfers:
    part_size: int = TRANSFER_LIMITS["part_size"][2]
    parts_in_flight: int = TRANSFER_LIMITS["parts_in_flight"][2]
    ranges_in_flight: int = TRANSFER_LIMITS["ranges_in_flight"][2]
    range_size: int = TRANSFER_LIMITS["range_size"][2]


_current = Transfers()


def check_transfers(**values: Any) -> Transfers:
    """A :class:`Transfers` from ``values`` (the others at their defaults), each checked: ``ValueError`` naming the
    argument, the value, the allowed range and the fix (the strategy's own check, :func:`engine.config.check_transfer`;
    None is the default)."""
    known = {f.name for f in fields(Transfers)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise TypeError(f"Unknown transfer setting(s) {unknown}. HINT: use one of {sorted(known)}.")
    checked = {name: check_transfer(name, value) for name, value in values.items()}
    return replace(Transfers(), **{name: value for name, value in checked.items() if value is not None})


def transfers() -> Transfers:
    """The settings in force in this process."""
    return _current


def set_transfers(settings: Transfers) -> None:
    global _current
    _current = settings
