"""The upload side of a save to object storage.

A sharded save streams each rank's shard file from memory into its object, or objects (:func:`open_streamed`, the
upload sink: :mod:`.sink`), and notes each one's size and digest as it completes (:func:`note_streamed`); what is left in the local
staging folder (rank 0's small files: ``meta.pt``, ``.metadata``, ``checksums.json``; a full save's file) is put by
:func:`upload`, which returns the rank's part of the COMMIT record: ``{name: [size, digest or None]}`` for both
(digests only for objects under :data:`DIGEST_BELOW`, see :mod:`.remote`). The sizes of streamed objects come from
what was written, not from a listing."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, Optional

import xxhash

from lightning_fsdp.checkpoint.io.remote_clean import token_of_staging
from lightning_fsdp.checkpoint.io.sink import ShardUpload
from lightning_fsdp.checkpoint.io.urls import join

__all__ = ["upload", "DIGEST_BELOW", "open_streamed", "note_streamed", "forget_streamed", "streamed"]

DIGEST_BELOW = 4 * 2**20  # objects this small get a digest in COMMIT (.metadata, meta.pt, checksums.json)
_DIGEST_BELOW = DIGEST_BELOW

# The objects this process streamed for a save, by its staging path (one per save and rank), until its commit.
_STREAMED: dict[str, dict[str, list]] = {}
_LOCK = threading.Lock()  # an async save streams in DCP's thread while the next save may begin in another


def open_streamed(fs: Any, staged: Path, target: str, name: str, size_hint: Optional[int] = None) -> ShardUpload:
    """The object ``name`` of the save staged at ``staged`` (its token) under ``target``, written from memory; a
    sharded writer may go on into further objects of the same prefix (``next_object``: :class:`.sink.ShardUpload`)."""
    prefix = join(target, "." + token_of_staging(Path(staged).parent))
    return ShardUpload(fs, lambda object_name: join(prefix, object_name), name, size_hint=size_hint)


def note_streamed(staged: Path, name: str, size: int, digest: Optional[int]) -> None:
    with _LOCK:
        _STREAMED.setdefault(str(staged), {})[name] = [size, digest if size < _DIGEST_BELOW else None]


def forget_streamed(staged: Path) -> dict[str, list]:
    with _LOCK:
        return _STREAMED.pop(str(staged), {})


def streamed(staged: Path) -> dict[str, list]:
    with _LOCK:
        return {name: list(entry) for name, entry in _STREAMED.get(str(staged), {}).items()}


def upload(fs: Any, staged: Path, target: str, token: str) -> dict[str, list]:
    objects = streamed(staged)  # kept until the save ends (`forget_streamed`): a retried upload names them again
    if not staged.exists():
        return objects  # nothing staged on this rank: its shard was streamed, or a full save (rank 0 writes it)
    files = sorted(p for p in staged.rglob("*") if p.is_file()) if staged.is_dir() else [staged]
    names = [p.relative_to(staged).as_posix() if staged.is_dir() else staged.name for p in files]
    for file, name in zip(files, names):
        size = file.stat().st_size
        digest = xxhash.xxh3_64_intdigest(file.read_bytes()) if size < _DIGEST_BELOW else None
        objects[name] = [size, digest]
    if files:
        # One call for all: the filesystem keeps several uploads in flight (s3fs: a batch at a time, each large
        # file in concurrent multipart chunks).
        fs.put([str(f) for f in files], [join(target, "." + token, n) for n in names])
    return objects
