"""A directory of step checkpoints for a Fabric training loop: save every K steps, resume from the newest good one,
keep the last N.

This is the "other half" of atomic, verified saves: a job that is preempted or loses a rank restarts, calls
:meth:`StepCheckpoints.resume`, and loses at most the steps since the last save::

    checkpoints = StepCheckpoints(fabric, "checkpoints", keep_last=3)
    state = {"model": model, "optimizer": optimizer, "step": 0}
    checkpoints.resume(state)                 # None on a fresh start; else the path it loaded
    for step in range(state["step"], total_steps):
        ...
        state["step"] = step + 1
        if state["step"] % 100 == 0:
            checkpoints.save(state)           # step-00000100, ...; old ones pruned after the commit

It is a thin layer over ``fabric.save`` / ``fabric.load``: the finding lives in :mod:`.checkpoint.latest`, the
pruning in :mod:`.checkpoint.retention`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Union

from lightning_fsdp.checkpoint.integrity.agreement import together
from lightning_fsdp.checkpoint.io.store import Target, store_for
from lightning_fsdp.checkpoint.latest import fall_back, find_newest_on_rank_zero, step_candidates, trust
from lightning_fsdp.checkpoint.retention import check_retention, prune

__all__ = ["StepCheckpoints"]


class StepCheckpoints:
    """Step checkpoints of one training run in ``directory``, named ``name.format(step=...)``.

    Args:
        fabric: the ``Fabric`` whose strategy saves and loads.
        directory: where the checkpoints go; created by the first save.
        keep_last: keep only this many newest checkpoints (None: keep all). Older ones are deleted once the newer
            one is committed, never before: with ``async_save=True`` in the thread that commits the background save,
            so exactly ``keep_last`` remain once every save is committed (at ``wait_for_saves``, the next save, and
            exit). Only checkpoints that pass verification count, newest by commit (after a rollback, the save
            the run goes on from is the newest, whatever its step); the newest good one is never deleted.
        keep_every: also keep every checkpoint whose step is a multiple of this.
        name: the name pattern; it must end in ``{step}`` (formatted), which is how checkpoints are found (they are
            ordered by when they were committed, :mod:`.checkpoint.formats.commit_order`).
        step_key: the entry of ``state`` that holds the step count, read by :meth:`save` when no step is passed.
    """

    def __init__(
        self,
        fabric: Any,
        directory: Union[str, Path],
        *,
        keep_last: Optional[int] = None,
        keep_every: Optional[int] = None,
        name: str = "step-{step:08d}",
        step_key: str = "step",
    ) -> None:
        check_retention(keep_last, keep_every)
        try:
            formatted = name.format(step=12)
        except (KeyError, IndexError, ValueError) as err:
            raise ValueError(f"`StepCheckpoints(name={name!r})` cannot be formatted with a step ({err}). HINT: use a"
                             " pattern like 'step-{step:08d}'.") from None
        if not formatted.rstrip("0123456789") or not formatted.endswith("12"):
            raise ValueError(f"`StepCheckpoints(name={name!r})` must end in the step number (it gives {formatted!r} for"
                             " step 12), which is how the checkpoints are found. HINT: use a pattern like 'step-{step:08d}'.")
        self.fabric = fabric
        # A folder, or a URL (``s3://bucket/run``): the strategy's ``storage_options`` reach its filesystem.
        options = getattr(fabric.strategy, "_storage_options", lambda _: None)(None)
        self._store, self._options = store_for(directory, options), options
        self.directory = self._store.target(directory)
        self.keep_last, self.keep_every, self.name, self.step_key = keep_last, keep_every, name, step_key

    def path(self, step: int) -> Target:
        return self._store.child(self.directory, self.name.format(step=step))

    def save(self, state: dict[str, Any], step: Optional[int] = None) -> Target:
        """Save ``state`` as the checkpoint of ``step`` (default ``state[step_key]``), then delete the committed
        checkpoints that retention no longer keeps. Call it on every rank."""
        step = int(state[self.step_key]) if step is None else int(step)
        path = self.path(step)
        # Under fault tolerance one replica group writes and prunes (`FrontMixin._writes_checkpoints`); the others
        # return the path that group writes.
        if not getattr(self.fabric.strategy, "_writes_checkpoints", lambda: True)():
            return path
        self.fabric.save(path, state)
        if self.keep_last is not None:
            strategy = self.fabric.strategy
            comm = strategy.communicator
            what = f"Deleting old checkpoints in {str(self.directory)!r}"

            def prune_once_committed() -> None:
                # Retention counts committed checkpoints only, so it runs once `path` is one: at once after a
                # synchronous save; after a background save, in the thread that commits it, so that exactly
                # `keep_last` remain at `wait_for_saves`, the next save and exit (and none if that save fails).
                strategy.after_commit(lambda: (trust(path, self._options),
                                               prune(self.directory, self.keep_last, self.keep_every, self._options)),
                                      what)

            # Rank 0 deletes; the outcome is agreed, so a failed delete raises on every rank (a deferred one: at the
            # next wait for the background save).
            together(comm, what, lambda: prune_once_committed() if comm.global_rank == 0 else None)
        return path

    def latest(self) -> Optional[Target]:
        """The checkpoint committed last that passes verification, the same on every rank (None if there is none).

        Raises on every rank when the store could not be read (``ConnectionError`` naming the URL, within the
        store's bound, ``LFSDP_STORE_TIMEOUT_S``, default 60 s): an unreadable store is never taken for an empty or
        damaged directory, and retention in this directory deletes nothing in this process until a later call succeeds."""
        found = find_newest_on_rank_zero(self.directory, self.fabric.strategy.communicator, self._options)
        return None if found is None else self._store.target(found)

    def resume(self, state: dict[str, Any], strict: bool = True) -> Optional[Target]:
        """Load the newest good checkpoint (by commit, :meth:`latest`) into ``state`` (in place) and return its
        path; None, and ``state`` untouched, when the directory holds none (a fresh start).

        In a bucket the newest is not verified first (that would move its bytes twice): it is loaded at once, every
        item checked as it arrives, as ``fabric.load("<dir>/latest", state)`` does. Damage found so is warned about
        by name and the one committed before it is loaded instead (over what the failed attempt wrote), unless that
        one lacks entries the failed attempt may have written (a ``ChecksumError`` with a HINT). When every one is
        damaged, ``state`` may hold some of their values: that is a ``FileNotFoundError``, not a fresh start.

        A store that could not be read is an error on every rank (:meth:`latest`), never a fresh start: let it stop
        the job, and requeue it."""
        if not self._store.remote:  # on local disk, verified first: the second read comes from the page cache
            found = self.latest()
            if found is not None:
                self.fabric.load(found, state, strict=strict)
            return found
        comm = self.fabric.strategy.communicator
        candidates = step_candidates(self.directory, comm, self._options)
        while candidates:
            try:
                self.fabric.load(candidates[0], state, strict=strict)
                return candidates[0]
            except Exception as err:  # noqa: BLE001 - damage goes on to the one before; anything else is raised
                fall_back(candidates, err, comm, self._options)  # none left: the FileNotFoundError of no good one
        return None
