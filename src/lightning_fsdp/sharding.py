"""Every ``fully_shard`` decision: activation checkpointing, unit selection, meta-device materialization and the
remapping of optimizers onto the sharded parameters.

The order matters and is fixed in :func:`shard_model`:

1. activation checkpointing wraps the chosen blocks (so recomputation happens inside one FSDP unit);
2. ``fully_shard`` runs bottom-up on the policy's units, then on the root;
3. meta-device parameters are materialized, now as local shards only;
4. optimizers are pointed at the final parameter objects.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from lightning_fsdp._compat import CheckpointImpl, CheckpointWrapper, checkpoint_wrapper
from lightning_fsdp.config import FSDPConfig
from lightning_fsdp.policy import Policy, candidate_block_classes, describe_units

__all__ = [
    "ShardedModel",
    "shard_model",
    "ParameterOwners",
    "remap_optimizer",
    "no_backward_sync",
    "sync_replicas",
    "harness_roots",
    "has_meta_tensors",
]

log = logging.getLogger(__name__)


@dataclass
class ShardedModel:
    module: nn.Module
    summary: str  # e.g. "12 x Block + root"


class ParameterOwners:
    """Remembers, for each parameter of a model, which module holds it and under which name.

    ``fully_shard`` and ``to_empty`` replace parameter objects, but they leave the owning module and attribute name
    alone. Looking a parameter up again through its owner finds its replacement, however many times it was
    replaced, and whatever wrappers were inserted above the owner.
    """

    def __init__(self, module: nn.Module) -> None:
        self._owners: dict[int, tuple[nn.Module, str]] = {}
        self._originals: list[nn.Parameter] = []  # keeps the ids above from being reused
        for owner in module.modules():
            for name, param in owner._parameters.items():
                if param is not None and id(param) not in self._owners:
                    self._owners[id(param)] = (owner, name)
                    self._originals.append(param)

    def current(self, param: torch.Tensor) -> Optional[torch.Tensor]:
        """The parameter that now stands where ``param`` stood; ``param`` itself if it is already current; ``None``
        if the model never owned it."""
        entry = self._owners.get(id(param))
        if entry is not None:
            owner, name = entry
            return owner._parameters[name]
        if any(param is owner._parameters.get(name) for owner, name in self._owners.values()):
            return param
        return None


def shard_model(
    module: nn.Module,
    config: FSDPConfig,
    mesh: DeviceMesh,
    device: torch.device,
    mp_policy: Optional[MixedPrecisionPolicy],
    *,
    harness: bool = False,
) -> ShardedModel:
    """Apply activation checkpointing and FSDP2 to ``module`` in place and materialize meta tensors.

    ``harness=True`` is for a module whose own forward need not run, because its code calls submodules directly (a
    LightningModule's ``training_step`` calls ``self.model(x)``). FSDP gathers a unit's parameters in the unit's
    forward, so ``module`` cannot be the root unit there: its top-level submodules that hold parameters outside the
    policy's units become root units of their own instead (see :func:`harness_roots`).
    """
    _refuse_fsdp1(module)
    existing_units = _fsdp_units(module)
    if existing_units:
        warnings.warn(
            f"The model already contains FSDP2 units ({describe_units(existing_units)}); `auto_wrap_policy` is"
            " ignored and only the root is wrapped if it is not a unit yet.",
            UserWarning,
            stacklevel=3,
        )
        blocks: list[nn.Module] = []
    else:
        # Choose the units before checkpoint wrappers change the module tree the policy looks at.
        blocks = _select_units(module, config.auto_wrap_policy)
    if config.activation_checkpointing_policy is not None:
        _apply_activation_checkpointing(module, config.activation_checkpointing_policy)

    kwargs = {
        "mesh": mesh,
        "mp_policy": mp_policy or MixedPrecisionPolicy(),
        "offload_policy": _offload_policy_for(config, device),
    }
    reshard = config.reshard_after_forward
    if reshard is None:
        reshard = config.sharding_strategy.default_reshard_after_forward
    # Named now: `fully_shard` swaps each unit's class for an `FSDP<Name>` subclass.
    summary = describe_units([m for m in blocks or existing_units if m is not module])
    # Bottom-up: a unit takes the parameters no descendant unit took, so children must go first.
    for unit in reversed(_through_checkpoint_wrappers(module, blocks)):
        fully_shard(unit, reshard_after_forward=reshard, **kwargs)
    roots = harness_roots(module) if harness else [module]
    if harness:
        summary += f" ({', '.join(type(r).__name__ for r in roots)})"
    for root in roots:
        if not isinstance(root, FSDPModule):
            fully_shard(root, reshard_after_forward=reshard, **kwargs)

    was_meta = has_meta_tensors(module)
    if was_meta:  # the per-shard seeding in `_materialize` already keeps replicas identical
        _materialize(module, mesh, device, params_on_cpu=config.cpu_offload)
    if not was_meta:
        sync_replicas(module, mesh, device)
    return ShardedModel(module=module, summary=summary)


def harness_roots(module: nn.Module) -> list[nn.Module]:
    """The top-level submodules of ``module`` that hold parameters no unit manages, looking through containers that
    have no forward of their own (``ModuleList``, ``ModuleDict``). Each becomes a root unit, so one forward gathers
    what it uses; several roots (a generator and a discriminator) each run FSDP's usual forward/backward cycle, which
    is what lets a step run several forwards, backwards and optimizer steps in any order."""
    managed = {id(p) for unit in _fsdp_units(module) for p in unit.parameters()}
    roots: list[nn.Module] = []

    def visit(parent: nn.Module, prefix: str) -> None:
        direct = [f"{prefix}{n}" for n, p in parent.named_parameters(recurse=False) if id(p) not in managed]
        if direct:
            raise ValueError(
                f"The parameters {direct[:5]} belong directly to `{type(parent).__name__}`, whose forward is not where"
                " they are used, so FSDP has no forward in which to gather them. HINT: move each into the submodule"
                f" whose forward uses it, e.g. from `self.{direct[0]}` to `self.model.{direct[0].rsplit('.', 1)[-1]}`."
            )
        for name, child in parent.named_children():
            if not any(id(p) not in managed for p in child.parameters()):
                continue
            if type(child).forward is nn.Module.forward:  # a container: its children are what gets called
                visit(child, f"{prefix}{name}.")
            else:
                roots.append(child)

    visit(module, "")
    return roots


def remap_optimizer(optimizer: Optimizer, owners: list[ParameterOwners]) -> None:
    """Point every param group of ``optimizer`` at the parameters that replaced the ones it was built with.

    Groups and their hyperparameters stay as they are. The lists are updated in place, because some optimizers
    (LBFGS) keep a reference to them.
    """
    if optimizer.state:
        raise ValueError(
            f"The optimizer {type(optimizer).__name__} already has state for {len(optimizer.state)} parameter(s), so it"
            " cannot be moved onto the sharded parameters. HINT: set the model and optimizer up through the strategy"
            " before the first `optimizer.step()` (Fabric: `model, optimizer = fabric.setup(model, optimizer)`)."
        )
    for group in optimizer.param_groups:
        resolved = [_resolve(owners, p) for p in group["params"]]
        foreign = [p for p, new in zip(group["params"], resolved) if new is None]
        if foreign:
            raise ValueError(
                f"The optimizer {type(optimizer).__name__} holds {len(foreign)} parameter(s) (shapes"
                f" {[tuple(p.shape) for p in foreign[:3]]}{', ...' if len(foreign) > 3 else ''}) that belong to no"
                " model set up by the strategy, so they would be neither sharded nor synchronized across ranks."
                " HINT: build the optimizer from the model it trains, e.g. `torch.optim.AdamW(model.parameters())`,"
                " and set that model up through the strategy too."
            )
        group["params"][:] = resolved


def _resolve(owners: list[ParameterOwners], param: torch.Tensor) -> Optional[torch.Tensor]:
    for table in owners:
        current = table.current(param)
        if current is not None:
            return current
    return None


@contextmanager
def no_backward_sync(module: nn.Module, reduce_scatter_only: bool) -> Iterator[None]:
    """Skip gradient communication for the backward passes inside the block.

    ``reduce_scatter_only`` (hybrid sharding) keeps the reduce-scatter inside each shard group, so gradients stay
    sharded and memory stays low, and skips only the all-reduce across replicas. Nesting is the caller's business:
    this always turns communication back on when it exits.
    """
    units = _fsdp_units(module)
    for unit in units:
        if reduce_scatter_only:
            unit.set_requires_all_reduce(False, recurse=False)
        else:
            unit.set_requires_gradient_sync(False, recurse=False)
    try:
        yield
    finally:
        for unit in units:
            # Restores both switches: `set_requires_gradient_sync(True)` turns the all-reduce back on as well.
            unit.set_requires_gradient_sync(True, recurse=False)


def sync_replicas(module: nn.Module, mesh: DeviceMesh, device: torch.device) -> None:
    """Make every replica start from the same parameters, as DDP does: each shard is broadcast along the replicate
    axis from the replica at coordinate 0. Without it, ranks that built the model with different seeds would train
    replicas that never agree."""
    if mesh.ndim != 2 or mesh.size(0) == 1:
        return
    group = mesh.get_group(0)
    source = dist.get_global_rank(group, 0)
    with torch.no_grad():
        for param in module.parameters():
            local = param.to_local() if isinstance(param, DTensor) else param
            # NCCL can only send device memory; CPU-offloaded shards take a round trip.
            staged = local if local.device.type == device.type else local.to(device)
            dist.broadcast(staged, src=source, group=group)
            if staged is not local:
                local.copy_(staged)


def has_meta_tensors(module: nn.Module) -> bool:
    return any(t.is_meta for t in _tensors(module))


def _tensors(module: nn.Module) -> Iterator[torch.Tensor]:
    yield from module.parameters()
    yield from module.buffers()


def _fsdp_units(module: nn.Module) -> list[FSDPModule]:
    return [m for m in module.modules() if isinstance(m, FSDPModule)]


def _refuse_fsdp1(module: nn.Module) -> None:
    from torch.distributed.fsdp import FullyShardedDataParallel

    if any(isinstance(m, FullyShardedDataParallel) for m in module.modules()):
        raise TypeError(
            "The model contains FSDP1 `FullyShardedDataParallel` wrappers, which cannot be mixed with FSDP2."
            " HINT: pass the plain, unwrapped model and let the strategy shard it, e.g."
            " `fabric.setup(model)` with `FSDPStrategy(auto_wrap_policy={Block})`."
        )


def _select_units(module: nn.Module, policy: Policy) -> list[nn.Module]:
    units = policy.select(module)
    if not units:
        candidates = candidate_block_classes(module)
        hint = ", ".join(candidates) if candidates else "(the model has no submodules with parameters)"
        warnings.warn(
            f"`{policy.argument}` selected no module, so the whole model is one FSDP unit and every rank gathers"
            f" all parameters at once. Candidate block classes: {hint}. HINT: pass one, e.g."
            f" `{policy.argument}={{YourBlock}}`.",
            UserWarning,
            stacklevel=4,
        )
        return []
    return units


def _through_checkpoint_wrappers(module: nn.Module, blocks: list[nn.Module]) -> list[nn.Module]:
    """A block wrapped for activation checkpointing becomes a unit through its wrapper, so that the recomputed
    forward runs inside the unit whose parameters it gathers."""
    wrappers = {id(m._checkpoint_wrapped_module): m for m in module.modules() if isinstance(m, CheckpointWrapper)}
    return [wrappers.get(id(b), b) for b in blocks]


def _apply_activation_checkpointing(module: nn.Module, policy: Policy) -> None:
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
    chosen_ids = {id(m) for m in chosen}
    # Replace children in place, parents first; a chosen module nested inside another chosen one is left alone,
    # since the outer recomputation already covers it.
    _wrap_children(module, chosen_ids)


def _wrap_children(parent: nn.Module, chosen_ids: set[int]) -> None:
    for name, child in list(parent.named_children()):
        if id(child) in chosen_ids:
            # Non-reentrant checkpointing composes with FSDP2's hooks and keeps state-dict keys clean.
            setattr(parent, name, checkpoint_wrapper(child, checkpoint_impl=CheckpointImpl.NO_REENTRANT))
        else:
            _wrap_children(child, chosen_ids)


def _offload_policy_for(config: FSDPConfig, device: torch.device):
    policy = config.offload_policy
    if isinstance(policy, CPUOffloadPolicy) and policy.pin_memory and device.type == "cpu":
        # Pinning needs an accelerator; on a CPU run the "offloaded" shards already live in host memory.
        return CPUOffloadPolicy(pin_memory=False)
    return policy


def _materialize(module: nn.Module, mesh: DeviceMesh, device: torch.device, params_on_cpu: bool) -> None:
    """Allocate the (already sharded) meta tensors and run each module's ``reset_parameters``.

    Sharding happened first, so ``to_empty`` allocates local shards only: no rank ever holds the full model.
    """
    with _per_shard_random_init(mesh, device):
        _allocate_and_reset(module, device, params_on_cpu)


@contextmanager
def _per_shard_random_init(mesh: DeviceMesh, device: torch.device) -> Iterator[None]:
    """Give each shard its own random stream while parameters are initialized on a CPU mesh.

    On CUDA, DTensor's random ops keep one seed across ranks and offset it per shard. On a CPU mesh they fall back to
    the plain generator, so every rank would fill its shard with the same numbers (rank 1's rows repeating rank 0's).
    Seeding by the coordinate along the shard axis keeps replicas (hybrid sharding, NO_SHARD) identical while shards
    differ. The global generator is restored afterwards, minus the one draw that picks the base seed.
    """
    if device.type != "cpu":
        yield
        return
    base = torch.randint(0, 2**31, (1,))
    if dist.is_initialized():
        dist.broadcast(base, src=0)  # ranks seeded differently must still agree on their replicas
    base = int(base.item())
    shard_coordinate = mesh.get_local_rank(mesh.ndim - 1)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(base + shard_coordinate)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*DTensor random operators may not have complete support.*")
            yield


def _allocate_and_reset(module: nn.Module, device: torch.device, params_on_cpu: bool) -> None:
    module.to_empty(device="cpu" if params_on_cpu else device)
    if params_on_cpu and device.type != "cpu":
        # Offloaded parameters stay on the host, but buffers take part in compute and belong on the device.
        for sub in module.modules():
            for name, buf in sub._buffers.items():
                if buf is not None:
                    sub._buffers[name] = buf.to(device)
    uninitialized: list[str] = []
    # Parents first, like construction order. Each module resets only when it owns tensors directly; a parent whose
    # reset also touches its children's tensors is overridden by the children's own resets that follow.
    for sub in module.modules():
        if not any(True for _ in _direct_tensors(sub)):
            continue
        # torch's own nn.MultiheadAttention names its initializer `_reset_parameters`.
        reset = getattr(sub, "reset_parameters", None) or getattr(sub, "_reset_parameters", None)
        if callable(reset):
            with torch.no_grad():
                reset()
        elif type(sub).__name__ not in uninitialized:
            uninitialized.append(type(sub).__name__)
    if uninitialized:
        warnings.warn(
            "These modules were created on the meta device and own parameters or buffers but define no"
            f" `reset_parameters()`, so their values are uninitialized memory: {', '.join(uninitialized)}."
            " HINT: add a `reset_parameters()` method to each, or create the model without `empty_init=True`.",
            UserWarning,
            stacklevel=4,
        )


def _direct_tensors(module: nn.Module) -> Sequence[torch.Tensor]:
    return [t for t in list(module._parameters.values()) + list(module._buffers.values()) if t is not None]
