"""``reshard_after_forward``: what each unit does with its gathered parameters after forward.

One value for every unit, or a choice per unit:

- ``None``: follow ``sharding_strategy`` (FULL_SHARD: reshard every unit but the root; SHARD_GRAD_OP: keep them);
- ``True`` / ``False``: reshard (backward gathers again) / keep them until backward;
- an int ``k`` > 1 that divides the shard-axis size: keep a copy sharded over groups of ``k`` ranks, so backward's
  all-gather stays inside a group of ``k`` (e.g. inside a node), for ``1/k`` of the parameters' memory per rank;
- a dict from unit to one of the above, e.g. ``{"root": True, "mypkg.model.Block": 2, "blocks.11": False}``. A key is
  ``"root"`` (the root unit(s)), a module class (a class object, a dotted import path, or the bare class name), or a
  unit's module name in the model (``"blocks.11"``). When several keys match one unit, the most specific wins: module
  name, then class, then ``"root"``. Units no key matches follow ``sharding_strategy``.

Validated in two steps: the shape of the value at construction (:func:`parse_reshard_after_forward`), and what needs
the model and the mesh at setup (:meth:`ReshardPlan.choose`): every key must match a unit, every int must divide the
shard-axis size.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional, Union

from torch import nn

from lightning_fsdp._compat import checkpoint_wrapped_module
from lightning_fsdp.errors import bad_argument

__all__ = ["ReshardChoice", "ReshardPlan", "parse_reshard_after_forward", "check_divides"]

ReshardChoice = Optional[Union[bool, int]]
ROOT_KEY = "root"

_ALLOWED = (
    "None (follow sharding_strategy), True, False, an int > 1 that divides the shard-axis size, or a dict from"
    f" {ROOT_KEY!r}, a module class (class object, dotted path or bare name) or a unit's module name to one of those"
)


@dataclass(frozen=True)
class ReshardPlan:
    """A per-unit ``reshard_after_forward``: ``entries`` in the user's order, as (key, choice); a key is ``"root"``,
    a class, or a string (bare class name or module name) matched at setup."""

    entries: tuple[tuple[Union[str, type], ReshardChoice], ...]
    shown: Any  # the user's value, for messages

    def choose(self, units: dict[str, nn.Module], roots: list[nn.Module], default: ReshardChoice) -> dict[int, ReshardChoice]:
        """The choice for each unit to be, by ``id``. ``units`` maps module names to the modules ``fully_shard`` will
        be applied to (roots included, wrappers looked through by the caller); ``default`` is the strategy's."""
        root_ids = {id(r) for r in roots}
        chosen: dict[int, tuple[int, ReshardChoice]] = {}  # id -> (specificity, choice)
        for key, choice in self.entries:
            matched = [(name, m) for name, m in units.items() if _matches(key, name, m, id(m) in root_ids)]
            if not matched:
                raise ValueError(self._no_match(key, units))
            rank = 0 if key == ROOT_KEY else 2 if isinstance(key, str) and key in units else 1
            for _, module in matched:
                if id(module) not in chosen or chosen[id(module)][0] <= rank:
                    chosen[id(module)] = (rank, choice)
        return {id(m): chosen[id(m)][1] if id(m) in chosen else default for m in units.values()}

    def _no_match(self, key: Union[str, type], units: dict[str, nn.Module]) -> str:
        shown = key if isinstance(key, str) else f"{key.__module__}.{key.__qualname__}"
        classes = sorted({_unwrapped(m).__class__.__name__ for m in units.values()})
        names = [n or "(root)" for n in units][:8]
        return bad_argument(
            "reshard_after_forward", self.shown, _ALLOWED,
            f"Use one of the unit classes {classes} or unit names {names}, or {ROOT_KEY!r}; e.g."
            f" `reshard_after_forward={{{ROOT_KEY!r}: True, {classes[-1]!r}: False}}`.",
            problem=f"The key {shown!r} matches no FSDP unit of this model",
        )


def parse_reshard_after_forward(value: Any) -> Union[ReshardChoice, ReshardPlan]:
    """Check the shape of the user's value; returns the value itself, or a :class:`ReshardPlan` for a dict."""
    if isinstance(value, Mapping):
        if not value:
            raise ValueError(
                bad_argument("reshard_after_forward", value, _ALLOWED,
                             f"Name at least one unit, e.g. `reshard_after_forward={{{ROOT_KEY!r}: True}}`, or pass"
                             " None.", problem="An empty dict chooses nothing")
            )
        entries = tuple((_parse_key(k, value), _parse_choice(v, value, k)) for k, v in value.items())
        return ReshardPlan(entries=entries, shown=dict(value))
    return _parse_choice(value, value, None)


def check_divides(choice: ReshardChoice, shard_size: int, shown: Any, where: str = "") -> None:
    """An int must divide the shard-axis size, which only the mesh knows (FSDP2 would fail later, less clearly)."""
    if choice is None or isinstance(choice, bool) or shard_size % choice == 0 and choice <= shard_size:
        return
    divisors = [d for d in range(2, shard_size + 1) if shard_size % d == 0]
    raise ValueError(
        bad_argument(
            "reshard_after_forward", shown,
            f"True, False, or an int that divides the shard-axis size {shard_size}: "
            + (", ".join(map(str, divisors)) if divisors else "none here (nothing is sharded)"),
            f"Use e.g. `reshard_after_forward={divisors[0] if len(divisors) > 1 else True}`"
            + (f" for {where}" if where else "") + ", or True to reshard over the whole shard axis.",
            problem=f"{choice} does not divide the {shard_size} ranks of the shard axis"
            + (f" (for {where})" if where else ""),
        )
    )


def _parse_choice(choice: Any, shown: Any, key: Any) -> ReshardChoice:
    if choice is None or isinstance(choice, bool):
        return choice
    if isinstance(choice, int) and choice > 1:
        return choice
    where = f" (the value for {key!r})" if key is not None else ""
    fix = ("Use `reshard_after_forward=True` to free parameters after forward, or False to keep them."
           if key is None else f"Give {key!r} True, False or an int > 1, e.g. `{{{key!r}: True}}`.")
    problem = ""
    if isinstance(choice, int):
        problem = (f"{choice}{where} is not a group size: 1 would keep every parameter (use False), and a group must"
                   " have at least 2 ranks")
    elif key is not None:
        problem = f"{choice!r}{where} is not a choice"
    raise ValueError(bad_argument("reshard_after_forward", shown, _ALLOWED, fix, problem=problem))


def _parse_key(key: Any, shown: Any) -> Union[str, type]:
    if isinstance(key, type) and issubclass(key, nn.Module):
        return key
    if not isinstance(key, str) or not key.strip():
        raise TypeError(
            bad_argument("reshard_after_forward", shown, _ALLOWED,
                         f"Key the dict by {ROOT_KEY!r}, a module class or a module name, e.g."
                         " `{'root': True, 'mypkg.model.Block': False}`.",
                         problem=f"The key {key!r} is not a class or a name")
        )
    key = key.strip()
    if key == ROOT_KEY or "." not in key:
        return key
    # A dotted key is a class to import (`mypkg.model.Block`) or a module name (`blocks.11`, `model.layers.0`).
    module_name, _, attribute = key.rpartition(".")
    try:
        found = getattr(importlib.import_module(module_name), attribute, None)
    except ImportError:
        found = None
    if isinstance(found, type) and issubclass(found, nn.Module):
        return found
    if found is not None:
        raise TypeError(
            bad_argument("reshard_after_forward", shown, _ALLOWED,
                         "Name a subclass of torch.nn.Module, e.g. `{'mypkg.model.Block': False}`.",
                         problem=f"{key!r} is {found!r}, not an nn.Module class")
        )
    return key  # a module name, checked against the model at setup


def _unwrapped(module: nn.Module) -> nn.Module:
    # A block wrapped for activation checkpointing is matched by the block's own class.
    return checkpoint_wrapped_module(module)


def _matches(key: Union[str, type], name: str, module: nn.Module, is_root: bool) -> bool:
    if key == ROOT_KEY:
        return is_root
    inner = _unwrapped(module)
    if isinstance(key, type):
        return isinstance(inner, key)
    return key == name or key in (cls.__name__ for cls in type(inner).__mro__ if cls is not nn.Module)
