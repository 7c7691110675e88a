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

A dotted string key is read at setup, against the model, in this order (:func:`_resolve_key`):

1. the name of a submodule of the model (``"model.layers.0"``);
2. the import path of a class of the model's units or of one of their base classes (``"mypkg.model.Block"``; a
   class defined in a script run as ``python train.py`` answers to ``train.Block`` too);
3. only then, a class imported by that path (a re-export such as ``"torch.nn.TransformerEncoderLayer"``).

Why not import at construction, as the dotted names of the policies used to be: ``"model.layers.0"`` reads like
the module ``model.layers`` plus an attribute, and in a training script named ``model.py`` that import ran the
whole script a second time inside ``FSDPStrategy(...)``. The model is what the key talks about, so it is asked
first, and nothing is imported before setup.

Validated in two steps: the shape of the value at construction (:func:`parse_reshard_after_forward`), and what needs
the model and the mesh at setup (:meth:`ReshardPlan.choose`): every key must match a unit, every int must divide the
shard-axis size.
"""

from __future__ import annotations

import sys
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Union

from torch import nn

from lightning_fsdp._base.compat import checkpoint_wrapped_module
from lightning_fsdp._base.errors import bad_argument
from lightning_fsdp._base.names import import_module_of

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
    a class, or a string (module name, bare class name or dotted class path) resolved at setup by
    :func:`_resolve_key`."""

    entries: tuple[tuple[Union[str, type], ReshardChoice], ...]
    shown: Any  # the user's value, for messages

    def choose(
        self, units: dict[str, nn.Module], roots: list[nn.Module], default: ReshardChoice,
        module_names: Collection[str] = (),
    ) -> dict[int, ReshardChoice]:
        """The choice for each unit to be, by ``id``. ``units`` maps module names to the modules ``fully_shard`` will
        be applied to (roots included, wrappers looked through by the caller); ``module_names`` holds the name of
        every submodule of the model, so a key that names a submodule that is not a unit says so; ``default`` is the
        strategy's."""
        root_ids = {id(r) for r in roots}
        names = set(module_names) | set(units)
        chosen: dict[int, tuple[int, ReshardChoice]] = {}  # id -> (specificity, choice)
        for key, choice in self.entries:
            rank, matches = _resolve_key(key, units, names, self.shown)
            matched = [m for name, m in units.items() if matches(name, m, id(m) in root_ids)]
            if not matched:
                raise ValueError(self._no_match(key, units, is_module=rank == 2))
            for module in matched:
                if id(module) not in chosen or chosen[id(module)][0] <= rank:
                    chosen[id(module)] = (rank, choice)
        return {id(m): chosen[id(m)][1] if id(m) in chosen else default for m in units.values()}

    def _no_match(self, key: Union[str, type], units: dict[str, nn.Module], is_module: bool = False) -> str:
        shown = key if isinstance(key, str) else f"{key.__module__}.{key.__qualname__}"
        what = "names a submodule that is not an FSDP unit" if is_module else "matches no FSDP unit of this model"
        classes = sorted({_unwrapped(m).__class__.__name__ for m in units.values()})
        names = [n or "(root)" for n in units][:8]
        return bad_argument(
            "reshard_after_forward", self.shown, _ALLOWED,
            f"Use one of the unit classes {classes} or unit names {names}, or {ROOT_KEY!r}; e.g."
            f" `reshard_after_forward={{{ROOT_KEY!r}: True, {classes[-1]!r}: False}}`.",
            problem=f"The key {shown!r} {what}",
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
    # A string stays a string until setup: see the module docstring for why nothing is imported here.
    return key.strip()


def _resolve_key(
    key: Union[str, type], units: dict[str, nn.Module], module_names: set[str], shown: Any
) -> tuple[int, Callable[[str, nn.Module, bool], bool]]:
    """What ``key`` names in this model, as (specificity, matcher of ``(name, unit, is_root)``): 0 for ``"root"``,
    1 for a class, 2 for a module name. The order is the module docstring's."""
    if key == ROOT_KEY:
        return 0, lambda name, module, is_root: is_root
    if isinstance(key, type):
        return 1, lambda name, module, is_root: isinstance(_unwrapped(module), key)
    if key in module_names:
        return 2, lambda name, module, is_root: name == key
    if "." not in key:  # a bare class name
        return 1, lambda name, module, is_root: key in (c.__name__ for c in _classes(module))
    if any(key in _import_paths(c) for m in units.values() for c in _classes(m)):
        return 1, lambda name, module, is_root: any(key in _import_paths(c) for c in _classes(module))
    found = _import_attribute(key)
    if found is not None and not (isinstance(found, type) and issubclass(found, nn.Module)):
        raise TypeError(
            bad_argument("reshard_after_forward", shown, _ALLOWED,
                         "Name a subclass of torch.nn.Module, e.g. `{'mypkg.model.Block': False}`, or a submodule"
                         " of the model, e.g. `{'blocks.0': False}`.",
                         problem=f"{key!r} is {found!r}, not an nn.Module class")
        )
    if found is None:
        return 1, lambda name, module, is_root: False  # reported as matching no unit, with the units listed
    return 1, lambda name, module, is_root: isinstance(_unwrapped(module), found)


def _classes(module: nn.Module) -> list[type]:
    return [c for c in type(_unwrapped(module)).__mro__ if c not in (nn.Module, object)]


def _import_paths(cls: type) -> set[str]:
    """The dotted names a user may write for ``cls``; a class of the script being run (``__main__``) also answers
    to the script's file name, as ``python train.py`` users write ``train.Block``."""
    paths = {f"{cls.__module__}.{cls.__qualname__}"}
    if cls.__module__ == "__main__":
        main_file = getattr(sys.modules.get("__main__"), "__file__", None)
        if main_file:
            paths.add(f"{Path(main_file).stem}.{cls.__qualname__}")
    return paths


def _import_attribute(key: str) -> Any:
    """``mypkg.model.Block`` imported, or None when the module does not import or has no such attribute. Runs at
    setup only, after the model was asked (see :func:`_resolve_key`)."""
    module_name, _, attribute = key.rpartition(".")
    try:
        return getattr(import_module_of(module_name), attribute, None)
    except ImportError:
        return None


def _unwrapped(module: nn.Module) -> nn.Module:
    # A block wrapped for activation checkpointing is matched by the block's own class.
    return checkpoint_wrapped_module(module)
