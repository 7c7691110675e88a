"""One policy language for choosing modules, shared by wrapping and activation checkpointing.

A user can say which modules become FSDP units (or get activation checkpointing) in any of these forms:

- a set, list or tuple of ``nn.Module`` classes;
- dotted class names such as ``"mypkg.model.Block"`` (one string, or a list of them), so YAML can say it;
- a callable ``(module) -> bool``;
- a legacy FSDP1 callable ``(module, recurse, nonwrapped_numel) -> bool``, including torch's
  ``ModuleWrapPolicy`` and ``functools.partial(size_based_auto_wrap_policy, ...)``;
- ``"auto"``: the repeated blocks of the model (see :func:`detect_repeated_blocks`).

:func:`parse_policy` validates the user's value once, at construction time. :meth:`Policy.select` then
returns the chosen modules of a concrete model.
"""

from __future__ import annotations

import inspect
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

from torch import nn

from lightning_fsdp._base.errors import bad_argument
from lightning_fsdp._base.names import import_module_of

__all__ = ["Policy", "PolicyInput", "parse_policy", "detect_repeated_blocks", "describe_units"]

PolicyInput = Union[
    str,
    type[nn.Module],
    Iterable[Union[str, type[nn.Module]]],
    Callable[[nn.Module], bool],
    Callable[[nn.Module, bool, int], bool],
]

_ALLOWED = (
    "a set or list of nn.Module classes, dotted class names such as 'mypkg.model.Block' (a string or a list of "
    "them), a callable (module) -> bool, a legacy callable (module, recurse, nonwrapped_numel) -> bool such as "
    "torch's ModuleWrapPolicy, or 'auto'"
)


@dataclass(frozen=True)
class Policy:
    """A validated module-selection policy.

    Exactly one of ``classes``, ``predicate``, ``legacy`` is set, unless ``auto`` is true.
    """

    argument: str
    classes: tuple[type[nn.Module], ...] = ()
    predicate: Optional[Callable[[nn.Module], bool]] = None
    legacy: Optional[Callable[..., bool]] = None
    auto: bool = False

    def select(self, root: nn.Module, *, include_root: bool = False) -> list[nn.Module]:
        """The modules of ``root`` this policy chooses, in ``root.modules()`` order (parents before children).

        The root itself is left out unless ``include_root``: the root is always its own FSDP unit anyway.
        """
        if self.auto:
            classes = tuple(detect_repeated_blocks(root))
            chosen = [m for m in root.modules() if isinstance(m, classes)] if classes else []
        elif self.classes:
            chosen = [m for m in root.modules() if isinstance(m, self.classes)]
        elif self.predicate is not None:
            chosen = [m for m in root.modules() if self.predicate(m)]
        else:
            chosen = _select_legacy(root, self.legacy)
        if not include_root:
            chosen = [m for m in chosen if m is not root]
        return chosen


def parse_policy(value: Any, argument: str) -> Optional[Policy]:
    """Validate a user's policy value. ``None`` means "no policy"."""
    if value is None:
        return None
    if isinstance(value, str):
        if value == "auto":
            return Policy(argument, auto=True)
        return Policy(argument, classes=(_import_module_class(value, argument, value),))
    if isinstance(value, type):
        return Policy(argument, classes=(_check_module_class(value, argument, value),))
    if isinstance(value, (set, frozenset, list, tuple)):
        if not value:
            raise ValueError(
                bad_argument(
                    argument, value, _ALLOWED, f"Name at least one block class, e.g. `{argument}={{Block}}`.",
                    problem="An empty collection selects nothing",
                )
            )
        classes = []
        for item in value:
            if isinstance(item, str):
                classes.append(_import_module_class(item, argument, value))
            elif isinstance(item, type):
                classes.append(_check_module_class(item, argument, value))
            else:
                raise TypeError(
                    bad_argument(
                        argument, value, _ALLOWED,
                        f"Put only module classes or dotted class names in the collection, e.g. `{argument}={{Block}}`.",
                        problem=f"The collection holds {item!r} of type {type(item).__name__}",
                    )
                )
        return Policy(argument, classes=tuple(dict.fromkeys(classes)))
    if callable(value):
        if _is_legacy_callable(value):
            return Policy(argument, legacy=value)
        return Policy(argument, predicate=value)
    raise TypeError(
        bad_argument(
            argument, value, _ALLOWED,
            f"Pass the block classes, e.g. `{argument}={{Block}}`, or `{argument}='auto'`.",
            problem=f"A value of type {type(value).__name__} is not a policy",
        )
    )


def detect_repeated_blocks(root: nn.Module) -> list[type[nn.Module]]:
    """The classes of the model's repeated blocks: a class that appears two or more times as a direct child of one
    ``nn.ModuleList`` or ``nn.Sequential`` and owns parameters.

    When such classes nest (an MLP's ``Linear`` layers inside a repeated ``Block``), only the outermost class is
    kept: wrapping the inner ones too would only add collectives.
    """
    found: list[type[nn.Module]] = []
    for container in root.modules():
        if not isinstance(container, (nn.ModuleList, nn.Sequential)):
            continue
        counts = Counter(type(child) for child in container.children() if _owns_parameters(child))
        for cls, count in counts.items():
            if count >= 2 and cls not in found:
                found.append(cls)
    if not found:
        return []
    outer = tuple(found)
    nested: set[type[nn.Module]] = set()
    for module in root.modules():
        if isinstance(module, outer):
            for inner in module.modules():
                if inner is not module and type(inner) in found:
                    nested.add(type(inner))
    return [cls for cls in found if cls not in nested]


def candidate_block_classes(root: nn.Module, limit: int = 6) -> list[str]:
    """Classes of the model's submodules that own parameters, most frequent first, as 'Name (xN)'. Used to tell a
    user what a policy could have matched."""
    counts = Counter(type(m) for m in root.modules() if m is not root and _owns_parameters(m))
    return [f"{cls.__module__}.{cls.__qualname__} (x{n})" for cls, n in counts.most_common(limit)]


def describe_units(units: list[nn.Module]) -> str:
    """A short summary of the wrapped units, e.g. ``12 x Block + root``."""
    counts = Counter(type(u).__name__ for u in units)
    parts = [f"{n} x {name}" for name, n in counts.items()]
    return " + ".join(parts + ["root"])


def _owns_parameters(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def _is_legacy_callable(fn: Callable[..., Any]) -> bool:
    """True for FSDP1-style policies, which take ``(module, recurse, nonwrapped_numel)``."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return False
    positional = [
        p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty
    ]
    return len(positional) >= 3 or any(p.name in ("recurse", "nonwrapped_numel") for p in params)


def _select_legacy(root: nn.Module, fn: Callable[..., bool]) -> list[nn.Module]:
    """Emulate FSDP1's bottom-up auto wrapping: a module's ``nonwrapped_numel`` counts the parameters that no
    already-chosen descendant took."""
    chosen: list[nn.Module] = []

    def visit(module: nn.Module) -> int:
        # FSDP1 first asks whether to look inside a module at all (`recurse=True`); a "no" keeps the module whole,
        # e.g. size_based_auto_wrap_policy's force-leaf nn.MultiheadAttention, which reads its children's weights.
        total = sum(p.numel() for p in module.parameters())
        if not fn(module, True, total):
            return total
        remaining = sum(p.numel() for p in module.parameters(recurse=False))
        remaining += sum(visit(child) for child in module.children())
        if fn(module, False, remaining):
            chosen.append(module)
            return 0
        return remaining

    visit(root)
    order = {id(m): i for i, m in enumerate(root.modules())}
    return sorted(chosen, key=lambda m: order[id(m)])


def _import_module_class(name: str, argument: str, value: Any) -> type[nn.Module]:
    module_name, _, attr = name.rpartition(".")
    example = f"`{argument}=['mypkg.model.Block']`"
    if not module_name:
        raise ValueError(
            bad_argument(
                argument, value, _ALLOWED,
                f"Write the full import path of the class, e.g. {example}, or use 'auto'.",
                problem=f"{name!r} is not a dotted name (module.Class)",
            )
        )
    try:
        module = import_module_of(module_name)
    except ImportError as err:
        raise ValueError(
            bad_argument(
                argument, value, _ALLOWED,
                f"Check the spelling and that the package is importable, e.g. {example}.",
                problem=f"The module {module_name!r} of {name!r} could not be imported ({err})",
            )
        ) from err
    if not hasattr(module, attr):
        raise ValueError(
            bad_argument(
                argument, value, _ALLOWED,
                f"Check the class name, e.g. {example}.",
                problem=f"The module {module_name!r} has no attribute {attr!r}",
            )
        )
    return _check_module_class(getattr(module, attr), argument, value, shown_as=name)


def _check_module_class(obj: Any, argument: str, value: Any, shown_as: str = "") -> type[nn.Module]:
    if isinstance(obj, type) and issubclass(obj, nn.Module):
        return obj
    label = shown_as or repr(obj)
    raise TypeError(
        bad_argument(
            argument, value, _ALLOWED,
            f"Name a subclass of torch.nn.Module, e.g. `{argument}={{Block}}`.",
            problem=f"{label} is {obj!r}, not an nn.Module class",
        )
    )
