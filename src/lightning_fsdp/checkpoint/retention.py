"""Retention: keep the newest N step checkpoints (and every M-th), delete the rest, never too early.

Rules, each for a failure it prevents:

- Only **committed** checkpoints are counted and deleted (:func:`.latest.step_checkpoints` lists no staging copy).
  A save still in flight, a background one included, is not yet there: the older checkpoints it would replace stay
  until it is committed, so a crash during that save still leaves one to resume from.
- The newest committed checkpoint is never deleted, whatever ``keep_last`` says.
- Names without a step number and anything that is not a checkpoint are left alone: they are the user's.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Optional, Union

from lightning_fsdp.checkpoint.latest import step_checkpoints, step_of

__all__ = ["check_retention", "to_delete", "prune"]


def check_retention(keep_last: Optional[int], keep_every: Optional[int]) -> None:
    for name, value in (("keep_last", keep_last), ("keep_every", keep_every)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(
                f"`{name}={value!r}` must be a positive int or None (keep all). HINT: `keep_last=3` keeps the 3"
                " newest step checkpoints; `keep_every=1000` also keeps those whose step is a multiple of 1000."
            )


def to_delete(directory: Union[str, Path], keep_last: Optional[int], keep_every: Optional[int] = None) -> list[Path]:
    """The committed step checkpoints in ``directory`` that retention would delete now, oldest first."""
    check_retention(keep_last, keep_every)
    if keep_last is None:
        return []
    committed = step_checkpoints(directory)
    kept = set(committed[-max(keep_last, 1):])
    if keep_every is not None:
        kept |= {p for p in committed if step_of(p) % keep_every == 0}  # type: ignore[operator]
    return [p for p in committed if p not in kept]


def prune(directory: Union[str, Path], keep_last: Optional[int], keep_every: Optional[int] = None) -> list[Path]:
    """Delete what :func:`to_delete` names (call it on one rank, after a commit). Returns the deleted paths."""
    doomed = to_delete(directory, keep_last, keep_every)
    for path in doomed:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    return doomed
