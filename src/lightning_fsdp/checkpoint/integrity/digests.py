"""Checksums, the part every other part uses: the error, the save ids, the manifest constants and the digest
algorithms (xxh3-64 for new checkpoints, CRC-32 for those written before it).

Checksums that make a corrupted checkpoint raise instead of loading wrong numbers.

Neither DCP nor ``torch.load`` checks what it reads. Design:

- **Sharded**: one digest per DCP item (a tensor's chunk, or a non-tensor entry), over the exact bytes DCP stored
  for it, seeded with the save's id. Per item, not per file, because a load reads items, not files: each rank
  reads only the items it needs (any of them after a resize), and verifies each one as it reads it.
  :class:`ChecksumWriter` records them as DCP writes: each rank hashes every item's bytes as they pass through the
  file's write stream (:class:`_DigestingFileSystem`), so nothing is read back, and DCP's own gather brings them to
  the coordinator, which writes ``checksums.json`` after ``.metadata`` (the staging directory is committed as a
  whole). The save id goes into DCP's ``.metadata`` too (``storage_meta.save_id``); the seed ties every digest to
  it, so a shard file or a ``checksums.json`` copied in from another checkpoint does not verify.
- **Every file bound to its save** (manifest format 2): ``checksums.json`` also records a seeded digest of all the
  bytes of ``.metadata`` (which decides where every item's bytes go: a changed chunk offset would load half a
  tensor into the wrong place) and of ``meta.pt`` (the step, the loop state), both checked before either is used;
  a shard file that no item lives in, or a ``meta.pt`` the save did not write, is refused. The save id of such a
  save says so (:data:`BOUND_SAVE_ID_PREFIX`), so a manifest without the binding is refused for it (no downgrade).
- **Full** (and ``meta.pt``): ``torch.save`` files are zip archives that already carry a CRC-32 per record,
  computed by torch's writer as it writes each record. Only nothing ever checked them: :func:`verify_zip` and
  :func:`verify_loaded` do. The full writer also records a fast digest of each tensor record in one more record,
  ``checksums.json`` (``torch.load`` reads only the records its index names, so plain ``torch.load`` still reads
  the file); verification uses it where present and the CRC-32 elsewhere (``torch.save`` files, full checkpoints
  of earlier versions).

Cost: verification must add at most about 5% to a load (issue 12), and a load from the page cache is little more
than a memory copy. So the digest is xxh3-64 (about 15-25 GB/s here, where zlib's CRC-32 runs at about 4 GB/s,
as fast as the load's own copy); and the bytes are hashed where the load already has them, never read or copied
a second time: a sharded item's tensor bytes as torch reads them into the new tensor, a piece at a time while they
are in the CPU cache (:class:`_ItemSlice`); a full file's tensor records in the memory mapping the load reads them
from, each just before the load broadcasts it (:class:`LoadVerifier`). Checkpoints recorded
with CRC-32 (``"algorithm": "crc32"``, everything written before xxh3) still verify.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import uuid
import warnings
import zlib
from pathlib import Path
from typing import Any, Callable

import torch
import xxhash

from lightning_fsdp.checkpoint.formats.layout import DCP_METADATA_FILENAME, METADATA_FILENAME
from lightning_fsdp.checkpoint.integrity.agreement import CheckpointError

__all__ = [
    "ChecksumError", "new_save_id", "ALGORITHM", "ALGORITHMS", "hasher_factory", "hash_file_range", "storage_bytes",
    "file_digests", "whole_file_digest", "item_name", "note_unverified",
]

SAVE_ID_PREFIX = "lightning-fsdp:"
# The save ids of checkpoints whose checksums.json also binds every file (format 2). The id is inside `.metadata`,
# so a checkpoint that says it was saved so cannot pass for an older one without the binding (see `_read_manifest`).
BOUND_SAVE_ID_PREFIX = SAVE_ID_PREFIX + "bound:"
MANIFEST_FORMAT = 2
ZIP_CHECKSUMS_RECORD = "checksums.json"  # the full writer's extra record: {"algorithm": ..., "records": {...}}
DAMAGED_HINT = " HINT: the checkpoint is damaged; load an earlier one, or save this one again."


class ChecksumError(CheckpointError):
    """A checkpoint's bytes do not match the checksums recorded when it was saved."""


def new_save_id() -> str:
    """An id for one save; every rank must use the same one (broadcast it)."""
    return BOUND_SAVE_ID_PREFIX + uuid.uuid4().hex


# --------------------------------------------------------------------------------------------------- algorithms


class Crc32:
    """zlib's CRC-32 behind the interface of xxhash's hashers. What checkpoints were recorded with before xxh3, and
    what zip records carry."""

    def __init__(self, seed: int = 0) -> None:
        self._value = seed

    def update(self, data: Any) -> None:
        self._value = zlib.crc32(data, self._value)

    def intdigest(self) -> int:
        return self._value


# name -> (the seed of a save id, a hasher from a seed). The name is recorded with the digests.
ALGORITHMS: dict[str, tuple[Callable[[str], int], Callable[[int], Any]]] = {
    "crc32": (lambda save_id: zlib.crc32(save_id.encode()), Crc32),
    "xxh3_64": (lambda save_id: xxhash.xxh3_64_intdigest(save_id.encode()), lambda seed: xxhash.xxh3_64(seed=seed)),
}
ALGORITHM = "xxh3_64"  # what new checkpoints record


def hasher_factory(algorithm: str, where: str) -> Callable[[int], Any]:
    try:
        return ALGORITHMS[algorithm][1]
    except (KeyError, TypeError):
        raise ChecksumError(f"{where!r} records checksums of the algorithm {algorithm!r}, which this version of"
                            f" lightning-fsdp does not know (it knows {', '.join(ALGORITHMS)}). HINT: load it with"
                            " the lightning-fsdp version that saved it, or a newer one.") from None


_CHUNK = 8 * 2**20
_MAP_FROM = 64 * 2**10  # below this, a copy costs less than setting up a mapping


def hash_file_range(fd: int, start: int, end: int, update: Callable[[Any], None]) -> int:
    """Feed bytes ``[start, end)`` of the open file ``fd`` to ``update``; returns how many there were (fewer when
    the file ends first).

    Large ranges are hashed through short-lived read-only mappings of at most 8 MiB rather than read: hashing
    page-cache pages in place skips the copy a read makes, and that copy costs more than xxh3 itself (151 MB from
    the page cache here: 22 ms read and hashed, 5.5 ms mapped and hashed). Each window is unmapped at once, so at
    most 8 MiB of the file counts as this process's resident memory at any time.
    """
    end = min(end, os.fstat(fd).st_size)  # a mapping past the end of the file faults (SIGBUS) when touched
    done = 0
    while start + done < end:
        position, size = start + done, min(end - start - done, _CHUNK)
        if size >= _MAP_FROM:
            aligned = position - position % mmap.ALLOCATIONGRANULARITY
            with mmap.mmap(fd, position + size - aligned, prot=mmap.PROT_READ, offset=aligned) as window:
                with memoryview(window) as view, view[position - aligned:] as part:
                    update(part)
        else:
            data = os.pread(fd, size, position)
            if not data:
                break
            update(data)
            size = len(data)
        done += size
    return done


def storage_bytes(storage: torch.UntypedStorage) -> memoryview:
    """The bytes of a CPU storage, without copying them (the caller keeps ``storage`` alive while it uses them)."""
    if not storage.nbytes():
        return memoryview(b"")
    return memoryview((ctypes.c_ubyte * storage.nbytes()).from_address(storage.data_ptr())).cast("B")


WHOLE_FILES = (DCP_METADATA_FILENAME, METADATA_FILENAME)


def file_digests(path: Path, new_hasher: Callable[[], Any]) -> dict[str, list[int]]:
    digests = {}
    for name in WHOLE_FILES:
        if (path / name).is_file():
            digests[name] = whole_file_digest(path / name, new_hasher)
    return digests


def whole_file_digest(file: Path, new_hasher: Callable[[], Any]) -> list[int]:
    """``[size, digest]`` of a file's bytes."""
    hasher = new_hasher()
    fd = os.open(file, os.O_RDONLY)
    try:
        size = hash_file_range(fd, 0, os.fstat(fd).st_size, hasher.update)
    finally:
        os.close(fd)
    return [size, hasher.intdigest()]


def item_name(index: Any) -> str:
    offsets = list(getattr(index, "offset", None) or [])
    return index.fqn + (f" (chunk at {offsets})" if any(offsets) else "")


# ---------------------------------------------------------------------------------------------------- the note


_NOTED: set[str] = set()


def note_unverified(path: Path) -> None:
    """Warn once per checkpoint and process that ``path`` carries no checksums, so it loads unchecked."""
    if str(path) in _NOTED:
        return
    _NOTED.add(str(path))
    warnings.warn(f"{str(path)!r} carries no checksums (it was saved before lightning-fsdp recorded them), so"
                  " its integrity is not checked. HINT: save it again to add them.", stacklevel=3)
