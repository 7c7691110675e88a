"""Tensor parallelism inside FSDP: ``tensor_parallel_size=K`` and ``tensor_parallel_plan``.

The mesh gains a third axis, ``"tp"``, the innermost one, so the K ranks of one tensor-parallel group are neighbours
(on one node): ``(shard, tp)``, or ``(replicate, shard, tp)`` for the hybrid strategies and NO_SHARD. The modules the
plan names are split over ``"tp"`` by torch's ``parallelize_module``, and then ``fully_shard`` shards the result over
the data-parallel axes as it always does; the parameters are 2-D DTensors, which the rest of the strategy
(checkpoints, clipping, accumulation) already handles as DTensors.

The plan, :func:`parse_plan` (checked at construction) then :func:`resolve_plan` (against the model, at setup, before
any weight moves):

- a mapping from module names to styles, in Hugging Face's ``tp_plan`` format: a ``*`` in a name stands for one
  name part (``"layers.*.self_attn.q_proj": "colwise"``); a style is one of :data:`STYLES` or a torch
  ``ParallelStyle``;
- ``"auto"``: the plan a Hugging Face model carries (``model._tp_plan``: its config's ``base_model_tp_plan`` under the
  base model's prefix, and the head's own entries), for each Hugging Face model in the tree;
- a callable ``(module, tp_mesh) -> None`` that parallelizes the model itself (checked for nothing but running).

Every name pattern must match a module, no module may be named twice, and a style must fit its module: the
column/row styles go on ``nn.Linear`` and ``nn.Embedding`` whose split dimension the tensor-parallel size divides.
Hugging Face's ``"sequence_parallel"`` is refused by name (it needs sequence-split activations that no other style
gives), and so is a ``SequenceParallel`` object on a module with children.

A parameter that several modules share (tied embeddings and head) stays one parameter with one placement
(:func:`settle_ties` before the split, ``_retie`` after it): the invariant "a tie survives tensor parallelism".
"""

from __future__ import annotations

import copy
import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from difflib import get_close_matches
from typing import Any, Callable, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from lightning_fsdp._base.errors import bad_argument

log = logging.getLogger(__name__)

__all__ = [
    "STYLES", "TP_AXIS", "TensorParallel", "parse_tensor_parallel", "resolve_plan", "apply_tensor_parallel",
    "same_across_tensor_parallel", "find_ties", "settle_ties",
]

TP_AXIS = "tp"

# Hugging Face's style names (transformers' `ALL_PARALLEL_STYLES`) that map onto torch's own styles.
STYLES: dict[str, Callable[[], ParallelStyle]] = {
    "colwise": ColwiseParallel,
    "rowwise": RowwiseParallel,
    "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate()),
    "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
    "rowwise_rep": lambda: RowwiseParallel(input_layouts=Replicate()),
    "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate()),
    "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate()),
    "embedding_colwise": lambda: ColwiseParallel(output_layouts=Replicate()),
}
# Hugging Face's "sequence_parallel" is refused by name (see `_refuse_sequence_parallel`): torch's `SequenceParallel`
# expects activations sharded along the sequence between the layers, which none of the styles above give or take.
_SEQUENCE_PARALLEL = "sequence_parallel"
_PLAN_ALLOWED = (
    "None, 'auto' (a Hugging Face model's own tp_plan), a dict from module-name patterns ('layers.*.mlp.up_proj') to"
    f" styles ({', '.join(repr(s) for s in STYLES)}, or torch ParallelStyle objects), or a callable"
    " (module, tp_mesh) -> None"
)

PlanInput = Union[str, Mapping[str, Union[str, ParallelStyle]], Callable[[nn.Module, DeviceMesh], None], None]


@dataclass(frozen=True)
class TensorParallel:
    """The validated pair: ``size`` ranks per tensor-parallel group, and the plan (``"auto"``, a dict of patterns to
    style names or objects, or a callable)."""

    size: int
    plan: Any  # "auto" | dict[str, str | ParallelStyle] | callable

    @property
    def enabled(self) -> bool:
        return self.size > 1


def parse_tensor_parallel(size: Any, plan: PlanInput) -> TensorParallel:
    """Check the shapes of ``tensor_parallel_size`` and ``tensor_parallel_plan`` (the model is checked at setup)."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(bad_argument(
            "tensor_parallel_size", size, "an int >= 1 (1: no tensor parallelism)",
            "Use e.g. `tensor_parallel_size=2` to split each planned layer over 2 ranks.",
        ))
    if plan is None:
        if size > 1:
            raise ValueError(bad_argument(
                "tensor_parallel_plan", plan, _PLAN_ALLOWED,
                "Name what to split, e.g. `tensor_parallel_plan={'layers.*.mlp.up_proj': 'colwise',"
                " 'layers.*.mlp.down_proj': 'rowwise'}`, or 'auto' for a Hugging Face model.",
                problem=f"A tensor_parallel_size of {size} needs a plan",
            ))
        return TensorParallel(size, None)
    if size == 1:
        raise ValueError(bad_argument(
            "tensor_parallel_size", size, "an int > 1 when a tensor_parallel_plan is given",
            "Set `tensor_parallel_size=K` (K ranks per group, a divisor of the world size), or drop the plan.",
            problem="A tensor_parallel_plan without a tensor_parallel_size splits nothing",
        ))
    if isinstance(plan, str):
        if plan != "auto":
            raise ValueError(bad_argument("tensor_parallel_plan", plan, _PLAN_ALLOWED,
                                          "Pass 'auto' or a dict of module-name patterns to styles."))
        return TensorParallel(size, "auto")
    if isinstance(plan, Mapping):
        if not plan:
            raise ValueError(bad_argument("tensor_parallel_plan", plan, _PLAN_ALLOWED,
                                          "Name at least one module, e.g. `{'layers.*.mlp.up_proj': 'colwise'}`.",
                                          problem="An empty plan splits nothing"))
        return TensorParallel(size, {str(k): _parse_style(k, v, plan) for k, v in plan.items()})
    if callable(plan):
        return TensorParallel(size, plan)
    raise TypeError(bad_argument("tensor_parallel_plan", plan, _PLAN_ALLOWED,
                                 "Pass a dict such as `{'layers.*.attn.qkv': 'colwise'}`, 'auto' or a callable."))


def _parse_style(pattern: Any, style: Any, plan: Any) -> Union[str, ParallelStyle]:
    if isinstance(style, ParallelStyle) or style in STYLES:
        return style
    if style == _SEQUENCE_PARALLEL:
        raise ValueError(_refuse_sequence_parallel(pattern))
    close = get_close_matches(str(style), STYLES, n=1)
    raise ValueError(bad_argument(
        "tensor_parallel_plan", plan, f"styles {', '.join(repr(s) for s in STYLES)} or torch ParallelStyle objects",
        f"Use e.g. `{{{pattern!r}: {close[0] if close else 'colwise'!r}}}`.",
        problem=f"The style {style!r} of {pattern!r} is not a known style",
    ))


def resolve_plan(module: nn.Module, tp: TensorParallel, roots: tuple[str, ...] = ()
                 ) -> Union[dict[str, ParallelStyle], Callable[..., None]]:
    """The concrete plan for ``module``: every pattern expanded to the module names it matches, each with its style
    object, checked against the modules' shapes. A callable plan is returned as it is.

    ``roots`` are the names of the models a harness holds (a LightningModule's ``self.model``): a pattern that names
    no module of ``module`` itself is read inside each of them, so a plan written for the model
    (``"blocks.*.mlp.up"``) works as it does with Fabric, where the model is the root."""
    if callable(tp.plan) and not isinstance(tp.plan, Mapping):
        return tp.plan
    plan = _auto_plan(module) if tp.plan == "auto" else tp.plan
    names = {name: m for name, m in module.named_modules() if name}
    resolved: dict[str, ParallelStyle] = {}
    claimed: dict[str, str] = {}
    for pattern, style in plan.items():
        matched = _matches(pattern, names)
        for root in roots if not matched else ():
            matched += _matches(f"{root}.{pattern}", names)
        if not matched:
            close = get_close_matches(pattern, list(names), n=3)
            raise ValueError(bad_argument(
                "tensor_parallel_plan", pattern, "module-name patterns that match modules of the model",
                f"Use the module names of `{type(module).__name__}` (`[n for n, _ in model.named_modules()]`)"
                + (f", e.g. {close}" if close else "") + "; a '*' stands for one name part.",
                problem=f"The pattern {pattern!r} matches no module",
            ))
        if style == _SEQUENCE_PARALLEL:  # from a Hugging Face model's own plan ("auto")
            raise ValueError(_refuse_sequence_parallel(pattern, matched))
        for name in matched:
            if name in claimed:
                raise ValueError(bad_argument(
                    "tensor_parallel_plan", pattern, "patterns that name each module once",
                    f"Drop one of {claimed[name]!r} and {pattern!r}, or make them name different modules.",
                    problem=f"The module {name!r} is matched by both {claimed[name]!r} and {pattern!r}",
                ))
            claimed[name] = pattern
            style_object = STYLES[style]() if isinstance(style, str) else style
            _check_fits(name, names[name], style, style_object, tp.size)
            resolved[name] = style_object
    return resolved


def _matches(pattern: str, names: dict[str, nn.Module]) -> list[str]:
    matcher = re.compile(re.escape(pattern).replace(r"\*", r"[^.]+"))
    return [name for name in names if matcher.fullmatch(name)]


def apply_tensor_parallel(module: nn.Module, plan: Union[dict[str, ParallelStyle], Callable[..., None]],
                          tp_mesh: DeviceMesh) -> None:
    """Split the planned modules over ``tp_mesh`` (before ``fully_shard``), keeping every tied parameter one
    parameter (see :func:`settle_ties`)."""
    ties = find_ties(module)
    if isinstance(plan, dict):
        plan = settle_ties(module, plan, ties, tp_mesh)
        parallelize_module(module, tp_mesh, plan)
    else:
        plan(module, tp_mesh)
    _retie(ties, plan)


# --- Tied parameters ------------------------------------------------------------------------------------------------
#
# `parallelize_module` gives each planned module a new DTensor parameter. A parameter that two modules share (tied
# input embeddings and output head) would so become two, which train apart without a word. The rule: a tie stays one
# parameter with one placement. Where the plan splits its sides the same way, the styles run as planned and every
# side is then pointed at the one DTensor; where it splits them differently, setup refuses; where it splits only some
# sides, each other side gets the style that splits the shared weight the same way and still gives its callers the
# whole output (a "_rep" style: the module computes as before, on its share of the weight).

Slot = tuple[str, nn.Module, str]  # (module name, module, parameter attribute)

# The styles that can complete a tie on an unplanned module, tried in order; each gives whole outputs to its callers.
_COMPLETING: tuple[tuple[type, tuple[str, ...]], ...] = (
    (nn.Embedding, ("embedding_rowwise", "embedding_colwise")),
    (nn.Linear, ("colwise_rep", "rowwise_rep")),
)


def find_ties(module: nn.Module) -> list[list[Slot]]:
    """Every parameter that sits in two or more (module, attribute) slots of ``module``: its slots."""
    slots: dict[int, list[Slot]] = {}
    for name, owner in module.named_modules():
        for attr, param in owner._parameters.items():
            if param is not None:
                slots.setdefault(id(param), []).append((name, owner, attr))
    return [found for found in slots.values() if len(found) > 1]


def settle_ties(module: nn.Module, plan: dict[str, ParallelStyle], ties: list[list[Slot]], tp_mesh: DeviceMesh
                ) -> dict[str, ParallelStyle]:
    """``plan``, with a completing style for each unplanned side of a tie the plan splits elsewhere; a
    ``ValueError`` (before any weight moves) for a tie whose sides the plan splits differently, or one that no
    style can complete. What a style does to a parameter is read from a dry run of the style on a meta-device copy
    of the module, so torch's own styles and the user's are judged alike."""
    written, plan = plan, dict(plan)  # errors show the plan as written, without the styles added here
    for slots in ties:
        placed = {_label(s): _placement_under(module, s, plan, tp_mesh) for s in slots}
        split = {label: p for label, p in placed.items() if p is not None}
        if not split or _UNKNOWN in split.values():
            continue  # untouched, or a style the dry run cannot follow: `_retie` checks what it did
        if len(set(split.values())) > 1:
            raise ValueError(_tie_error(slots, written, "splits the sides of a tie differently: " + ", ".join(
                f"{label} as {_shown(p)}" for label, p in split.items())))
        target = next(iter(split.values()))
        for slot in slots:
            if placed[_label(slot)] is None:
                plan[slot[0]] = _completing_style(slot, target, slots, written, tp_mesh)
    return plan


_UNKNOWN = ("unknown",)


def _label(slot: Slot) -> str:
    return f"{slot[0]}.{slot[2]}" if slot[0] else slot[2]


def _joined(labels: list[str]) -> str:
    return " and ".join([", ".join(labels[:-1]), labels[-1]]) if len(labels) > 1 else labels[0]


def _shown(placements: tuple) -> str:
    return f"({', '.join(repr(p) for p in placements)})"


def _style_name(module: nn.Module, style: ParallelStyle) -> str:
    """The plan's name of ``style`` as written for ``module`` ('embedding_rowwise' on an embedding, 'rowwise_rep'
    on a Linear: the same torch style), or its repr."""
    names = [n for n, make in STYLES.items() if repr(make()) == repr(style)]
    embedding = isinstance(module, nn.Embedding)
    return next((n for n in names if n.startswith("embedding_") == embedding), names[0] if names else repr(style))


def _placement_under(root: nn.Module, slot: Slot, plan: dict[str, ParallelStyle], tp_mesh: DeviceMesh) -> Any:
    """The placements the plan gives the parameter in ``slot`` (``None``: left as it is), from the nearest planned
    module at or above the slot's module."""
    name, _, attr = slot
    above = [m for m in plan if m == name or name.startswith(m + ".")]
    if not above:
        return None
    nearest = max(above, key=len)
    return _dry_run(root.get_submodule(nearest), plan[nearest], tp_mesh, f"{name[len(nearest):]}.{attr}".lstrip("."))


def _dry_run(module: nn.Module, style: ParallelStyle, tp_mesh: DeviceMesh, param_name: str) -> Any:
    """The placements ``style`` gives ``module``'s parameter ``param_name`` (``None``: left a plain tensor), read
    from the style applied to a copy of ``module`` on the meta device; ``_UNKNOWN`` where that cannot run."""
    memo: dict[int, Any] = {id(t): nn.Parameter(torch.empty_like(t, device="meta"), requires_grad=t.requires_grad)
                            for t in module.parameters()}
    memo.update({id(b): torch.empty_like(b, device="meta") for b in module.buffers()})
    try:
        clone = copy.deepcopy(module, memo)
        quiet = copy.copy(style)
        quiet.src_data_rank = None  # each rank splits its own copy: no collective on meta tensors
        parallelize_module(clone, tp_mesh, quiet)
        param = clone.get_parameter(param_name)
    except Exception:  # a module that cannot be copied, or a style that needs real data: judged after the fact
        return _UNKNOWN
    return tuple(param.placements) if isinstance(param, DTensor) else None


def _completing_style(slot: Slot, target: tuple, slots: list[Slot], plan: dict[str, ParallelStyle],
                      tp_mesh: DeviceMesh) -> ParallelStyle:
    """The style that splits the parameter in ``slot`` as ``target`` on the slot's unplanned module."""
    name, owner, attr = slot
    if name in plan:  # planned, but its style leaves this parameter alone: a second style cannot be added
        raise ValueError(_tie_error(slots, plan, f"splits the tie on one side only; the style of {name!r} leaves"
                                    f" {attr!r} whole, where the other side is split as {_shown(target)}"))
    size = tp_mesh.size()
    for kind, names in _COMPLETING:
        if isinstance(owner, kind):
            for style_name in names:
                style = STYLES[style_name]()
                if _dry_run(owner, style, tp_mesh, attr) == target:
                    _check_fits(name, owner, style_name, style, size)
                    log.info("Tensor parallelism: %r gets %r, so that its tied %r is split as its other side is.",
                             name, style_name, attr)
                    return style
    raise ValueError(_tie_error(slots, plan, f"splits the tie on one side only (as {_shown(target)}), and no style"
                                f" splits {_label(slot)} of the {type(owner).__name__} {name!r} so"))


def _tie_error(slots: list[Slot], plan: dict[str, ParallelStyle], problem: str) -> str:
    labels = _joined([_label(s) for s in slots])
    planned = {s[0]: _style_name(s[1], plan[s[0]]) for s in slots if s[0] in plan}
    return bad_argument(
        "tensor_parallel_plan", planned, "a plan that splits a tied parameter the same way on every side"
        " (e.g. 'embedding_rowwise' on the embedding with 'colwise' or 'colwise_rep' on the head: both split the"
        " vocabulary rows)",
        f"Give every side of the tie a style that splits it the same way, or leave every side out of the plan, e.g."
        f" `{{{', '.join(f'{s[0]!r}: ...' for s in slots)}}}` with matching styles; or untie the weights"
        " (`tie_word_embeddings=False` on a Hugging Face config) if they are meant to train apart.",
        problem=f"{labels} are one tied parameter, and the plan {problem}",
    )


def _retie(ties: list[list[Slot]], plan: Union[dict[str, ParallelStyle], Callable[..., None]]) -> None:
    """Point every slot of each tie at one parameter after the split; refuse a split that left the sides apart
    (a callable plan, or a style the dry run could not follow)."""
    for slots in ties:
        current = [owner._parameters[attr] for _, owner, attr in slots]
        if all(p is current[0] for p in current):
            continue
        layouts = {(p.device_mesh, tuple(p.placements)) if isinstance(p, DTensor) else None for p in current}
        if None in layouts or len(layouts) > 1:
            shown = ", ".join(f"{_label(s)} as {_shown(p.placements) if isinstance(p, DTensor) else 'whole'}"
                              for s, p in zip(slots, current))
            shown_plan = {s[0]: _style_name(s[1], plan[s[0]]) for s in slots if s[0] in plan} if isinstance(
                plan, dict) else plan
            raise ValueError(bad_argument(
                "tensor_parallel_plan", shown_plan, "a plan that splits a tied parameter the same way on every side",
                "Split every side of the tie with styles that give it the same placements, or none of them.",
                problem=f"{_joined([_label(s) for s in slots])} are one tied parameter, but after the plan ran"
                f" they are {len(set(map(id, current)))} ({shown}), which would train apart",
            ))
        for _, owner, attr in slots:
            owner._parameters[attr] = current[0]


def same_across_tensor_parallel(module: nn.Module, tp_mesh: DeviceMesh, device: torch.device) -> None:
    """After meta-device init, give the parameters that tensor parallelism replicates (norms, unplanned layers) the
    values of the group's first rank: each rank initialized its own pieces from its own random stream, which is
    right for the split parameters and wrong for the copies."""
    group, first = tp_mesh.get_group(), tp_mesh.mesh.flatten()[0].item()
    comm = device if dist.get_backend(group) == "nccl" else torch.device("cpu")
    with torch.no_grad():
        for param in module.parameters():
            if not _replicated_over(param, tp_mesh):
                continue
            local = param.to_local() if isinstance(param, DTensor) else param
            if not local.numel():
                continue
            buffer = local.detach().to(comm)
            dist.broadcast(buffer, src=first, group=group)
            local.copy_(buffer)


def _replicated_over(param: torch.Tensor, tp_mesh: DeviceMesh) -> bool:
    """Whether ``param`` holds the same values on every rank of ``tp_mesh``: a plain tensor, or a DTensor whose
    mesh has no "tp" axis or replicates along it."""
    if not isinstance(param, DTensor):
        return True
    names = param.device_mesh.mesh_dim_names or ()
    if TP_AXIS not in names:
        return True
    return isinstance(param.placements[names.index(TP_AXIS)], Replicate)


def _auto_plan(module: nn.Module) -> dict[str, str]:
    """The Hugging Face models' own plans, each under the model's name in the tree (``""`` for the root)."""
    plan: dict[str, str] = {}
    taken: list[str] = []
    for name, sub in module.named_modules():
        if any(name.startswith(t + ".") or t == "" for t in taken):
            continue
        own = getattr(sub, "_tp_plan", None)
        if isinstance(own, Mapping) and own and hasattr(sub, "config"):
            taken.append(name)
            plan.update({f"{name}.{k}" if name else k: v for k, v in own.items()})
    if not plan:
        raise ValueError(bad_argument(
            "tensor_parallel_plan", "auto", "'auto' only for a model that carries a Hugging Face tp_plan",
            f"`{type(module).__name__}` has none: pass the plan, e.g. `tensor_parallel_plan={{'layers.*.mlp.up_proj':"
            " 'colwise', 'layers.*.mlp.down_proj': 'rowwise'}`.",
            problem="No module of the model carries a tp_plan (a Hugging Face model's `_tp_plan`)",
        ))
    return plan


def _refuse_sequence_parallel(pattern: Any, modules: Sequence[str] = ()) -> str:
    where = f" ({', '.join(repr(m) for m in modules[:3])}{', ...' if len(modules) > 3 else ''})" if modules else ""
    return bad_argument(
        "tensor_parallel_plan", {pattern: _SEQUENCE_PARALLEL}, f"styles {', '.join(repr(s) for s in STYLES)} or torch"
        " ParallelStyle objects",
        f"Leave {pattern!r} out of the plan: the modules it names then stay whole on every rank of a tensor-parallel"
        " group, and FSDP shards them over the data-parallel ranks as it shards any unplanned layer"
        + (" (for a Hugging Face model's own plan, pass it as a dict without that entry)." if modules else "."),
        problem=f"The style 'sequence_parallel' of {pattern!r}{where} is not supported: it expects the activations"
        " between the layers split along the sequence, but 'colwise' and 'rowwise' take and give whole sequences, so"
        " torch would fail inside the forward with a shape error",
    )


def _check_fits(name: str, module: nn.Module, shown: Any, style: ParallelStyle, size: int) -> None:
    if isinstance(style, SequenceParallel) and next(module.children(), None) is not None:
        child = next(n for n, _ in module.named_children())
        raise ValueError(bad_argument(
            "tensor_parallel_plan", {name: shown}, "SequenceParallel on modules without children (the norms)",
            f"Name the norm modules themselves, e.g. `{{'{name}.{child}': SequenceParallel()}}` for a norm there.",
            problem=f"{name!r} is a {type(module).__name__} with children; torch's SequenceParallel replaces the"
            " parameters of its whole subtree by their dotted names, which fails inside torch",
        ))
    if not isinstance(style, (ColwiseParallel, RowwiseParallel)):
        return
    colwise = isinstance(style, ColwiseParallel)
    if isinstance(module, nn.Linear):
        dim, what = (module.out_features, "out_features") if colwise else (module.in_features, "in_features")
    elif isinstance(module, nn.Embedding):
        dim, what = (module.embedding_dim, "embedding_dim") if colwise else (module.num_embeddings, "num_embeddings")
    else:
        raise ValueError(bad_argument(
            "tensor_parallel_plan", {name: shown}, "column and row styles on nn.Linear or nn.Embedding modules",
            f"Name the Linear layers inside `{name}` instead, e.g. `{{'{name}.<child>': {shown!r}}}`.",
            problem=f"{name!r} is a {type(module).__name__}, which a {type(style).__name__} cannot split",
        ))
    if dim % size:
        raise ValueError(bad_argument(
            "tensor_parallel_plan", {name: shown}, f"modules whose split dimension divides by {size}",
            f"Use a tensor_parallel_size that divides {dim}, or leave {name!r} out of the plan.",
            problem=f"{name!r} has {what}={dim}, which {size} ranks cannot split evenly",
        ))
