"""The invariant "every unit is sharded whenever user code runs", and the one function that restores it.

Why it needs enforcing: FSDP2 keeps the root unit (and every unit with ``reshard_after_forward=False``, e.g. under
SHARD_GRAD_OP) unsharded after forward, because backward needs those parameters at once, and it is the backward that
reshards them. A forward that gets no backward (under ``no_grad`` or ``inference_mode``, a frozen teacher, an output
nobody backpropagates) leaves them unsharded. Then ``module.parameters()`` returns the gathered plain tensors instead
of the DTensor shards the optimizer holds: a step updates shards that the next forward never reads (it reuses the
stale gathered copy), an optimizer built then holds tensors FSDP swaps out again, and in-place math between two
models (an EMA ``lerp_``) mixes Tensor and DTensor.

:func:`reshard_all` is the one function that puts a model back at rest. It runs:

1. right after a root's forward that no backward is expected to follow: autograd off (``no_grad``,
   ``inference_mode``), no tensor of the output requiring grad (a frozen teacher), or the root in ``eval()`` mode;
   via :func:`reshard_after_grad_free_forwards`;
2. before every step of an optimizer set up by the strategy (a forward whose output was dropped is caught here, the
   first point where stale parameters would do harm), via :func:`reshard_before_steps`;
3. before ``state_dict()``, saving, loading and optimizer setup.

None of these is on the path of ordinary forward+backward training: there the backward has already resharded every
unit, each ``reshard()`` finds nothing to do, and no extra all-gather happens.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Iterable, Mapping
from typing import Any, Callable

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.optim import Optimizer

__all__ = ["reshard_all", "reshard_after_grad_free_forwards", "reshard_before_steps", "ModelSet"]

_GUARDED = "_lightning_fsdp_reshard_guard"  # marks modules and optimizers that already carry the hooks


@torch.compiler.disable  # eager bookkeeping: never traced into a user's compiled forward (see below)
def reshard_all(module: nn.Module) -> None:
    """Put every unit of ``module`` back into its sharded state (a cheap no-op for units that already are).

    Called from a root's forward hook, it runs inside the compiled region when the user compiles the model; traced
    there, dynamo guarded on FSDP's own state as ``reshard()`` changed it, and on Lightning 2.5.6 building those
    guards failed with an IndexError in a compiled Trainer validation.

    ``FSDPModule.reshard()`` outside forward always goes all the way back to the full-world shards, also for units
    that ``reshard_after_forward=<int>`` left on a smaller group: those are not the parameters the optimizer holds
    either.
    """
    for unit in module.modules():
        if isinstance(unit, FSDPModule):
            unit.reshard()


def reshard_after_grad_free_forwards(model: nn.Module, roots: Iterable[nn.Module]) -> None:
    """After each forward of a root unit that no backward is expected to follow, reshard everything under that
    root; and reshard ``model`` before its ``state_dict()``.

    A training-mode forward whose output requires grad is left to its backward (and, should none come, to the next
    optimizer step or ``state_dict()``). A wrong guess the other way (a model trained in ``eval()`` mode to freeze
    its norm statistics) costs one extra all-gather of the root in backward, never a wrong number: FSDP gathers a
    sharded unit again before its backward.
    """
    for root in roots:
        if not getattr(root, _GUARDED, False):
            root.register_forward_hook(_reshard_if_no_backward_can_follow)
            setattr(root, _GUARDED, True)
    if not getattr(model, _GUARDED, False):
        model.register_state_dict_pre_hook(lambda module, prefix, keep_vars: reshard_all(module))
        setattr(model, _GUARDED, True)


def reshard_before_steps(optimizer: Optimizer, models: Callable[[], Iterable[nn.Module]]) -> None:
    """Reshard every model that ``models()`` yields before each ``optimizer.step()``, however the step is called
    (through the strategy, a Lightning closure, or the raw optimizer)."""
    if getattr(optimizer, _GUARDED, False):
        return

    def before_step(opt: Optimizer, args: Any, kwargs: Any) -> None:
        for model in models():
            reshard_all(model)

    optimizer.register_step_pre_hook(before_step)
    setattr(optimizer, _GUARDED, True)


class ModelSet:
    """The models a strategy has set up, held weakly so a strategy does not keep a discarded model alive."""

    def __init__(self) -> None:
        self._refs: list[weakref.ref] = []

    def add(self, model: nn.Module) -> None:
        if all(ref() is not model for ref in self._refs):
            self._refs.append(weakref.ref(model))

    def __call__(self) -> list[nn.Module]:
        self._refs = [ref for ref in self._refs if ref() is not None]
        return [model for model in (ref() for ref in self._refs) if model is not None]


def _reshard_if_no_backward_can_follow(module: nn.Module, args: Any, output: Any) -> None:
    if not torch.is_grad_enabled() or not module.training or not _requires_grad(output):
        reshard_all(module)


def _requires_grad(obj: Any) -> bool:
    """Whether any tensor in ``obj`` (nested containers, dataclasses and mappings such as Hugging Face's
    ``ModelOutput`` included) requires grad."""
    if isinstance(obj, torch.Tensor):
        return obj.requires_grad
    if isinstance(obj, Mapping):
        return any(_requires_grad(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(_requires_grad(v) for v in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return any(_requires_grad(getattr(obj, f.name)) for f in dataclasses.fields(obj))
    return False
