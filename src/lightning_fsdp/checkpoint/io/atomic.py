"""Saves that never destroy the previous checkpoint.

A checkpoint is first written to a staging path beside the target (same directory, so the final rename stays on
one filesystem and is atomic). Only a complete staging copy is moved into place:

- a file replaces a file with one ``os.replace``;
- anything else (a directory, or a file replacing a directory) first renames the old checkpoint to a backup name,
  then renames the new one into place, then deletes the backup. A crash between the two renames leaves the old
  checkpoint whole under the backup name, and :func:`recover` puts it back.

A checkpoint path that is a symbolic link (``last`` -> ``step-1000``) is a name for another checkpoint. A load reads
what it points to (:func:`resolve`). A save replaces the link itself with the new checkpoint and leaves the
checkpoint it pointed to as it was: ``step-1000`` keeps holding step 1000, whatever the link named. That is what
Lightning's ``ModelCheckpoint`` does when it refreshes its ``last`` link (it replaces the link), and writing through
the link would silently change a checkpoint stored under its own name. It holds for a link to a file, to a
directory, a dangling link and a chain of links alike: only the last component of the path is replaced, with the
same two-step move as above (a directory cannot be renamed onto a link in one step), so a crash leaves either the
old link or the new checkpoint in place.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from lightning_fsdp.checkpoint.formats.layout import foreign_entries, is_full_checkpoint, is_sharded_checkpoint

STAGING_SUFFIX = ".staging"
BACKUP_SUFFIX = ".previous"


def resolve(path: Path) -> Path:
    """The path a save writes to and a load reads from: a symbolic link (a chain of them too) is followed."""
    return Path(os.path.realpath(path)) if path.is_symlink() else path


def staging_path(target: Path, token: str) -> Path:
    return target.with_name(f".{target.name}.{token}{STAGING_SUFFIX}")


def backup_path(target: Path) -> Path:
    return target.with_name(f".{target.name}{BACKUP_SUFFIX}")


def check_replaceable(target: Path) -> None:
    """Refuse to overwrite anything that is not a checkpoint: users keep their files. A symbolic link is always
    replaceable: replacing it deletes nothing it points to."""
    if target.is_symlink():
        return
    if target.is_dir():
        if not is_sharded_checkpoint(target):
            raise IsADirectoryError(
                f"The checkpoint path {str(target)!r} is an existing directory that is not a sharded checkpoint, so it"
                " is left untouched. HINT: choose another path, or remove that directory yourself."
            )
        foreign = foreign_entries(target)
        if foreign:
            raise IsADirectoryError(
                f"The sharded checkpoint {str(target)!r} also holds files no checkpoint wrote ({', '.join(foreign[:5])}),"
                " and replacing it would delete them. HINT: move those files elsewhere, or save to another path."
            )
    elif target.exists() and not is_full_checkpoint(target):
        raise FileExistsError(
            f"The checkpoint path {str(target)!r} is an existing file that is not a checkpoint, so it is left"
            " untouched. HINT: choose another path, or remove that file yourself."
        )


def fsync_tree(path: Path) -> None:
    """Flush file contents and directory entries, so a completed rename never points at unwritten data."""
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    for file in files:
        with open(file, "rb") as handle:
            os.fsync(handle.fileno())
    _fsync_dir(path if path.is_dir() else path.parent)


def commit(staged: Path, target: Path) -> None:
    """Move a complete staged checkpoint to ``target``, replacing a previous checkpoint there."""
    recover(target)
    for stale in target.parent.glob(f".{target.name}.*{STAGING_SUFFIX}"):
        if stale != staged:  # left behind by a save that was killed
            _remove(stale)
    # A rename replaces a link, never what it points to; `_present` sees links, dangling ones included, so every
    # step below acts on the link itself.
    if staged.is_file() and (target.is_symlink() or is_full_checkpoint(target) or not _present(target)):
        os.replace(staged, target)
    else:
        backup = backup_path(target)
        if _present(backup):
            _remove(backup)
        if _present(target):
            os.replace(target, backup)
        os.replace(staged, target)
        _fsync_dir(target.parent)
        if _present(backup):
            _remove(backup)
    _fsync_dir(target.parent)


def recover(target: Path) -> None:
    """If a previous save died between its two renames, put the old checkpoint (or link) back."""
    backup = backup_path(target)
    if _present(backup) and not _present(target):
        os.replace(backup, target)


def discard(staged: Path) -> None:
    if _present(staged):
        _remove(staged)


def _present(path: Path) -> bool:
    """Whether anything is at ``path``, a link counting as itself (``Path.exists`` follows links)."""
    return os.path.lexists(path)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
