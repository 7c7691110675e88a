"""What both fronts do to join a replica group when ``fault_tolerance`` is on (docs/guides/fault-tolerance.md).

:func:`start_replica_group` is called once the model is sharded, on every rank of the group. It builds the group's
:class:`~lightning_fsdp.engine.fault_tolerance.group.ReplicaGroup` (the torchft Manager and the cross-group process
group), puts the cross-group average on the model's FSDP units, names the state a healing group receives (model
shards, optimizer state, the random generators, and the front's own ``extra`` state), and opens each optimizer step's
window at the root's first forward of it.

Why the window opens at the first forward, and waits there for the quorum: a live group sends its state to a healing
one from torchft's quorum thread, reading the parameters' local shards. FSDP swaps a unit's registered parameters for
the unsharded ones during its forward and backward, so the send must finish before the forward starts. Waiting costs
the overlap of the quorum's round trip with the forward (a few milliseconds on a LAN); a heal transfer that raced a
forward would send the wrong tensors.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Protocol, Sequence

import torch
from torch.nn import Module
from torch.optim import Optimizer

from lightning_fsdp._base.errors import bad_argument
from lightning_fsdp.engine.fault_tolerance import heal
from lightning_fsdp.engine.fault_tolerance.config import FaultTolerance
from lightning_fsdp.engine.fault_tolerance.group import ReplicaGroup, fsdp_roots
from lightning_fsdp.engine.fault_tolerance.transport import HealTransport

__all__ = [
    "ExtraState",
    "drop_gradients",
    "refuse_second_setup",
    "refuse_unsupported_layout",
    "refuse_unsupported_precision",
    "start_replica_group",
]

HEAL_KEY = "lightning_fsdp"


class ExtraState(Protocol):
    """State of a front that a healing group also receives (the Trainer's loop position, say): ``produce()`` gives a
    tree of plain values and tensors on the sender, ``check(tree)`` refuses one that does not fit before the heal
    applies anything, ``load(tree)`` applies it on the healer."""

    def produce(self) -> Any: ...

    def check(self, tree: Any) -> None: ...

    def load(self, tree: Any) -> None: ...


def start_replica_group(config: FaultTolerance, module: Module, optimizers: Sequence[Optimizer], *,
                        device: torch.device, schedulers: Sequence[Any] = (),
                        extra: Optional[ExtraState] = None) -> ReplicaGroup:
    """Join this rank's group to the others; collective over the group (every rank calls it, after sharding)."""
    optimizers, schedulers = list(optimizers), list(schedulers)
    layout = heal.layout_of(module, optimizers, schedulers)
    limit, count = heal_bytes_limit(module), heal_tensors_limit(module)
    group = ReplicaGroup(config, transport=lambda pg: HealTransport(
        pg, layout=layout, device=device, max_bytes=limit, max_tensors=count, user_keys=(HEAL_KEY,)), device=device)
    try:
        group.install(module)

        def produce() -> Any:
            return heal.produce(module, optimizers, schedulers, strategy=heal.rng_state(),
                                loop=extra.produce() if extra is not None else None)

        def load(payload: Any) -> None:
            heal.check_rng_state(payload["strategy"] if isinstance(payload, dict) else None)  # before any change
            if extra is not None and isinstance(payload, dict):
                extra.check(payload.get("loop"))
            rest = heal.load(payload, module, optimizers, schedulers)
            heal.restore_rng_state(rest["strategy"])
            if extra is not None:
                extra.load(rest["loop"])

        group.register_state(HEAL_KEY, load, produce)
        # Before FSDP's own pre-forward hook (which unshards the root's parameters), hence `prepend`; on the root,
        # which the Trainer's LightningModule is not.
        (_, root), = fsdp_roots(module)
        root.register_forward_pre_hook(_window_opener(group), prepend=True)
    except BaseException:
        group.close()
        raise
    return group


# A heal payload holds this rank's parameter and buffer shards, the optimizer's state for them (two moments for Adam,
# a few more for others: a factor of 8 leaves room), the random states and small values; a header claiming more is
# refused before anything is allocated. The payload's exact tensors are not known before the first step (an optimizer
# has no state yet), hence a bound rather than the list.
HEAL_FACTOR = 8
HEAL_SLACK = 64 << 20
# Each tensor costs the receiver memory and time even when empty (a header of 2M empty tensors took 1.5 GiB and 23 s):
# their count is bounded alike, HEAL_FACTOR per parameter or buffer (its shard, the optimizer's state for it), and
# HEAL_TENSOR_SLACK for the random states (torch, NumPy, one per CUDA device) and the loop's own.
HEAL_TENSOR_SLACK = 1024


def heal_bytes_limit(module: Module) -> int:
    """The most tensor bytes this rank accepts in one heal payload."""
    local = sum(heal.local_bytes(t) for t in [*module.parameters(), *module.buffers()])
    return HEAL_FACTOR * local + HEAL_SLACK


def heal_tensors_limit(module: Module) -> int:
    """The most tensors this rank accepts in one heal payload."""
    return HEAL_FACTOR * (len(list(module.parameters())) + len(list(module.buffers()))) + HEAL_TENSOR_SLACK


def _window_opener(group: ReplicaGroup) -> Callable[..., None]:
    def open_window(module: Module, args: Any) -> None:
        # Only a training forward starts a step: an evaluation forward (no grad, or eval mode) takes no part in one.
        if module.training and torch.is_grad_enabled():
            group.begin_window()
            group.participating_rank()  # waits for the quorum, and so for any heal transfer of this window

    return open_window


def refuse_unsupported_precision(config: FaultTolerance, precision: Any) -> None:
    """fp16 mixed precision scales the loss with a GradScaler whose skipped steps no vote knows of: refused."""
    name = str(getattr(precision, "precision", precision))
    if name in ("16-mixed", "16"):
        raise ValueError(bad_argument(
            "fault_tolerance", config, "precision 'bf16-mixed', 'bf16-true' or '32-true' under fault tolerance",
            "Use precision='bf16-mixed' (no loss scaling), or turn fault_tolerance off.",
            problem=f"precision={name!r} scales the loss with a GradScaler, whose skipped steps the groups' vote"
                    " cannot see",
        ))


def refuse_unsupported_layout(config: FaultTolerance, sharding_strategy: Any, world_size: int,
                              tensor_parallel_size: int = 1) -> None:
    """Each group must shard over a 1-D mesh of its own ranks: the cross-group average hooks FSDP's reduce-scatter
    on that mesh. NO_SHARD on several ranks replicates inside the group instead (a 2-D ``(world, 1)`` mesh, like
    hybrid sharding, which the argument's parse refuses). Tensor parallelism inside a group is allowed
    (``tensor_parallel_size`` is kept for the fronts' calls): with a ``(shard, tp)`` mesh FSDP still reduce-scatters
    over the 1-D shard axis, so the hook gets each rank's tp-local shard, and rank r of every group holds the same
    slice (same mesh, same plan), so the average and the heal pair rank r with rank r (tests/test_ft_tp.py)."""
    name = getattr(sharding_strategy, "value", sharding_strategy)
    if name == "NO_SHARD" and world_size > 1:
        raise ValueError(bad_argument(
            "fault_tolerance", config, "sharding_strategy 'FULL_SHARD' or 'SHARD_GRAD_OP' when a group has several"
            " ranks", "Use sharding_strategy='FULL_SHARD' (or 'SHARD_GRAD_OP', which keeps parameters unsharded"
            " between forward and backward), or turn fault_tolerance off.",
            problem=f"sharding_strategy='NO_SHARD' replicates over this group's {world_size} ranks, and the replica"
                    " groups are already the replicate axis",
        ))


def refuse_second_setup(config: FaultTolerance, existing: Optional[ReplicaGroup], optimizers: Sequence[Any]) -> None:
    """One model and its optimizer, set up together: the group's heal layout and cross-group hook are fixed then."""
    if existing is not None:
        raise ValueError(bad_argument(
            "fault_tolerance", config, "one model with its optimizer, set up once: `fabric.setup(model, optimizer)`",
            "Put every trained module in one model (one FSDP root) and set it up once, with its optimizer.",
            problem="A second model or a later optimizer cannot join the replica group's heal and average",
        ))
    if len(optimizers) != 1:
        raise ValueError(bad_argument(
            "fault_tolerance", config, "exactly one optimizer, passed with the model: `fabric.setup(model, optimizer)`",
            "Set the model up with its optimizer in one call (several parameter groups in one optimizer are fine).",
            problem=f"{len(optimizers)} optimizers were set up with the model",
        ))


def drop_gradients(optimizer: Any) -> None:
    """Forget the gradients of a step that did not commit: they belong to a window that is being thrown away."""
    optimizer = getattr(optimizer, "optimizer", optimizer)  # Lightning's wrapper, or the optimizer itself
    for group in optimizer.param_groups:
        for param in group["params"]:
            param.grad = None
