"""The Trainer's loop under fault tolerance: a step the replica groups did not commit is not counted.

Under ``fault_tolerance``, :class:`~lightning_fsdp.trainer.FSDPTrainerPrecision` runs the window's last closure
(forward and backward), then steps the optimizer only when the groups' vote commits. Lightning's loop does not know
of the vote: it counts an optimizer step (``trainer.global_step``) after the LightningModule's ``optimizer_step``
hook returns, and then steps the ``interval="step"`` LR schedulers. Two of its methods are wrapped, once, so that
after a vote that did not commit

- ``_AutomaticOptimization._optimizer_step`` puts the optimizer-step progress (ready and completed, total and
  current) back where it was before the hook, so ``global_step`` does not advance; when the group healed inside the
  window (a live group that fell a step behind, ``_fronts/trainer_heal.py``) it takes the sender's count; after a
  committed vote it checks the invariant that torchft counts as many committed steps as ``global_step``;
- ``_TrainingEpochLoop.update_lr_schedulers("step", ...)`` returns without stepping; ``interval="epoch"`` schedulers
  step at the epoch's end as usual.

Why wrap rather than, say, hide the schedulers from the loop: Lightning reads ``trainer.lr_scheduler_configs`` for
both stepping and ``dump_checkpoint``, so a checkpoint taken after a failed vote would lose them. Each wrapper does
nothing unless the trainer's strategy has a replica group (``strategy.replica_group``), so a Trainer without fault
tolerance, ours or another strategy, runs Lightning's code unchanged.

What still moves after a vote that did not commit: the batch progress (the window's batches were consumed; an absent
group's batches are skipped, not replayed) and ``_batches_that_stepped``, the step loggers are given, so logged
metrics of the thrown-away window keep their own x value.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from lightning_fsdp._base.compat import TRAINER_LR_SCHEDULERS_STEP, TRAINER_OPTIMIZER_STEP, trainer_step_sites
from lightning_fsdp._fronts.patching import wrap_once

__all__ = ["forget_closure_result", "register", "replica_group_of"]


def replica_group_of(trainer: Any) -> Optional[Any]:
    """The replica group of the trainer's strategy (:class:`~lightning_fsdp.engine.fault_tolerance.group.ReplicaGroup`),
    or None: fault tolerance off, or a strategy that is not ours."""
    strategy = getattr(trainer, "strategy", None)
    return getattr(strategy, "replica_group", None)


def forget_closure_result(closure: Any) -> None:
    """After a backward that a dead peer group aborted, Lightning's closure holds no result, and its loop would raise
    reading one: give it an empty result, as a ``training_step`` that returned None leaves. The batch was consumed;
    its loss is not logged."""
    from lightning.pytorch.loops.optimization.automatic import ClosureResult

    if hasattr(closure, "_result"):
        closure._result = ClosureResult(None)


def register() -> None:
    """Wrap the two sites (idempotent: a second call finds its own wrappers)."""
    automatic, epoch_loop = trainer_step_sites()
    wrap_once(automatic, TRAINER_OPTIMIZER_STEP, _counted_only_when_committed)
    wrap_once(epoch_loop, TRAINER_LR_SCHEDULERS_STEP, _schedulers_only_when_committed)


def _counted_only_when_committed(original: Callable[..., None]) -> Callable[..., None]:
    def _optimizer_step(self: Any, batch_idx: int, closure: Any) -> None:
        group = replica_group_of(self.trainer)
        if group is None:
            return original(self, batch_idx, closure)
        step = self.optim_progress.optimizer.step
        before = step.state_dict()
        original(self, batch_idx, closure)
        if self.trainer.fit_loop._should_accumulate():
            return  # a strategy that accumulates itself routes every batch here; only the window's last one votes
        if group.committed is False:
            step.load_state_dict(before)  # Lightning counted a step that was not taken
        position = getattr(self.trainer.strategy, "_loop_position", None)
        if position is not None:  # a group that healed inside this window counts the sender's steps
            position.after_vote(step, bool(group.committed))
        if group.committed:
            group.check_step(self.trainer.global_step)

    return _optimizer_step


def _schedulers_only_when_committed(original: Callable[..., None]) -> Callable[..., None]:
    def update_lr_schedulers(self: Any, interval: str, update_plateau_schedulers: bool) -> None:
        group = replica_group_of(self.trainer)
        # `committed` is None until the first vote and again from each window's start, so only the window that
        # just failed its vote holds the step-interval schedulers back (its end, and the plateau update after a
        # validation run at that batch).
        if group is not None and interval == "step" and group.committed is False:
            return
        original(self, interval, update_plateau_schedulers)

    return update_lr_schedulers
