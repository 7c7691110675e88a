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
"""

from __future__ import annotations

import re
from collections.abc import Mapping
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

__all__ = [
    "STYLES", "TP_AXIS", "TensorParallel", "parse_tensor_parallel", "resolve_plan", "apply_tensor_parallel",
    "same_across_tensor_parallel",
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
    "sequence_parallel": SequenceParallel,
}
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
    """Split the planned modules over ``tp_mesh`` (before ``fully_shard``)."""
    if isinstance(plan, dict):
        parallelize_module(module, tp_mesh, plan)
    else:
        plan(module, tp_mesh)


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


def _check_fits(name: str, module: nn.Module, shown: Any, style: ParallelStyle, size: int) -> None:
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
