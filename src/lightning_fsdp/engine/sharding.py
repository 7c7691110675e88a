"""Every ``fully_shard`` decision: activation checkpointing, unit selection, meta-device materialization and the
remapping of optimizers onto the sharded parameters.

The order matters and is fixed in :func:`shard_model`:

1. tensor parallelism splits the planned modules over the ``"tp"`` axis, when the mesh has one (see
   :mod:`~lightning_fsdp.engine.tensor_parallel`), while module names are still the plan's;
2. activation checkpointing wraps the chosen blocks (so recomputation happens inside one FSDP unit; see
   :mod:`~lightning_fsdp.engine.activation_checkpointing`);
3. ``fully_shard`` runs bottom-up on the policy's units, then on the root, each with its ``reshard_after_forward``
   (see :mod:`~lightning_fsdp.engine.resharding`), over the data-parallel axes; prefetching between the units is
   registered (see :mod:`~lightning_fsdp.engine.prefetch`);
4. meta-device parameters are materialized, now as local shards only, and initialized (see
   :mod:`~lightning_fsdp.engine.meta_init`);
5. optimizers are pointed at the final parameter objects.
"""

from __future__ import annotations

import logging
import warnings
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.optim import Optimizer

from lightning_fsdp.engine.activation_checkpointing import apply_activation_checkpointing, through_checkpoint_wrappers
from lightning_fsdp.engine.at_rest import reshard_all
from lightning_fsdp.engine.config import FSDPConfig
from lightning_fsdp.engine.meta_init import has_meta_tensors, materialize
from lightning_fsdp.engine.policy import Policy, candidate_block_classes, describe_units
from lightning_fsdp.engine.prefetch import apply_prefetch
from lightning_fsdp.engine.mesh import data_parallel_mesh, tensor_parallel_mesh
from lightning_fsdp.engine.resharding import ReshardChoice, ReshardPlan, check_divides
from lightning_fsdp.engine.tensor_parallel import apply_tensor_parallel, resolve_plan, same_across_tensor_parallel

__all__ = [
    "ShardedModel",
    "shard_model",
    "ParameterOwners",
    "remap_optimizer",
    "no_backward_sync",
    "broadcast_module_state",
    "harness_roots",
    "has_meta_tensors",
]

log = logging.getLogger(__name__)


@dataclass
class ShardedModel:
    module: nn.Module
    summary: str  # e.g. "12 x Block + root"
    roots: list[nn.Module]  # the root units: `module` itself, or a harness's top-level submodules


class ParameterOwners:
    """Remembers, for each parameter of a model, which module holds it and under which name.

    ``fully_shard`` and ``to_empty`` replace parameter objects, but they leave the owning module and attribute name
    alone. Looking a parameter up again through its owner finds its replacement, however many times it was
    replaced, and whatever wrappers were inserted above the owner.

    The original parameters are held only weakly. They are the whole, unsharded tensors (on the GPU, once
    ``fully_shard`` has moved them there), so a strong reference here would keep a full copy of the model alive on
    every rank for as long as the strategy lives. An optimizer built before setup still holds them until it is
    remapped, which is all the lookup by identity needs; each entry checks its weak reference, so an id that Python
    reuses for a new object after the original died is never mistaken for it.
    """

    def __init__(self, module: nn.Module) -> None:
        self._owners: dict[int, tuple[nn.Module, str, weakref.ref]] = {}
        for owner in module.modules():
            for name, param in owner._parameters.items():
                if param is not None and id(param) not in self._owners:
                    self._owners[id(param)] = (owner, name, weakref.ref(param))

    def locate(self, param: torch.Tensor) -> Optional[tuple[nn.Module, str]]:
        """The (module, attribute name) slot that holds ``param`` now or held it at construction; ``None`` if the
        model never owned it. The slot outlives every replacement of the parameter object: the sharded DTensor, and
        the plain tensor FSDP registers there while a unit is unsharded."""
        entry = self._owners.get(id(param))
        if entry is not None and entry[2]() is param:
            return entry[0], entry[1]
        return next(((owner, name) for owner, name, _ in self._owners.values()
                     if param is owner._parameters.get(name)), None)


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
    forward, so ``module`` cannot be the root unit there: its top-level submodules that hold parameters become root
    units of their own instead (see :func:`harness_roots`).
    """
    _refuse_fsdp1(module)
    if config.sync_module_states and not has_meta_tensors(module):
        # Before sharding, while every rank still holds the whole model: afterwards rank 0 has only its own shard.
        broadcast_module_state(module, device)
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
    tp_mesh = tensor_parallel_mesh(mesh)
    if tp_mesh is not None:
        # Before the checkpoint wrappers, which change the module names the plan speaks of, and before
        # `fully_shard`, which shards the tensor-parallel DTensors over the data-parallel axes.
        names = {id(m): n for n, m in module.named_modules()}
        models = tuple(names[id(r)] for r in harness_roots(module, extra_units=blocks)) if harness else ()
        apply_tensor_parallel(module, resolve_plan(module, config.tensor_parallel, models), tp_mesh)
    full_mesh, mesh = mesh, data_parallel_mesh(mesh)
    if config.activation_checkpointing_policy is not None:
        apply_activation_checkpointing(module, config.activation_checkpointing_policy)

    kwargs = {
        "mesh": mesh,
        "mp_policy": mp_policy or MixedPrecisionPolicy(),
        "offload_policy": _offload_policy_for(config, device),
    }
    # Named now: `fully_shard` swaps each unit's class for an `FSDP<Name>` subclass.
    summary = describe_units([m for m in blocks or existing_units if m is not module])
    units = through_checkpoint_wrappers(module, blocks)
    roots = harness_roots(module, extra_units=units) if harness else [module]
    if harness:
        summary += f" ({', '.join(type(r).__name__ for r in roots)})"
    unit_ids = {id(u) for u in units}
    # A root that is itself a policy unit (a block called straight from `training_step`) is sharded once, as a unit.
    new_roots = [r for r in roots if not isinstance(r, FSDPModule) and id(r) not in unit_ids]
    root_units = [r for r in roots if id(r) in unit_ids]
    reshard = _reshard_choices(module, config, mesh, units, [*new_roots, *root_units])
    _refuse_ties_across_units(module, units)
    if harness:
        _refuse_roots_sharing_parameters(module, roots)
    # Bottom-up: a unit takes the parameters no descendant unit took, so children must go first.
    for unit in [*reversed(units), *new_roots]:
        fully_shard(unit, reshard_after_forward=reshard[id(unit)], **kwargs)
    apply_prefetch(roots, config.forward_prefetch, config.backward_prefetch)

    if has_meta_tensors(module):
        # Parameters: the per-shard seeding in `materialize` gives shards their own values and keeps replicas
        # identical. Buffers are not sharded, and `reset_parameters()` may fill them from each rank's generator.
        materialize(module, full_mesh, device, params_on_cpu=config.cpu_offload, param_init_fn=config.param_init_fn)
        if tp_mesh is not None:
            same_across_tensor_parallel(module, tp_mesh, device)
        if config.sync_module_states:
            broadcast_module_state(module, device, buffers_only=True)
    return ShardedModel(module=module, summary=summary, roots=roots)


def harness_roots(module: nn.Module, extra_units: Sequence[nn.Module] = ()) -> list[nn.Module]:
    """The modules of a harness that become FSDP root units: each top-level submodule of ``module`` that holds any
    parameter, looking through containers that have no forward of their own (``ModuleList``, ``ModuleDict``).

    Why every one, even a submodule whose parameters all sit in units (``nn.Sequential`` of policy ``Linear`` s): FSDP
    makes a root of the first unit whose forward runs without a root around it, and a root keeps its parameters
    gathered after forward. Without a root above them, each unit would be its own root, and FULL_SHARD would free
    nothing in forward (the weights are right all the same, so only memory shows it). A root above them makes them
    ordinary units that reshard after their forward. Several roots (a generator and a discriminator) each run FSDP's
    usual forward/backward cycle, which is what lets a step run several forwards, backwards and optimizer steps in any
    order.

    A top-level submodule that is itself a unit (a block called straight from ``training_step``) is its own root; the
    caller gives it the ``reshard_after_forward`` of a unit (see :func:`_reshard_choices`), since no forward of the
    harness holds it. ``extra_units`` are modules about to become units, so the roots can be known before
    ``fully_shard`` runs.
    """
    managed = {id(p) for unit in [*_fsdp_units(module), *extra_units] for p in unit.parameters()}
    units = {id(u) for u in [*_fsdp_units(module), *extra_units]}
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
            if next(child.parameters(), None) is None:
                continue
            if id(child) not in units and type(child).forward is nn.Module.forward:
                visit(child, f"{prefix}{name}.")  # a container: its children are what gets called
            else:
                roots.append(child)

    visit(module, "")
    return roots


def _refuse_roots_sharing_parameters(module: nn.Module, roots: list[nn.Module]) -> None:
    """Two root units of a harness may not share a parameter: a module both hold (``encoder.embed is
    decoder.embed``) or one tied tensor (``decoder.head.weight is encoder.embed.weight``). Each root would claim it,
    and torch fails at setup or at the first forward in its own words ("Cannot concatenate overlapping meshes", "FSDP
    state has already been lazily initialized"). One root over both needs one forward that calls both, which a
    harness does not have (``training_step`` is not a forward): refused, naming the shared module and the fix."""
    names = {id(m): n for n, m in module.named_modules()}
    held: dict[int, tuple[nn.Module, str]] = {}  # parameter id -> (first root, its name there)
    for root in roots:
        for name, param in root.named_parameters(remove_duplicate=False):
            first, first_name = held.setdefault(id(param), (root, name))
            if first is root:
                continue
            here = f"{names[id(root)]}.{name}"
            there = f"{names[id(first)]}.{first_name}"
            owner, other = here.rsplit(".", 1)[0], there.rsplit(".", 1)[0]
            whole = module.get_submodule(owner) is module.get_submodule(other) and here.rsplit(".", 1)[1] == \
                there.rsplit(".", 1)[1]
            what = f"the module `{other}` is `{owner}`" if whole else f"the parameter `{there}` is `{here}`"
            raise ValueError(
                f"The top-level models `{names[id(first)]}` and `{names[id(root)]}` share parameters ({what}). Each"
                " top-level model of a LightningModule becomes an FSDP root unit, and two roots cannot hold one"
                " parameter. HINT: hold both in one module whose forward calls them, and call that from"
                f" `training_step`, e.g. `self.model = EncoderDecoder(self.{names[id(first)]}, self.{names[id(root)]})`"
                f" with `def forward(self, x): return self.{names[id(root)]}(self.{names[id(first)]}(x))`; it becomes"
                " the one root over both, as a model set up with Fabric is."
            )


def _refuse_ties_across_units(module: nn.Module, units: list[nn.Module]) -> None:
    """A parameter held by modules in two different policy units (or in one unit and outside it) would be taken by
    the first unit sharded, and the other holder would keep the old tensor: the tie silently gone. Refused, naming
    both places and the fix."""
    unit_ids = {id(u) for u in units}
    seen: dict[int, tuple[Optional[int], str]] = {}

    def visit(parent: nn.Module, prefix: str, unit: Optional[int]) -> None:
        unit = id(parent) if id(parent) in unit_ids else unit
        for name, param in parent._parameters.items():
            if param is None:
                continue
            first_unit, first_name = seen.setdefault(id(param), (unit, f"{prefix}{name}"))
            if first_unit != unit:
                raise ValueError(
                    f"`{first_name}` and `{prefix}{name}` are one parameter, and `auto_wrap_policy` puts them in"
                    " different FSDP units (or one in a unit and one outside), which cannot share it. HINT: choose"
                    " units that hold every use of a tied parameter, or none: e.g. keep the class of"
                    f" `{prefix.rstrip('.') or first_name.rsplit('.', 1)[0]}` out of `auto_wrap_policy`."
                )
        for name, child in parent._modules.items():
            if child is not None:
                visit(child, f"{prefix}{name}.", unit)

    visit(module, "", None)


def remap_optimizer(optimizer: Optimizer, owners: list[ParameterOwners], models: Sequence[nn.Module]) -> None:
    """Point every param group of ``optimizer`` at the sharded parameters that stand where its own stood.

    Each parameter is located by its slot (owner module and name) first, then every model is resharded, then the
    slot is read again: so an optimizer built while a unit was unsharded (after an evaluation forward) gets the
    DTensor shards too, never the gathered tensors FSDP swaps out at the next backward. Groups and their
    hyperparameters stay as they are. The lists are updated in place, because some optimizers (LBFGS) keep a
    reference to them.
    """
    if optimizer.state:
        raise ValueError(
            f"The optimizer {type(optimizer).__name__} already has state for {len(optimizer.state)} parameter(s), so it"
            " cannot be moved onto the sharded parameters. HINT: set the model and optimizer up through the strategy"
            " before the first `optimizer.step()` (Fabric: `model, optimizer = fabric.setup(model, optimizer)`)."
        )
    slots = [[_locate(owners, p) for p in group["params"]] for group in optimizer.param_groups]
    for group, group_slots in zip(optimizer.param_groups, slots):
        foreign = [p for p, slot in zip(group["params"], group_slots) if slot is None]
        if foreign:
            raise ValueError(
                f"The optimizer {type(optimizer).__name__} holds {len(foreign)} parameter(s) (shapes"
                f" {[tuple(p.shape) for p in foreign[:3]]}{', ...' if len(foreign) > 3 else ''}) that belong to no"
                " model set up by the strategy, so they would be neither sharded nor synchronized across ranks."
                " HINT: build the optimizer from the model it trains, e.g. `torch.optim.AdamW(model.parameters())`,"
                " and set that model up through the strategy too."
            )
    for model in models:
        reshard_all(model)
    for group, group_slots in zip(optimizer.param_groups, slots):
        group["params"][:] = [owner._parameters[name] for owner, name in group_slots]


def _locate(owners: list[ParameterOwners], param: torch.Tensor) -> Optional[tuple[nn.Module, str]]:
    return next((slot for table in owners if (slot := table.locate(param)) is not None), None)


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


def broadcast_module_state(module: nn.Module, device: torch.device, *, buffers_only: bool = False) -> None:
    """Give every rank rank 0's parameters and buffers, as DDP and Lightning's FSDP (``sync_module_states``) do.

    Without it, ranks that built the model with different seeds (``seed_everything(rank)``, or no seed) would each
    keep their own rows of the weights after sharding, and their own buffers, and so train different functions.
    Tensors are sent in buckets of one dtype, so a model of many small tensors costs few collectives.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    tensors = list(module.buffers()) if buffers_only else [*module.parameters(), *module.buffers()]
    # Parameters of units the user sharded already are DTensor shards: rank 0 holds only its own, so they are not
    # its to send (and cannot be concatenated with plain tensors).
    tensors = [t for t in tensors if not isinstance(t, DTensor)]
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for tensor in tensors:
        by_dtype.setdefault(tensor.dtype, []).append(tensor)
    # NCCL sends device memory only; a model still on the host takes a round trip through the device.
    comm_device = device if dist.get_backend() == "nccl" else torch.device("cpu")
    with torch.no_grad():
        for group in by_dtype.values():
            for bucket in _buckets(group, _BROADCAST_BUCKET_BYTES):
                flat = torch.cat([t.detach().reshape(-1).to(comm_device) for t in bucket])
                dist.broadcast(flat, src=0)
                offset = 0
                for tensor in bucket:
                    tensor.copy_(flat[offset : offset + tensor.numel()].view_as(tensor))
                    offset += tensor.numel()


_BROADCAST_BUCKET_BYTES = 64 * 2**20


def _buckets(tensors: list[torch.Tensor], limit: int) -> Iterator[list[torch.Tensor]]:
    bucket: list[torch.Tensor] = []
    size = 0
    for tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > limit:
            yield bucket
            bucket, size = [], 0
        bucket.append(tensor)
        size += nbytes
    if bucket:
        yield bucket


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


def _offload_policy_for(config: FSDPConfig, device: torch.device):
    policy = config.offload_policy
    if isinstance(policy, CPUOffloadPolicy) and policy.pin_memory and device.type == "cpu":
        # Pinning needs an accelerator; on a CPU run the "offloaded" shards already live in host memory.
        return CPUOffloadPolicy(pin_memory=False)
    return policy


def _reshard_choices(
    module: nn.Module, config: FSDPConfig, mesh: DeviceMesh, units: list[nn.Module], roots: list[nn.Module]
) -> dict[int, ReshardChoice]:
    """``reshard_after_forward`` for each module about to become a unit (by ``id``), checked against the mesh."""
    default = config.reshard_after_forward
    if default is None or isinstance(default, ReshardPlan):
        # None lets FSDP2 decide per unit: reshard all but the root, whose parameters backward needs first.
        default_choice: ReshardChoice = config.sharding_strategy.default_reshard_after_forward
    else:
        default_choice = default
    names = {id(m): n for n, m in module.named_modules()}
    targets = {names.get(id(m), type(m).__name__): m for m in [*units, *roots]}
    if isinstance(default, ReshardPlan):
        choices = default.choose(targets, roots, default_choice, module_names=names.values())
    else:
        choices = {id(m): default_choice for m in targets.values()}
    for unit in units:
        # `None` lets FSDP2 keep a root's parameters after forward. A unit that is a root only because the harness
        # calls it directly must reshard as the unit it is, or FULL_SHARD would keep it gathered through forward.
        if choices[id(unit)] is None and any(unit is r for r in roots):
            choices[id(unit)] = True
    shard_size = mesh.size(mesh.ndim - 1)  # the shard axis is the last one of every data-parallel mesh
    shown = default.shown if isinstance(default, ReshardPlan) else default
    for name, unit in targets.items():
        check_divides(choices[id(unit)], shard_size, shown, where=f"unit {name or '(root)'!r}")
    return choices
