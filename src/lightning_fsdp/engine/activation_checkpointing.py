"""Activation checkpointing: which blocks recompute their activations in backward, and which ops inside them do.

``activation_checkpointing_policy`` takes the policy language of :mod:`lightning_fsdp.engine.policy` (classes, dotted
names, a callable, ``"auto"``), which checkpoints every chosen block whole. A dict says more, and works the same in
Python and YAML::

    {"blocks": [Block], "every": 2}          # every 2nd block: the 2nd, 4th, ... in module order
    {"blocks": "auto", "save_ops": "default"}  # op-level selective checkpointing of every block
    {"save_ops": ["default", "torch.ops.aten.gelu"]}  # the default list plus one op

- ``blocks``: the blocks, in the policy language (default ``"auto"``, the model's repeated blocks);
- ``every``: checkpoint only every N-th of those blocks (default 1, all). Fewer checkpointed blocks keep more
  activations and recompute less;
- ``save_ops``: selective checkpointing inside each checkpointed block (torch's
  ``create_selective_checkpoint_contexts``): the outputs of these ops are saved in forward, everything else (norms,
  activations functions, adds: cheap pointwise ops with large outputs) is recomputed in backward. ``"default"`` is
  :data:`DEFAULT_SAVE_OPS`, the matmuls and attention kernels, whose recomputation costs the most time per byte
  saved. A list names ops as ``torch.ops.aten.mm``, ``aten.mm``, ``aten.mm.default`` or op objects; ``"default"``
  inside the list adds the default ones.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from lightning_fsdp._base.compat import CheckpointImpl, CheckpointWrapper, OpOverload, OpOverloadPacket, checkpoint_wrapper
from lightning_fsdp._base.errors import bad_argument
from lightning_fsdp.engine.policy import Policy, candidate_block_classes, parse_policy

__all__ = ["CheckpointingPolicy", "parse_checkpointing_policy", "apply_activation_checkpointing", "DEFAULT_SAVE_OPS",
           "through_checkpoint_wrappers"]

# Saved by default: matrix multiplies (linear layers decompose to mm/addmm; batched attention math to bmm/baddbmm)
# and the fused attention kernels, i.e. the ops whose recomputation costs the most compute per byte of output.
# Names that this torch build lacks (e.g. a backend's kernel) are skipped.
DEFAULT_SAVE_OPS = (
    "aten.mm", "aten.addmm", "aten.bmm", "aten.baddbmm", "aten._scaled_mm",
    "aten._scaled_dot_product_flash_attention", "aten._scaled_dot_product_flash_attention_for_cpu",
    "aten._scaled_dot_product_efficient_attention", "aten._scaled_dot_product_cudnn_attention",
    "aten._scaled_dot_product_fused_attention_overrideable",
)

_KEYS = ("blocks", "every", "save_ops")
_ALLOWED = (
    "the policy language of auto_wrap_policy (module classes, dotted class names, a callable, 'auto'), or a dict"
    " with keys 'blocks' (that language, default 'auto'), 'every' (an int >= 1, default 1) and 'save_ops' ('default'"
    " or a list of op names such as 'torch.ops.aten.mm', optionally with 'default' in it)"
)


@dataclass(frozen=True)
class CheckpointingPolicy(Policy):
    """A module policy for activation checkpointing, plus ``every`` (checkpoint every N-th chosen block) and
    ``save_ops`` (the ops a checkpointed block saves instead of recomputing; ``None``: recompute everything)."""

    every: int = 1
    save_ops: Optional[tuple[Any, ...]] = None  # OpOverload / OpOverloadPacket objects

    def select(self, root: nn.Module, *, include_root: bool = False) -> list[nn.Module]:
        chosen = super().select(root, include_root=include_root)
        # Count only the outermost chosen blocks: a chosen module inside another is covered by the outer one's
        # recomputation and is never wrapped on its own (see `_wrap_children`).
        chosen_ids = {id(m) for m in chosen}
        nested = {id(inner) for m in chosen for inner in m.modules() if inner is not m and id(inner) in chosen_ids}
        outermost = [m for m in chosen if id(m) not in nested]
        return [m for position, m in enumerate(outermost, start=1) if position % self.every == 0]

    def context_fn(self) -> Optional[Any]:
        """What ``torch.utils.checkpoint.checkpoint(..., context_fn=...)`` takes for op-level selection."""
        if self.save_ops is None:
            return None
        return functools.partial(create_selective_checkpoint_contexts, functools.partial(_save_listed, self.save_ops))


def parse_checkpointing_policy(value: Any, argument: str) -> Optional[Policy]:
    """A policy in the module-policy language, or a :class:`CheckpointingPolicy` for the dict form."""
    if not isinstance(value, Mapping):
        return parse_policy(value, argument)
    unknown = [k for k in value if k not in _KEYS]
    if unknown:
        raise TypeError(  # like any other value that is not a policy
            bad_argument(argument, value, _ALLOWED, f"Use only the keys {', '.join(map(repr, _KEYS))}, e.g."
                         f" `{argument}={{'blocks': [Block], 'every': 2}}`.", problem=f"Unknown key {unknown[0]!r}")
        )
    blocks = parse_policy(value.get("blocks", "auto"), argument)
    every = value.get("every", 1)
    if not isinstance(every, int) or isinstance(every, bool) or every < 1:
        raise (ValueError if isinstance(every, int) and not isinstance(every, bool) else TypeError)(
            bad_argument(argument, value, _ALLOWED, f"Give 'every' an int >= 1, e.g. `{argument}={{'every': 2}}` for"
                         " every 2nd block.", problem=f"'every' is {every!r}")
        )
    save_ops = _parse_ops(value["save_ops"], argument, value) if value.get("save_ops") is not None else None
    return CheckpointingPolicy(argument, classes=blocks.classes, predicate=blocks.predicate, legacy=blocks.legacy,
                               auto=blocks.auto, every=every, save_ops=save_ops)


def apply_activation_checkpointing(module: nn.Module, policy: Policy) -> None:
    """Wrap the blocks ``policy`` chooses in non-reentrant checkpoint wrappers, in place, before ``fully_shard`` (so
    each recomputation runs inside the unit that gathers its parameters)."""
    if any(isinstance(m, CheckpointWrapper) for m in module.modules()):
        warnings.warn(
            f"The model already contains activation-checkpoint wrappers; `{policy.argument}` is ignored so no block is"
            " checkpointed twice.",
            UserWarning,
            stacklevel=4,
        )
        return
    chosen = policy.select(module)
    if not chosen:
        candidates = ", ".join(candidate_block_classes(module)) or "(none)"
        warnings.warn(
            f"`{policy.argument}` selected no module, so nothing is checkpointed. Candidate block classes:"
            f" {candidates}.",
            UserWarning,
            stacklevel=4,
        )
        return
    context_fn = policy.context_fn() if isinstance(policy, CheckpointingPolicy) else None
    kwargs = {"context_fn": context_fn} if context_fn is not None else {}
    # Replace children in place, parents first; a chosen module nested inside another chosen one is left alone,
    # since the outer recomputation already covers it.
    _wrap_children(module, {id(m) for m in chosen}, kwargs)


def through_checkpoint_wrappers(module: nn.Module, blocks: list[nn.Module]) -> list[nn.Module]:
    """A block wrapped for activation checkpointing becomes a unit through its wrapper, so that the recomputed
    forward runs inside the unit whose parameters it gathers."""
    wrappers = {id(m._checkpoint_wrapped_module): m for m in module.modules() if isinstance(m, CheckpointWrapper)}
    return [wrappers.get(id(b), b) for b in blocks]


def _wrap_children(parent: nn.Module, chosen_ids: set[int], kwargs: dict[str, Any]) -> None:
    for name, child in list(parent.named_children()):
        if id(child) in chosen_ids:
            # Non-reentrant checkpointing composes with FSDP2's hooks and keeps state-dict keys clean; it is also the
            # only kind that takes a `context_fn`.
            setattr(parent, name, checkpoint_wrapper(child, checkpoint_impl=CheckpointImpl.NO_REENTRANT, **kwargs))
        else:
            _wrap_children(child, chosen_ids, kwargs)


def _save_listed(save_ops: tuple[Any, ...], ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    # An op matches by its overload (`aten.mm.default`) or its packet (`aten.mm`, every overload).
    chosen = op in save_ops or getattr(op, "overloadpacket", None) in save_ops
    return CheckpointPolicy.MUST_SAVE if chosen else CheckpointPolicy.PREFER_RECOMPUTE


def _parse_ops(value: Any, argument: str, shown: Any) -> tuple[Any, ...]:
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, (list, tuple, set, frozenset)) or not items:
        raise TypeError(
            bad_argument(argument, shown, _ALLOWED, f"Use `{argument}={{'save_ops': 'default'}}` or a list, e.g."
                         " `{'save_ops': ['torch.ops.aten.mm', 'torch.ops.aten.addmm']}`.",
                         problem=f"'save_ops' is {value!r}")
        )
    ops: list[Any] = []
    for item in items:
        if isinstance(item, str) and item.strip().lower() == "default":
            ops.extend(op for name in DEFAULT_SAVE_OPS if (op := _lookup_op(name)) is not None)
        elif isinstance(item, (OpOverload, OpOverloadPacket)):
            ops.append(item)
        elif isinstance(item, str):
            op = _lookup_op(item)
            if op is None:
                raise ValueError(
                    bad_argument(argument, shown, _ALLOWED,
                                 "Spell an op as torch names it, e.g. 'torch.ops.aten.mm' or 'aten.mm.default'"
                                 " (`print(torch.ops.aten.mm)` shows the name).",
                                 problem=f"{item!r} names no torch op")
                )
            ops.append(op)
        else:
            raise TypeError(
                bad_argument(argument, shown, _ALLOWED, "List ops by name, e.g. `['torch.ops.aten.mm']`, or as"
                             " `torch.ops.aten.mm`.", problem=f"{item!r} is not an op")
            )
    return tuple(dict.fromkeys(ops))


def _lookup_op(name: str) -> Optional[Any]:
    """``torch.ops.aten.mm`` / ``aten.mm`` / ``aten.mm.default`` -> the op object, or None."""
    parts = name.strip().removeprefix("torch.ops.").split(".")
    if len(parts) not in (2, 3) or not all(parts):
        return None
    try:
        found = getattr(getattr(torch.ops, parts[0]), parts[1])
        return getattr(found, parts[2]) if len(parts) == 3 else found
    except (AttributeError, RuntimeError):
        return None
