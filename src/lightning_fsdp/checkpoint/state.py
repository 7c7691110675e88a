"""What a user's ``state`` dict holds: models, optimizers, and everything else ("metadata")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.nn import Module
from torch.optim import Optimizer

from lightning_fsdp.checkpoint.integrity.tree import any_leaf
from lightning_fsdp.engine.at_rest import reshard_all

__all__ = ["SplitState", "split_state", "is_stateful", "holds_dtensors"]


@dataclass
class SplitState:
    models: dict[str, Module]
    optimizers: dict[str, Optimizer]
    metadata: dict[str, Any]  # as saved: Stateful objects already turned into their state_dict()
    owners: dict[str, Module]  # optimizer key -> the model whose parameters it updates


def split_state(state: dict[str, Any], *, for_save: bool) -> SplitState:
    models: dict[str, Module] = {}
    optimizers: dict[str, Optimizer] = {}
    metadata: dict[str, Any] = {}
    for key, value in state.items():
        if isinstance(value, Module):
            models[key] = value
        elif isinstance(value, Optimizer):
            optimizers[key] = value
        elif for_save:
            metadata[key] = value.state_dict() if is_stateful(value) else value
    _check_set_up(models)
    for module in models.values():
        reshard_all(module)
    return SplitState(models, optimizers, metadata, _optimizer_owners(models, optimizers))


def is_stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def holds_dtensors(value: Any) -> bool:
    """Whether ``value`` (nested dicts, lists and tuples) holds a sharded tensor anywhere (each shared container
    looked at once, see :mod:`~lightning_fsdp.checkpoint.integrity.tree`)."""
    return any_leaf(value, lambda leaf: isinstance(leaf, DTensor), what="the checkpoint state")


def _check_set_up(models: dict[str, Module]) -> None:
    for key, module in models.items():
        if not any(isinstance(m, FSDPModule) for m in module.modules()):
            raise ValueError(
                f"The model under key {key!r} was not set up by the strategy, so it holds no sharded parameters."
                " HINT: set it up first and pass what setup returns, e.g. `model = fabric.setup(model)` (Fabric)"
                " or let the Trainer set it up, then `save(path, {'model': model})`."
            )


def _optimizer_owners(models: dict[str, Module], optimizers: dict[str, Optimizer]) -> dict[str, Module]:
    """Match each optimizer to the model whose parameters it updates."""
    owners: dict[str, Module] = {}
    params_of = {key: {id(p) for p in module.parameters()} for key, module in models.items()}
    for key, optimizer in optimizers.items():
        ids = {id(p) for group in optimizer.param_groups for p in group["params"]}
        match = [k for k, params in params_of.items() if ids and ids <= params]
        if not match:
            raise ValueError(
                f"The optimizer under key {key!r} updates parameters that belong to no model in the checkpoint state"
                f" (models: {sorted(models)}). HINT: add the model it optimizes, e.g."
                f" `state={{'model': model, {key!r}: optimizer}}`."
            )
        owners[key] = models[match[0]]
    return owners
