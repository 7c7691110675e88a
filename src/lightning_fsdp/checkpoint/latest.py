"""The newest good checkpoint in a directory of step checkpoints.

A training job that saves every K steps into one directory (``step-00000100``, ``step-00000200``, ... or any names
ending in the step number) resumes from the newest checkpoint that is complete and passes verification. A save
that was killed never shows up here (it lives under a hidden staging name until its commit, see :mod:`~lightning_fsdp.checkpoint.io.atomic`);
a committed checkpoint damaged afterwards (a truncated shard, flipped bits) fails its checksums and is skipped with
a warning that names it, and the next older one is used.

``fabric.load("<dir>/latest", state)`` and ``trainer.fit(..., ckpt_path="<dir>/latest")`` use this when ``latest``
does not exist in ``<dir>`` (a real file or link named ``latest`` is loaded as it is).
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import Optional, Union

from lightning_fsdp.checkpoint.formats.layout import is_full_checkpoint, is_sharded_checkpoint
from lightning_fsdp.checkpoint.integrity.verify import verify_checkpoint

__all__ = ["LATEST", "step_of", "step_checkpoints", "newest_good_checkpoint", "resolve_latest"]

LATEST = "latest"
_TRAILING_NUMBER = re.compile(r"(\d+)(?:\.[A-Za-z]+)?$")


def step_of(path: Path) -> Optional[int]:
    """The step a checkpoint's name ends in (``step-00000100`` and ``epoch=0-step=100.ckpt`` give 100), else None."""
    match = _TRAILING_NUMBER.search(path.name)
    return int(match.group(1)) if match else None


def step_checkpoints(directory: Union[str, Path]) -> list[Path]:
    """The committed checkpoints in ``directory`` whose names end in a step number, oldest step first.

    Hidden entries are left out: they are staging copies of saves in flight or killed, and backups (:mod:`~lightning_fsdp.checkpoint.io.atomic`).
    Only the on-disk format is checked here (cheap); contents are verified by :func:`newest_good_checkpoint`.
    """
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = []
    for entry in directory.iterdir():
        step = step_of(entry)
        if entry.name.startswith(".") or step is None:
            continue
        if is_sharded_checkpoint(entry) or is_full_checkpoint(entry):
            found.append((step, entry.stat().st_mtime_ns, entry.name, entry))
    return [entry for *_, entry in sorted(found)]


def newest_good_checkpoint(directory: Union[str, Path]) -> Optional[Path]:
    """The newest checkpoint in ``directory`` that passes verification (every checksum), or None when there is none.

    Each newer one that fails is skipped with a warning naming it and the reason. Reads every checked checkpoint in
    full, so call it on one rank and broadcast the answer (:func:`resolve_latest` does).
    """
    for candidate in reversed(step_checkpoints(directory)):
        try:
            verify_checkpoint(candidate)  # False (no checksums, an old checkpoint) still loads: the load notes it
        except Exception as err:  # noqa: BLE001 - any unreadable checkpoint is skipped, and named
            warnings.warn(
                f"Skipping the checkpoint {str(candidate)!r}: it fails verification ({type(err).__name__}: {err})."
                " Resuming from an older one. HINT: delete or move it once you have looked at it.",
                stacklevel=2,
            )
            continue
        return candidate
    return None


def resolve_latest(path: Union[str, Path], comm) -> Path:
    """``path`` itself, unless it is ``<dir>/latest`` and no such entry exists: then the newest good checkpoint in
    ``<dir>``, found by rank 0 and broadcast, so every rank loads the same one. Raises ``FileNotFoundError`` on
    every rank when ``<dir>`` holds none."""
    path = Path(path)
    if path.name != LATEST or path.exists() or path.is_symlink():
        return path
    found = newest_good_checkpoint(path.parent) if comm.global_rank == 0 else None
    found = comm.broadcast(None if found is None else str(found))
    if found is None:
        raise FileNotFoundError(
            f"No complete checkpoint to resume from in {str(path.parent)!r} (asked for {str(path)!r}): it holds no"
            " checkpoint whose name ends in a step number, or none passes verification. HINT: save into that"
            " directory with step numbers in the names, like `fabric.save(f'{dir}/step-{step:08d}', state)`, or start"
            " from scratch when nothing is there yet (`StepCheckpoints.resume` returns None then)."
        )
    return Path(found)
