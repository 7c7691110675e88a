"""The Trainer's loop position under fault tolerance: what a healing group receives of it, and where it is applied.

A replica group that restarts must continue where the live groups are: the same ``global_step`` (the optimizer-step
progress), epoch, batch index and ``_batches_that_stepped``, and from then on the same batches. The model, optimizer,
LR schedulers and random states travel in the heal payload (``_fronts/replica.py``); this module adds the loop, as
the payload's ``loop`` entry (:class:`LoopPosition`, the ``extra`` state of ``start_replica_group``).

**Where the heal takes place: before the fit loop starts.** ``_FitLoop.run`` is wrapped (:func:`register`): before
it runs, every group opens its first window there and waits for that window's quorum. That is after Lightning has
restored ``ckpt_path`` (so a heal overrides an older checkpoint, never the reverse) and run the sanity check, and
before the fit loop builds its data iterator and decides, from its counters, how to resume. A group that must heal
applies the received state at once, there, instead of at the window's vote where torchft applies it: the loop state
is then loaded as Lightning loads a checkpoint's loops (``fit_loop.load_state_dict``, which marks the loops as
restarting), and Lightning's own resume logic continues from it. The window opened there is the first training window
(the Trainer's ``on_train_batch_start`` finds it open), so the group votes once for it. The healed group takes no part
in that window's average (torchft zeroes the gradients of a group that was not at the newest step), and steps with
the average of the others at its vote, as on Fabric.

**What is sent: the loop state at the window's start.** A live group takes ``fit_loop.state_dict()`` on its main thread
at each batch's ``on_train_batch_start``, before the window's quorum starts (torchft's thread reads it while the main
thread waits for the quorum in the root's first forward, so the counters never change under it). At that point
Lightning has counted batch ``k`` as fetched but not started; the snapshot is rewritten to the state Lightning itself
saves at batch ``k - 1``'s ``on_train_batch_end`` (a mid-epoch ``ModelCheckpoint``), from which its restart
(``RESTARTED_ON_TRAIN_BATCH_END``, the same in Lightning 2.5 and 2.6) resumes at batch ``k`` without counting anything
twice and without running again a validation that was due after batch ``k - 1`` (the sender ran it). The other
resume stage that would fit, ``RESTARTED_ON_LAST``, skips the next validation and counts ``_batches_that_stepped``
once more when a validation was due: it was tried, and differs from the live groups there.
A stateful loader's own state (``combined_loader``) is not sent; the data position below is the one that moves.

**The data.** Lightning cannot resume a plain map-style loader mid-epoch: it starts the epoch's iterator from the
beginning and would train on batches ``0..`` at batch index ``k``. So the fit trains from a copy of the training
loader whose sampler is a :class:`~lightning_fsdp.engine.fault_tolerance.data.CursorSampler` on the strategy's cursor
over the loader's own sampler (:meth:`LoopPosition.wrap_training_loader`, from ``FSDPStrategy.process_dataloader``),
and a heal seeks it to sample ``k * batch_size`` of epoch ``e`` (at most the share's end) before the fit loop's first
fetch: the healed group's next batch is the live groups' next batch. The user's loader object is left as it is, so a
validation loop given the same object reads its own sampler, not the cursor. Refused at setup, each because a cursor
position would name other samples on a healed group: a training loader without torch's ``BatchSampler`` over a
sampler with a length (an ``IterableDataset``, a custom batch sampler); a sampler whose order is not fixed by the
epoch alone (``RandomSampler``, seeded or not: its order at a heal depends on its generator's past draws); and, at
the first batch, more than one training loader (each would read through the one cursor).

**A live group that fell a step behind** (its vote failed where the others' committed) heals at its next window's vote,
inside the loop, as torchft does. Its batch position is already the others' (every group consumes every window's
batches), which is checked; only its optimizer-step count moves to the sender's (:meth:`LoopPosition.after_vote`).
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Mapping, Sized
from typing import Any, Callable, Optional

from torch.utils.data import BatchSampler

from lightning_fsdp._base.compat import TRAINER_FIT_RUN, trainer_fit_loop
from lightning_fsdp._base.errors import bad_argument
from lightning_fsdp._fronts.patching import wrap_once
from lightning_fsdp.engine.fault_tolerance.config import FaultToleranceError
from lightning_fsdp.engine.fault_tolerance.data import CursorSampler, DataCursor, order_fixed_by_epoch, sampler_name

__all__ = ["LoopPosition", "apply_heal_now", "register"]

_BATCHES = "epoch_loop.batch_progress"
_EPOCHS = "epoch_progress"
_STEPS = "epoch_loop.automatic_optimization.optim_progress"
_MOST_COUNT = 2**53  # above any real count of batches, steps or epochs; a peer's value beyond it is refused
# Lightning warns on a mid-epoch resume of a loader that is not `_Stateful`. After a heal the cursor positions the
# loader, whose sampler was checked to draw the same order on every group: the warning's concern does not apply.
_NOT_RESUMABLE_WARNING = "You're resuming from a checkpoint that ended before the epoch ended"


class LoopPosition:
    """The ``extra`` heal state of a Trainer group: ``produce()`` on a live group, ``load(tree)`` on a healing one."""

    def __init__(self, trainer: Any, cursor: Optional[DataCursor] = None) -> None:
        self.trainer = trainer
        self.cursor = cursor if cursor is not None else DataCursor()
        self.sampler: Optional[CursorSampler] = None
        self.batch_size = 0
        self.healed = False  # this group's loop was healed before its fit loop ran
        self._snapshot: Optional[dict] = None
        self._running = False
        self._pending_batches: Optional[int] = None  # the heal's batch index, applied once the loader is wrapped
        self._align_steps: Optional[dict] = None

    def release_training_loader(self) -> None:
        """The fit ended: its loader copy is dropped; the next fit wraps its own loader again."""
        self.sampler = None

    # --- the sender ------------------------------------------------------------------------------------------------

    def snapshot(self, at_batch_start: bool) -> None:
        """Take the loop state a heal of this window would send (main thread, before the window's quorum starts)."""
        if at_batch_start:  # loaders reloaded at an epoch's start (`reload_dataloaders_every_n_epochs`) are set up
            self.refuse_several_training_loaders()
        state = self.trainer.fit_loop.state_dict()
        own = state.get("state_dict")
        if isinstance(own, dict):
            own.pop("combined_loader", None)
        if at_batch_start:
            _as_saved_at_the_previous_batch_end(state, self.trainer.accumulate_grad_batches)
        self._snapshot = state

    def produce(self) -> Any:
        return self._snapshot

    def refuse_several_training_loaders(self) -> None:
        """Several training loaders (Lightning's ``CombinedLoader``) would each read through the one cursor: each
        would take every other position of its data, its batches paired with the wrong ones of the other, and the
        epoch would end at half its length. A cursor per loader is not sent in a heal: refused (the strategy's
        ``on_train_start``, and each window's snapshot after a reload of the loaders)."""
        combined = getattr(self.trainer.fit_loop, "_combined_loader", None)
        loaders = combined.flattened if combined is not None else []
        if len(loaders) > 1:
            raise ValueError(bad_argument(
                "train_dataloaders", f"{type(combined.iterables).__name__} of {len(loaders)} DataLoaders",
                "one training DataLoader under fault_tolerance",
                "Train from one DataLoader: join the datasets in one Dataset (torch's ConcatDataset, or a Dataset"
                " that returns a pair per index), or turn fault_tolerance off.",
                problem="Every training loader would read through the one data position a heal moves, each reading"
                        " only part of its data, in batches paired with the wrong ones",
            ))

    # --- the healer ------------------------------------------------------------------------------------------------

    def check(self, tree: Any) -> None:
        """Refuse a received loop state that is not this loop's shape; called before the heal applies anything."""
        own = self.trainer.fit_loop.state_dict()
        own.get("state_dict", {}).pop("combined_loader", None)
        _check_shape(tree, own, "loop")

    def load(self, tree: Any) -> None:
        self.check(tree)
        if self._running:
            self._align(tree)
        else:
            self._restore(tree)

    def _restore(self, tree: dict) -> None:
        self.trainer.fit_loop.load_state_dict(tree)  # as Lightning restores a checkpoint's loops: restarting
        self.align_cursor_with_loop()
        self.healed = True  # the fit loop then runs with Lightning's "not resumable" warning silenced

    def align_cursor_with_loop(self) -> None:
        """Put the data cursor where the fit loop will resume: its epoch, and batch ``k`` when the loop holds the
        state of a ``k - 1``'th batch's end (a heal's, or a mid-epoch ``ModelCheckpoint``'s); otherwise the epoch's
        start, as Lightning itself resumes a loader that is not stateful. Called before the fit loop builds its
        iterator, which reads the cursor at once (one batch is prefetched)."""
        loop = self.trainer.fit_loop
        current = loop.epoch_loop.batch_progress.current
        batch_end = current.ready == current.started == current.processed == current.completed + 1
        self.cursor.jump(loop.epoch_progress.current.processed, 0)
        self._pending_batches = current.ready if batch_end else 0
        if self.sampler is not None:  # the loader was wrapped before (a second fit)
            self._seek()

    def _align(self, tree: dict) -> None:
        here, there = _position(self._snapshot), _position(tree)
        if here != there:
            raise FaultToleranceError(
                f"A running Trainer group must heal, and its loop is at (epoch, batches) {here} while the group it"
                f" heals from is at {there}: its batches cannot be realigned inside the loop. HINT: let this group's"
                " launcher restart it (torchrun --max-restarts): a restarted group heals its loop position before"
                " its fit loop starts."
            )
        self._align_steps = tree[_STEPS]["optimizer"]["step"]

    def after_vote(self, step_progress: Any, committed: bool) -> None:
        """After a window's vote (``step_progress``: the loop's optimizer-step progress): when this window healed
        inside the loop, count the steps the sender had counted at the window's start, plus this window's if it
        committed, so that ``global_step`` is torchft's step again."""
        state, self._align_steps = self._align_steps, None
        if state is None:
            return
        add = 1 if committed else 0
        step_progress.load_state_dict({part: {k: v + add for k, v in state[part].items()} for part in state})

    # --- the data ----------------------------------------------------------------------------------------------------

    def wrap_training_loader(self, dataloader: Any) -> Any:
        """A copy of the training loader that reads its batches through the cursor (its ``BatchSampler``'s sampler
        wrapped in a :class:`CursorSampler`). The user's object is not changed: another loop that iterates it (the
        same loader given for validation) must not read through, or move, the training cursor."""
        batch_sampler = getattr(dataloader, "batch_sampler", None)
        inner = getattr(batch_sampler, "sampler", None)
        if type(batch_sampler) is not BatchSampler or not isinstance(inner, Sized):
            raise ValueError(bad_argument(
                "train_dataloaders",
                f"{type(dataloader).__name__}(batch_sampler={type(batch_sampler).__name__},"
                f" sampler={type(inner).__name__})",
                "a training DataLoader over a map-style dataset with a `batch_size` (torch's BatchSampler over a"
                " sampler with a length)",
                "Train from a map-style Dataset with `DataLoader(dataset, batch_size=...)` (any sampler with a"
                " length), or turn fault_tolerance off.",
                problem="A healed group must start at the live groups' batch, and only a sampler of indices can be"
                        " positioned there",
            ))
        if isinstance(inner, CursorSampler):  # the user's own (`fault_tolerant_sampler`): read through ours instead
            inner = inner.sampler
        if not order_fixed_by_epoch(inner):
            raise ValueError(bad_argument(
                "train_dataloaders", f"{type(dataloader).__name__}(sampler={sampler_name(inner)})",
                "a training sampler whose order depends only on the epoch: SequentialSampler, DistributedSampler"
                " (Lightning injects one when `use_distributed_sampler=True`), or Lightning's"
                " DistributedSamplerWrapper over one of these",
                "use DistributedSampler(dataset, shuffle=True, seed=...) for a shuffled order (or"
                " `DataLoader(shuffle=True)` and let the Trainer inject it), or turn fault_tolerance off.",
                problem="A healed group draws this sampler's order anew at the heal, and only an order fixed by the"
                        " epoch is the live groups' order there (a random sampler's depends on its generator's past"
                        " draws): it would train on other samples than theirs",
            ))
        self.sampler = CursorSampler(inner, self.cursor)
        self.batch_size = batch_sampler.batch_size
        if self._pending_batches is not None:
            self._seek()
        return _copy_reading_from(dataloader, BatchSampler(self.sampler, batch_sampler.batch_size,
                                                           batch_sampler.drop_last))

    def _seek(self) -> None:
        assert self.sampler is not None and self._pending_batches is not None
        # Batch `k`'s first sample, but never past the share's end: after an epoch's last, short, batch `k` batches
        # hold fewer samples than `k * batch_size`, and the excess would be carried into the next epoch's positions.
        position = min(self._pending_batches * self.batch_size, len(self.sampler))
        self.sampler.seek(self.cursor.epoch, position)
        self._pending_batches = None


def apply_heal_now(group: Any) -> bool:
    """After the quorum of a window: when this group heals in it, apply the received state now, on the main thread,
    rather than at the window's vote. torchft's synchronous-quorum mode does the same at ``start_quorum`` (its
    ``_apply_pending_state_dict``, then ``_healing = False``); the group still takes no part in the window's average
    (it was not at the newest step, so ``participating_rank`` is None). Returns whether it healed. A heal whose
    transfer failed leaves torchft's state as it is: the window's vote then fails, as it would have."""
    manager = getattr(group, "manager", None)
    if manager is None or not getattr(manager, "_healing", False):
        return False
    if getattr(manager, "_pending_state_dict", None) is None:
        return False
    manager._apply_pending_state_dict()
    manager._healing = False
    return True


def loop_position_of(trainer: Any) -> Optional[LoopPosition]:
    return getattr(getattr(trainer, "strategy", None), "_loop_position", None)


def register() -> None:
    """Wrap ``_FitLoop.run`` (idempotent)."""
    wrap_once(trainer_fit_loop(), TRAINER_FIT_RUN, _first_window_before_the_loop)


def _first_window_before_the_loop(original: Callable[..., None]) -> Callable[..., None]:
    def run(self: Any) -> None:
        trainer = self.trainer
        position = loop_position_of(trainer)
        group = getattr(getattr(trainer, "strategy", None), "replica_group", None)
        if position is None or group is None:
            return original(self)
        if not _finished(self):
            position.snapshot(at_batch_start=False)  # what a peer healing in this window receives
            group.begin_window()
            group.participating_rank()  # waits for the quorum, and for a heal transfer to this group
            if not apply_heal_now(group) and self.restarting:  # restored from `ckpt_path`: the data follows
                position.align_cursor_with_loop()
        position._running = True
        try:
            with warnings.catch_warnings():  # scoped to this fit: a later one without a heal warns as usual
                if position.healed:  # the loop resumes mid-epoch by design, from a state the cursor follows
                    warnings.filterwarnings("ignore", message=_NOT_RESUMABLE_WARNING)
                return original(self)
        finally:
            position._running = False
            position.release_training_loader()

    return run


def _copy_reading_from(dataloader: Any, batch_sampler: BatchSampler) -> Any:
    """A shallow copy of ``dataloader`` that reads its batches from ``batch_sampler``: same dataset, workers and
    collate function, and no persistent worker iterator of the original's. Its ``sampler`` stays the user's, as
    ``trainer.train_dataloader.sampler`` showed it before (Lightning's ``set_epoch`` reaches both)."""
    twin = copy.copy(dataloader)
    # A built DataLoader refuses a new batch sampler through its `__setattr__`; the copy's attributes are its own.
    vars(twin).update(batch_sampler=batch_sampler, _iterator=None)
    return twin


def _finished(fit_loop: Any) -> bool:
    """``max_steps`` or ``max_epochs`` already reached (``fit_loop.done`` without its messages): no window opens."""
    steps, epochs = fit_loop.max_steps, fit_loop.max_epochs
    if steps is not None and steps != -1 and fit_loop.epoch_loop.global_step >= steps:
        return True
    return epochs is not None and epochs != -1 and fit_loop.epoch_progress.current.processed >= epochs


def _as_saved_at_the_previous_batch_end(state: dict, accumulate: int) -> None:
    """Rewrite the loop state taken at batch ``k``'s ``on_train_batch_start`` to the state Lightning saves at batch
    ``k - 1``'s ``on_train_batch_end`` (a ``ModelCheckpoint(every_n_train_steps=...)`` checkpoint), from which its
    restart (``RESTARTED_ON_TRAIN_BATCH_END``) resumes at batch ``k``, counts batch ``k - 1`` completed, and takes a
    validation due after it as run (the sender ran it before the snapshot). Batch ``k`` was counted as fetched, batch
    ``k - 1`` completed and, as it ended a window, as stepped for the loggers (``_batches_that_stepped``): the restart
    counts those two again itself."""
    batches = state[_BATCHES]
    for part in ("total", "current"):
        batches[part]["ready"] -= 1
        batches[part]["completed"] -= 1
    batches["is_last_batch"] = False
    if batches["current"]["ready"] % accumulate == 0:  # Lightning's own test, at its restart, for a window's end
        state["epoch_loop.state_dict"]["_batches_that_stepped"] -= 1


def _position(state: Any) -> tuple[int, int]:
    return state[_EPOCHS]["current"]["processed"], state[_BATCHES]["total"]["ready"]


def _check_shape(tree: Any, own: Any, path: str) -> None:
    """The received loop state has exactly this loop's keys, with ints and bools where this one has them."""
    if isinstance(own, Mapping):
        if not isinstance(tree, Mapping) or set(tree) != set(own):
            raise FaultToleranceError(
                f"The healed loop state at {path} has keys {sorted(tree) if isinstance(tree, Mapping) else tree!r:.200}"
                f", this Trainer's loop has {sorted(own)}. HINT: every group must run the same Lightning version and"
                " the same loops."
            )
        for key in own:
            _check_shape(tree[key], own[key], f"{path}.{key}")
    elif isinstance(own, (bool, int)) and type(tree) is not type(own):
        kind = "a bool" if isinstance(own, bool) else "an int"
        raise FaultToleranceError(f"The healed loop state's {path} is {tree!r:.80} ({type(tree).__name__}); this"
                                  f" Trainer's loop holds {kind} there. HINT: every group must run the same Lightning"
                                  " version.")
    elif type(own) is int and not -1 <= tree < _MOST_COUNT:
        # A count from a peer: negative or absurd values would end or shift the healed group's training silently.
        # -1: a window's state at an epoch's first batch is the previous batch's end, one batch before 0.
        raise FaultToleranceError(f"The healed loop state's {path} is {tree!r:.80}; a loop counter is an int in"
                                  f" [-1, {_MOST_COUNT}). HINT: the sending group's state is damaged; restart this"
                                  " group to heal from another.")
