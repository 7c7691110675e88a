"""Retention: keep the newest N good step checkpoints (and every M-th), delete the rest, never too early.

Rules, each for a failure it prevents:

- "Newest" is the order of **commit**, the one order of :func:`.latest.step_checkpoints`, the same one ``latest``
  and ``resume`` use: after a rollback (load step 100, train on, save step 110), 110 is the newest and the abandoned
  200 older, so 110 is kept and 200 goes first. Step order would delete the save the run goes on from.
- Only **good** checkpoints count towards ``keep_last``: a damaged one (it fails verification,
  :func:`.latest.verification_failure`) is never one of the N kept, so N loadable ones stay. It is not deleted
  while it is newer than the N-th good one (someone may want to look at it), and goes once it is older.
- The newest good checkpoint is never deleted, nor anything committed after it, whatever ``keep_last`` says. When
  nothing verifies, nothing is deleted.
- Only **committed** checkpoints are counted and deleted (:func:`.latest.step_checkpoints` lists no staging copy).
  A save still in flight, a background one included, is not yet there: the older checkpoints it would replace stay
  until it is committed, so a crash during that save still leaves one to resume from.
- Names without a step number and anything that is not a checkpoint are left alone: they are the user's.
- Nothing is deleted in a directory whose last search for the newest good checkpoint, in this process, could not
  read its store (a resume during an outage, :func:`.latest.unread_directory`): what is there is unknown, and a run
  that went on anyway would delete the checkpoint it should have resumed from (issue 45). A checkpoint that could not
  be read during retention itself stops it the same way, with an error naming it.

Verification reads a checkpoint in full, once per process (:func:`.latest.verification_failure` remembers it while
its files are unchanged, and what a load of ``latest`` found damaged), and the checkpoint just committed is not read
back (:func:`.latest.trust`). In a bucket it streams each object in windows, several in flight: no local copy, a few
windows of memory (:meth:`~lightning_fsdp.checkpoint.io.remote.FsspecStore.verify`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Union

from lightning_fsdp.checkpoint.io.store import Target, store_for
from lightning_fsdp.checkpoint.latest import step_checkpoints, step_of, unread_directory, verification_failure

__all__ = ["check_retention", "to_delete", "prune"]


def check_retention(keep_last: Optional[int], keep_every: Optional[int]) -> None:
    for name, value in (("keep_last", keep_last), ("keep_every", keep_every)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(
                f"`{name}={value!r}` must be a positive int or None (keep all). HINT: `keep_last=3` keeps the 3"
                " newest step checkpoints; `keep_every=1000` also keeps those whose step is a multiple of 1000."
            )


def to_delete(directory: Union[str, Path], keep_last: Optional[int], keep_every: Optional[int] = None,
              storage_options: Optional[dict] = None) -> list[Target]:
    """The committed step checkpoints in ``directory`` that retention would delete now, oldest (by commit) first.

    Walking back from the newest commit, everything is kept until ``keep_last`` good checkpoints have been seen;
    what was committed before the last of those goes, unless its step is a multiple of ``keep_every``."""
    check_retention(keep_last, keep_every)
    if keep_last is None:
        return []
    committed = step_checkpoints(directory, storage_options)
    kept, good = set(), 0
    for path in reversed(committed):
        if good >= keep_last:
            break
        kept.add(path)
        good += verification_failure(path, storage_options) is None
    if keep_every is not None:
        kept |= {p for p in committed if step_of(p) % keep_every == 0}  # type: ignore[operator]
    return [p for p in committed if p not in kept]


def prune(directory: Union[str, Path], keep_last: Optional[int], keep_every: Optional[int] = None,
          storage_options: Optional[dict] = None) -> list[Target]:
    """Delete what :func:`to_delete` names (call it on one rank, after a commit), through the store that keeps
    ``directory`` (a URL's commit object goes first). Returns the deleted paths."""
    why = unread_directory(directory, storage_options)
    if why is not None:
        raise RuntimeError(
            f"Retention in {str(directory)!r} deletes nothing in this process: finding the newest checkpoint there"
            f" could not read its store ({why[:300]}), so what is there is unknown, and deleting could remove"
            " the checkpoint this run should have resumed from. HINT: stop this run and start it again once the store"
            " answers, so that it resumes from its newest checkpoint (or find it again, `StepCheckpoints.latest()`,"
            " which turns retention back on once it succeeds)."
        )
    store = store_for(directory, storage_options)
    doomed = to_delete(directory, keep_last, keep_every, storage_options)
    for path in doomed:
        store.remove(path)
    return doomed
