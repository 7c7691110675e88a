"""Explicit all-gather prefetching: ``forward_prefetch`` and ``backward_prefetch``, as depths in units.

FSDP2 on its own issues a unit's all-gather when the unit's forward starts (no forward prefetch) and, in backward,
prefetches the one unit that ran before it (depth 1, from the order it recorded in forward). A depth ``k`` asks each
unit to start the all-gathers of the next ``k`` units as soon as its own parameters are in, through the public
``FSDPModule.set_modules_to_forward_prefetch`` / ``set_modules_to_backward_prefetch``: more overlap of communication
with compute, at the price of ``k`` units' gathered parameters held at once.

The next units are taken from the module tree: units in ``root.modules()`` order are assumed to run in that order in
forward (a ``ModuleList`` of blocks called in a loop, as in torchtitan), and backward runs them in reverse. A model
whose forward calls its units in another order should leave both depths at their defaults: a wrong guess prefetches
units that run later than expected, which costs memory, never correctness.
"""

from __future__ import annotations

from enum import Enum
from typing import Any, Optional

from torch import nn
from torch.distributed.fsdp import FSDPModule

from lightning_fsdp._base.errors import bad_argument

__all__ = ["parse_forward_prefetch", "parse_backward_prefetch", "apply_prefetch", "execution_order"]

FORWARD_DEFAULT = 0  # FSDP2's own behaviour: no explicit forward prefetch
BACKWARD_DEFAULT = 1  # FSDP2's own behaviour: the previous unit, from the order recorded in forward

_FORWARD_ALLOWED = "an int >= 0 (0: FSDP2's default, no explicit prefetch), True (same as 1) or False (same as 0)"
_BACKWARD_ALLOWED = (
    "an int >= 1 (1: FSDP2's default), or Lightning's FSDP1 values BackwardPrefetch.BACKWARD_PRE /"
    " 'BACKWARD_PRE' (same as 1)"
)


def parse_forward_prefetch(value: Any) -> int:
    """``forward_prefetch``: how many units ahead each unit starts the all-gather in forward."""
    if value is None or isinstance(value, bool):
        return int(bool(value))  # FSDP1's bool: True prefetched the next unit
    if isinstance(value, int) and value >= 0:
        return value
    error = ValueError if isinstance(value, int) else TypeError
    raise error(
        bad_argument("forward_prefetch", value, _FORWARD_ALLOWED,
                     "Use e.g. `forward_prefetch=1` to start the next unit's all-gather during this unit's forward.")
    )


def parse_backward_prefetch(value: Any) -> int:
    """``backward_prefetch``: how many units ahead (in backward order) each unit starts the all-gather."""
    name = value.name if isinstance(value, Enum) else value  # torch's FSDP1 `BackwardPrefetch` enum
    if isinstance(name, str) and name.strip().upper() in ("BACKWARD_PRE", "BACKWARD_POST"):
        if name.strip().upper() == "BACKWARD_POST":
            raise ValueError(
                bad_argument(
                    "backward_prefetch", value, _BACKWARD_ALLOWED,
                    "Use `backward_prefetch=1` (the next unit's all-gather starts before this unit's gradients are"
                    " computed, like BACKWARD_PRE), or drop the argument.",
                    problem="FSDP2 has no BACKWARD_POST: it always issues the backward all-gather before a unit's"
                            " gradient computation",
                )
            )
        return BACKWARD_DEFAULT  # BACKWARD_PRE is what FSDP2 does by default
    if value is None:
        return BACKWARD_DEFAULT
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return value
    error = ValueError if isinstance(value, int) and not isinstance(value, bool) else TypeError
    raise error(
        bad_argument(
            "backward_prefetch", value, _BACKWARD_ALLOWED,
            "Use `backward_prefetch=1` (the default) or a larger depth, e.g. `backward_prefetch=2`.",
            problem="FSDP2 always prefetches at least one unit in backward; it cannot be switched off"
            if value == 0 and not isinstance(value, bool) else "",
        )
    )


def execution_order(root: nn.Module) -> tuple[list[FSDPModule], list[FSDPModule]]:
    """The units under ``root`` (``root`` itself left out) in the order their forwards start (pre-order of the module
    tree) and the order their backwards run (the reverse of the order their forwards finish: reverse post-order).
    The two differ only for nested units."""
    starts: list[FSDPModule] = []
    finishes: list[FSDPModule] = []

    def visit(module: nn.Module) -> None:
        is_unit = isinstance(module, FSDPModule) and module is not root
        if is_unit:
            starts.append(module)
        for child in module.children():
            visit(child)
        if is_unit:
            finishes.append(module)

    visit(root)
    return starts, finishes[::-1]


def apply_prefetch(roots: list[nn.Module], forward: int, backward: int) -> None:
    """Register, on every unit under each root and on the root itself, the next ``forward`` / ``backward`` units to
    prefetch. Depths at FSDP2's defaults register nothing, leaving FSDP2's own (order-recording) prefetching."""
    for root in roots:
        if not isinstance(root, FSDPModule):
            continue
        forward_order, backward_order = execution_order(root)
        if forward > FORWARD_DEFAULT:
            _chain(root, forward_order, forward, FSDPModule.set_modules_to_forward_prefetch)
        if backward > BACKWARD_DEFAULT:
            _chain(root, backward_order, backward, FSDPModule.set_modules_to_backward_prefetch)


def _chain(root: FSDPModule, order: list[FSDPModule], depth: int, register: Any) -> None:
    # The root's hooks run first in both passes (its forward starts before, and its backward runs before, every unit
    # under it), so it prefetches the first `depth` units of the order; each unit then prefetches the `depth` after it.
    register(root, order[:depth])
    for index, unit in enumerate(order):
        following: Optional[list[FSDPModule]] = order[index + 1 : index + 1 + depth]
        if following:
            register(unit, following)
