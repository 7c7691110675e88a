"""Gradient clipping over sharded gradients.

A rank holds only shards of each gradient, so a norm computed locally is wrong. The norm is computed on the
DTensor gradients, which reduces the partial norms across the mesh, and every rank then scales its shards by the
same factor.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

__all__ = ["clip_grad_norm", "clip_grad_value"]


def clip_grad_norm(
    parameters: Iterable[Tensor], max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = True
) -> Tensor:
    """Clip gradients to ``max_norm`` and return the global norm before clipping, the same on every rank."""
    params = [p for p in parameters if p.grad is not None]
    grads = [p.grad for p in params]
    if not grads:
        return torch.tensor(0.0)
    total = torch.nn.utils.get_total_norm(grads, norm_type=norm_type, error_if_nonfinite=False)
    if isinstance(total, DTensor):
        # The local result is a partial norm; `full_tensor` reduces it across the shard (and replica) axes.
        total = total.full_tensor()
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"The total norm of order {norm_type} of the gradients is non-finite ({total.item()}), so they cannot be"
            " clipped. HINT: pass `error_if_nonfinite=False` to skip this check, or lower the learning rate."
        )
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total


def clip_grad_value(parameters: Iterable[Tensor], clip_value: float) -> None:
    """Clamp every gradient element to ``[-clip_value, clip_value]``; elementwise, so shards need no talk."""
    with torch.no_grad():
        for p in parameters:
            if p.grad is not None:
                grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                grad.clamp_(-clip_value, clip_value)
