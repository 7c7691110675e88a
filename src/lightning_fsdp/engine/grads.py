"""Gradient clipping over sharded gradients.

A rank holds only shards of each gradient, so a norm computed locally is wrong. Each rank computes the partial
norm of its local shards, the partials are reduced over the mesh axes the gradients are sharded on (never over
replicate axes, whose copies are identical), and every rank then scales its shards by the same factor.

The partials are computed on plain local tensors: a rank whose shard of a small parameter is empty contributes
zero, where torch's own norm of an empty tensor raises for ``norm_type=inf`` on that rank alone and leaves the
others waiting in the collective.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor, Replicate

__all__ = ["clip_grad_norm", "clip_grad_value", "total_grad_norm"]


def total_grad_norm(grads: Iterable[Tensor], norm_type: float) -> Tensor:
    """The norm of all gradients together, identical on every rank, as a float32 scalar.

    A NaN anywhere makes it NaN on every rank, whatever ``norm_type``: for ``inf`` the partials are reduced with
    MAX, and gloo's MAX drops NaN (a comparison with NaN is false), so each partial carries a second element, 1 when
    its shard holds a NaN, that MAX keeps.
    """
    grads = list(grads)
    device = _local(grads[0]).device if grads else torch.device("cpu")
    inf = math.isinf(norm_type)
    size = 2 if inf else 1  # (partial, has-NaN flag) for inf; the p-th power sum carries NaN through SUM itself
    # One partial per (mesh, sharded axes), since each needs its own reduction.
    partials: dict[tuple, tuple[Tensor, list]] = {}
    local_total = torch.zeros(size, dtype=torch.float32, device=device)
    for grad in grads:
        local = _local(grad).detach()
        part = torch.zeros(size, dtype=torch.float32, device=device)
        if local.numel() and inf:
            part = torch.stack([local.abs().max().float(), local.isnan().any().float()]).to(device)
        elif local.numel():
            part = torch.linalg.vector_norm(local.float(), norm_type).pow(norm_type).reshape(1).to(device)
        if isinstance(grad, DTensor):
            # Every axis the gradient is split along: `Shard`, and the `_StridedShard` that FSDP puts over a tensor-
            # parallel shard (not a `Shard` subclass). Only `Replicate` axes hold copies, reduced never.
            axes = [i for i, p in enumerate(grad.placements) if not isinstance(p, Replicate)]
            key = (id(grad.device_mesh), tuple(axes))
            if key not in partials:
                partials[key] = (torch.zeros(size, dtype=torch.float32, device=device), [grad.device_mesh, axes])
            acc = partials[key][0]
            partials[key] = (torch.maximum(acc, part) if inf else acc + part, partials[key][1])
        else:
            local_total = torch.maximum(local_total, part) if inf else local_total + part
    op = dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM
    total = local_total
    for acc, (mesh, axes) in partials.values():
        for axis in axes:
            dist.all_reduce(acc, op=op, group=mesh.get_group(axis))
        total = torch.maximum(total, acc) if inf else total + acc
    if inf:
        return torch.where(total[1] > 0, torch.full_like(total[0], float("nan")), total[0])
    return total[0].pow(1.0 / norm_type)


def clip_grad_norm(
    parameters: Iterable[Tensor], max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = True
) -> Tensor:
    """Clip gradients to ``max_norm`` and return the global norm before clipping, the same on every rank."""
    params = [p for p in parameters if p.grad is not None]
    total = total_grad_norm([p.grad for p in params], norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"The total norm of order {norm_type} of the gradients is non-finite ({total.item()}), so they cannot be"
            " clipped. HINT: pass `error_if_nonfinite=False` to skip this check, or lower the learning rate."
        )
    coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    with torch.no_grad():
        for p in params:
            local = _local(p.grad)
            local.mul_(coefficient.to(device=local.device, dtype=local.dtype))
    return total


def clip_grad_value(parameters: Iterable[Tensor], clip_value: float) -> None:
    """Clamp every gradient element to ``[-clip_value, clip_value]``; elementwise, so shards need no talk."""
    with torch.no_grad():
        for p in parameters:
            if p.grad is not None:
                _local(p.grad).clamp_(-clip_value, clip_value)


def _local(t: Tensor) -> Tensor:
    return t.to_local() if isinstance(t, DTensor) else t
