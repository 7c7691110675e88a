"""The order in which one training step does its work, as each front's loop runs it, so that the planned step holds
the tensors a real step holds at each moment.

Three loops, three orders (gradients are what differs):

- **Fabric** (any ``nn.Module``): the user's loop, written as the docs write it: ``forward``, ``backward``,
  ``optimizer.step()``, ``optimizer.zero_grad()``. Gradients are freed at the end of the step, so the next forward
  runs without them.
- **Trainer, automatic optimization**: Lightning's closure (``lightning/pytorch/loops/optimization/automatic.py``)
  runs ``training_step`` first, then ``zero_grad`` (on the first batch of an accumulation window only), then
  ``backward``; the optimizer steps after the window's last backward and nothing frees the gradients then. So every
  ``training_step`` runs with the previous step's gradients alive, and with ``accumulate_grad_batches > 1`` the
  batches before the last keep FSDP's unsharded accumulated gradients from one backward to the next (the Trainer
  blocks gradient sync for them: ``block_backward_sync``).
- **Trainer, manual optimization**: ``training_step`` does it all (``self.optimizers()``, ``self.manual_backward``,
  ``opt.step()``, ``opt.zero_grad()`` where the user put them). The planner runs it with a stand-in for the Trainer
  that follows those calls, after one untracked step, so that whatever the user's order keeps alive from one step to
  the next is alive when the tracked step starts.

Steady state throughout: the optimizer already holds its state from earlier steps.
"""

from __future__ import annotations

import re
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol

import torch
from torch import nn

from lightning_fsdp.engine.config import FSDPConfig
from lightning_fsdp.engine.sharding import no_backward_sync

__all__ = ["Moments", "StepOrder", "step_order", "TrainerStandIn", "attach_stand_in", "cannot_follow"]

# What `self.trainer` raises in a planned LightningModule: Lightning's own message, without a Trainer or with the
# stand-in of manual optimization.
UNFOLLOWED_TRAINER = ("is not attached to a `Trainer`", "tried to access `self.trainer.")


class Moments(Protocol):
    """What the tracked step reports to its tracker, and when."""

    def before_step(self) -> None: ...  # right before the optimizer steps
    def after_step(self) -> None: ...  # right after it, before anything frees the gradients
    def between(self) -> None: ...  # after each batch of an accumulation window but the last


@dataclass
class StepOrder:
    """One planned step: ``prepare`` runs untracked and leaves what earlier steps leave (optimizer state, and the
    gradients where the loop keeps them); ``run(moments)`` is the step. For manual optimization, whose optimizer
    steps are the user's, ``before_step`` and ``after_step`` both come at the end of ``training_step``."""

    name: str  # "fabric", "trainer" or "trainer (manual optimization)"
    prepare: Callable[[], None]
    run: Callable[[Moments], None]


def step_order(
    module: nn.Module, lightning: bool, optimizer: torch.optim.Optimizer, forward: Callable[[int], Any],
    backward: Callable[[Any], None], config: FSDPConfig, accumulate_grad_batches: int,
) -> StepOrder:
    """The step of ``module``'s loop: ``forward(batch_idx)`` runs the forward (or ``training_step``) and returns its
    output, ``backward(output)`` backpropagates it."""
    reduce_scatter_only = config.hybrid_no_sync == "reduce_scatter_only" and config.sharding_strategy.is_hybrid

    def sync(index: int):
        # The batches before a window's last skip gradient communication, as `no_backward_sync` (Fabric) and the
        # Trainer's `block_backward_sync` do.
        last = index == accumulate_grad_batches - 1
        return nullcontext() if last else no_backward_sync(module, reduce_scatter_only)

    if lightning and not getattr(module, "automatic_optimization", True):
        def manual(moments: Moments) -> None:
            forward(0)
            moments.before_step()
            moments.after_step()

        def warm_up() -> None:
            _create_optimizer_state(optimizer, keep_gradients=False)
            forward(0)  # one whole step of the user's own order: what it keeps alive is alive when tracking starts

        return StepOrder("trainer (manual optimization)", warm_up, manual)

    def automatic(moments: Moments) -> None:
        for index in range(accumulate_grad_batches):
            output = forward(index)
            if index == 0:
                optimizer.zero_grad(set_to_none=True)  # Lightning's `optimizer_zero_grad` hook, inside the closure
            with sync(index):
                backward(output)
            if index < accumulate_grad_batches - 1:
                moments.between()
        moments.before_step()
        optimizer.step()  # the gradients stay until the next window's first `training_step` has run
        moments.after_step()

    def fabric(moments: Moments) -> None:
        for index in range(accumulate_grad_batches):
            with sync(index):
                backward(forward(index))
            if index < accumulate_grad_batches - 1:
                moments.between()
        moments.before_step()
        optimizer.step()
        moments.after_step()
        optimizer.zero_grad(set_to_none=True)

    if lightning:
        return StepOrder("trainer", lambda: _create_optimizer_state(optimizer, keep_gradients=True), automatic)
    return StepOrder("fabric", lambda: _create_optimizer_state(optimizer, keep_gradients=False), fabric)


def _create_optimizer_state(opt: torch.optim.Optimizer, *, keep_gradients: bool) -> None:
    """What earlier steps leave behind: one step on zero gradients creates the state (on fake tensors, for free), and
    the gradients stay where the loop keeps them."""
    params = [p for group in opt.param_groups for p in group["params"]]
    for p in params:
        p.grad = torch.zeros_like(p)
    opt.step()
    if not keep_gradients:
        opt.zero_grad(set_to_none=True)


def cannot_follow(phase: str, err: Exception, root: str, where: str) -> Optional[str]:
    """The message for a failure that comes from what the planner cannot follow of a Trainer's run, rather than from
    the batch or the model; ``None`` for any other failure. ``where`` is `` at FILE:LINE (`code`)`` of the user's line."""
    text = " ".join(str(err).split())
    if any(marker in text for marker in UNFOLLOWED_TRAINER):
        # Lightning names the attribute only with the manual-optimization stand-in; the user's line names it always.
        read = re.search(r"self\.trainer\.(\w+)", text) or re.search(r"self\.trainer\.(\w+)", where)
        reads = f"`self.trainer.{read.group(1)}`" if read else "`self.trainer`"
        if phase == "configure_optimizers":
            return (f"`configure_optimizers` reads {reads}{where}, and the planner calls it with no Trainer attached:"
                    " it needs only the optimizer, not what the Trainer knows (the number of steps a scheduler spans)."
                    " HINT: return the optimizer alone while no Trainer is attached, e.g."
                    " `if self._trainer is None: return optimizer` right after building it.")
        return (f"`{phase}` reads {reads}{where}, and the planner runs it with no Trainer attached: it follows"
                " `self.log`, and in manual optimization `self.optimizers()`, `self.manual_backward(loss)` and"
                " `self.clip_gradients(...)`, but no other Trainer state. HINT: read that state only when a Trainer"
                " is attached, e.g. under `if self._trainer is not None:`; the memory is that of the same step.")
    if isinstance(err, NotImplementedError) and "multiple iterative calls" in text:
        return (f"`{phase}` calls the FSDP root `{root}` more than once in one step{where}, and torch's"
                " FSDPMemTracker, which the planner runs, follows each root once per step. HINT: plan a module that"
                f" makes the calls in one forward, e.g. hold `{root}` in a module whose forward calls it twice, and"
                " call that module once from `training_step`.")
    return None


class TrainerStandIn:
    """What a LightningModule in manual optimization reaches through ``self.trainer`` while the planner runs its
    ``training_step``: Lightning routes these calls to ``self._fabric`` when one is set, so this stands in there.

    It follows ``self.optimizers()``, ``self.manual_backward(loss)``, ``self.clip_gradients(...)`` (which changes no
    memory worth planning), ``self.log``/``self.log_dict`` (dropped), ``toggle_optimizer`` and the rank and world
    attributes. Anything else of the Trainer raises an ``AttributeError`` naming it, which the planner reports.
    """

    def __init__(self, optimizers: list[torch.optim.Optimizer], world_size: int, rank: int) -> None:
        self.optimizers = optimizers
        self.world_size = world_size
        self.global_rank = rank
        self.local_rank = rank
        self.node_rank = 0
        self.is_global_zero = rank == 0

    def backward(self, tensor: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        kwargs.pop("model", None)
        tensor.backward(*args, **kwargs)

    def clip_gradients(self, *args: Any, **kwargs: Any) -> None:
        return None

    def log(self, *args: Any, **kwargs: Any) -> None:
        return None

    def log_dict(self, *args: Any, **kwargs: Any) -> None:
        return None


def attach_stand_in(module: nn.Module, optimizers: list[torch.optim.Optimizer], world_size: int,
                    rank: int) -> Optional[TrainerStandIn]:
    """Attach a :class:`TrainerStandIn` to a LightningModule in manual optimization; ``None`` (and nothing attached)
    for any other module. The caller keeps the returned object alive while the step runs (Lightning holds it
    weakly)."""
    if getattr(module, "automatic_optimization", True):
        return None
    stand_in = TrainerStandIn(optimizers, world_size, rank)
    module.fabric = stand_in
    module._fabric_optimizers = list(optimizers)
    return stand_in
