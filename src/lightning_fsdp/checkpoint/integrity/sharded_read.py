"""Sharded checkpoints, the reading side of the checksums: ``checksums.json`` is read and checked against the
save, the whole files it binds are checked before use, and :class:`VerifyingReader` checks each item as DCP reads it
(see :mod:`.digests` for the design)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Callable, Optional, Union

from torch.futures import Future

from lightning_fsdp._base.compat import DCP_READER_ITEM_VIEW
from lightning_fsdp._base.seekable import BlockReader
from lightning_fsdp.checkpoint.formats.layout import CHECKSUMS_FILENAME, DCP_METADATA_FILENAME, METADATA_FILENAME
from lightning_fsdp.checkpoint.integrity.agreement import CheckpointError
from lightning_fsdp.checkpoint.integrity.digests import (
    ALGORITHMS,
    BOUND_SAVE_ID_PREFIX,
    DAMAGED_HINT,
    SAVE_ID_PREFIX,
    ChecksumError,
    hash_file_range,
    hasher_factory,
    note_unverified,
    whole_file_digest,
    WHOLE_FILES,
)
from lightning_fsdp.checkpoint.integrity.safe_pickle import (
    SafeFileSystemReader,
    UnsafeCheckpointError,
    load_dcp_metadata,
)
from lightning_fsdp.checkpoint.integrity.zipfiles import verify_zip

__all__ = ["VerifyingReader", "check_files", "verify_sharded"]

@dataclass
class _Manifest:
    """A sharded checkpoint's recorded digests: by (file, offset), the item's length, digest and name."""

    items: dict[tuple[str, int], tuple[int, int, str]]
    new_hasher: Callable[[int], Any]
    seed: int
    file: Path  # checksums.json: a mismatch means that the data, or this record of it, changed

    def hasher(self) -> Any:
        return self.new_hasher(self.seed)


def _read_manifest(path: Path, metadata: Any = None) -> Optional[_Manifest]:
    """The recorded digests, once every file of the checkpoint is shown to belong to the save that recorded them;
    None for a checkpoint saved without checksums. Raises, naming the file, when they should be there and are not,
    or when a file does not belong (changed, or copied in from another checkpoint). ``metadata``: the unpickled
    ``.metadata`` where the caller has it already."""
    dcp_metadata = path / DCP_METADATA_FILENAME

    def save_id_of_metadata() -> str:
        loaded = load_dcp_metadata(dcp_metadata) if metadata is None else metadata
        save_id = getattr(getattr(loaded, "storage_meta", None), "save_id", None)
        return save_id if isinstance(save_id, str) else ""

    file = path / CHECKSUMS_FILENAME
    if not file.is_file():
        if save_id_of_metadata().startswith(SAVE_ID_PREFIX):
            raise ChecksumError(f"{str(file)!r} is missing, though {str(path)!r} was saved with checksums.{DAMAGED_HINT}")
        return None
    manifest = _parse_manifest(file)
    save_id, algorithm, files = manifest["save_id"], manifest.get("algorithm", "crc32"), manifest.get("files")
    table = {(f, o): (n, c, name) for f, o, n, c, name in manifest["items"]}
    new_hasher = hasher_factory(algorithm, str(file))
    seed = ALGORITHMS[algorithm][0](str(save_id))
    if files is not None:
        _check_files(path, files, {f for f, _ in table}, lambda: new_hasher(seed), save_id_of_metadata, save_id)
    elif str(save_id).startswith(BOUND_SAVE_ID_PREFIX):
        # A save that bound its files, with a manifest that does not: stripping the binding is refused, or every
        # file but the shards could be swapped unseen.
        raise ChecksumError(f"{str(file)!r} does not record the digests of the checkpoint's files, though it was"
                            f" saved with them (it was edited, or replaced by an older manifest).{DAMAGED_HINT}")
    if save_id_of_metadata() != save_id:
        raise _other_save(path)
    return _Manifest(table, new_hasher, seed, file)


def _parse_manifest(file: Path) -> dict[str, Any]:
    """``checksums.json``, with every field of the type a save writes; ``ChecksumError`` naming it otherwise."""
    try:
        manifest = json.loads(file.read_bytes())
    except (ValueError, RecursionError) as err:  # not JSON (UnicodeDecodeError is a ValueError), or nested absurdly
        raise ChecksumError(f"{str(file)!r} is not readable ({type(err).__name__}: {str(err)[:200]}).{DAMAGED_HINT}") from err
    problem = _manifest_problem(manifest)
    if problem:
        raise ChecksumError(f"{str(file)!r} is not readable ({problem}).{DAMAGED_HINT}")
    files = manifest.get("files")
    if files is not None:
        manifest["files"] = {name: (size, digest) for name, (size, digest) in files.items()}
    return manifest


def _manifest_problem(manifest: Any) -> str:
    if not isinstance(manifest, dict):
        return f"it holds a {type(manifest).__name__}, not an object"
    if not isinstance(manifest.get("save_id"), str):
        return "its save_id is not a string"
    if not isinstance(manifest.get("algorithm", "crc32"), str):
        return "its algorithm is not a string"
    items = manifest.get("items")
    if not isinstance(items, list):
        return "its items are not a list"
    for item in items:
        if not (isinstance(item, list) and len(item) == 5 and isinstance(item[0], str) and isinstance(item[4], str)
                and all(_count(v) for v in item[1:4])):
            return f"the item {str(item)[:100]} is not [file, offset, length, digest, name]"
    files = manifest.get("files")
    if files is not None and not (isinstance(files, dict) and all(
            isinstance(v, list) and len(v) == 2 and all(_count(x) for x in v) for v in files.values())):
        return "its files are not {name: [size, digest]}"
    unknown = sorted(set(files or ()) - set(WHOLE_FILES))
    if unknown:  # a save records only these; another name is a damaged one (and would hide the real file's record)
        return f"its files name {unknown[0][:100]!r}, which no save records (only {', '.join(WHOLE_FILES)})"
    return ""


def _count(value: Any) -> bool:
    """An offset, a length or a digest as a save records it: a non-negative int of at most 64 bits."""
    return type(value) is int and 0 <= value < 2**64


def _other_save(path: Path) -> ChecksumError:
    return ChecksumError(f"{str(path / CHECKSUMS_FILENAME)!r} and {str(path / DCP_METADATA_FILENAME)!r} belong to"
                         " different saves (their save ids differ): one of them was copied in from another"
                         f" checkpoint.{DAMAGED_HINT}")


def _check_files(path: Path, files: dict[str, tuple[int, int]], shard_files: set[str],
                 new_hasher: Callable[[], Any], save_id_of_metadata: Callable[[], str], save_id: str) -> None:
    """Every file of a sharded checkpoint belongs to the save ``files`` (the manifest's) was recorded for: each of
    ``.metadata`` and ``meta.pt`` has the digest recorded for it, or is absent where none was; and every shard file
    in the directory is one the save's items live in."""
    for name in WHOLE_FILES:
        where = path / name
        if name not in files:
            if where.exists():
                raise ChecksumError(f"{str(where)!r} is not part of the checkpoint: its save wrote no {name}, so it"
                                    " was put there later (e.g. copied in from another checkpoint). HINT: move it"
                                    " out of the checkpoint directory.")
            continue
        if not where.is_file():
            raise ChecksumError(f"{str(where)!r} is missing, though the checkpoint was saved with it.{DAMAGED_HINT}")
        if tuple(whole_file_digest(where, new_hasher)) != files[name]:
            if name == DCP_METADATA_FILENAME and _readable_save_id(save_id_of_metadata) not in (save_id, None):
                raise _other_save(path)
            raise ChecksumError(f"{str(where)!r} does not match the checksum recorded in"
                                f" {str(path / CHECKSUMS_FILENAME)!r} when the checkpoint was saved (one of the two is"
                                f" damaged, or copied in from another checkpoint).{DAMAGED_HINT}")
    for entry in sorted(os.listdir(path)):
        if entry.endswith(".distcp") and entry not in shard_files:
            raise ChecksumError(f"{str(path / entry)!r} is not part of the checkpoint: its save wrote no such shard"
                                " file (e.g. it was copied in from a checkpoint saved on more ranks). HINT: move it"
                                " out of the checkpoint directory.")


def _readable_save_id(save_id_of_metadata: Callable[[], str]) -> Optional[str]:
    """The save id in ``.metadata``, or None when its bytes do not even unpickle (damaged, not from another save).
    A refusal of the allow-list is raised: a crafted file is reported as what it is."""
    try:
        return save_id_of_metadata()
    except UnsafeCheckpointError:
        raise
    except CheckpointError:
        return None


def check_files(path: Union[str, Path]) -> bool:
    """Check that every file of the sharded checkpoint ``path`` belongs to the save that recorded its checksums,
    without reading any shard (see :func:`_read_manifest`); False when it carries no checksums."""
    return _read_manifest(Path(path)) is not None


class _ItemCheck:
    """One item's recorded digest, and the running digest of its bytes."""

    def __init__(self, root: Path, sinfo: Any, manifest: _Manifest) -> None:
        self.where = str(root / sinfo.relative_path)
        recorded = manifest.items.get((sinfo.relative_path, sinfo.offset))
        if recorded is None:
            raise ChecksumError(f"{self.where!r} has no recorded checksum for the item at byte {sinfo.offset}; the"
                                f" checkpoint's .metadata and {str(manifest.file)!r} disagree.{DAMAGED_HINT}")
        self.length, self.digest, self.name = recorded
        self.offset = sinfo.offset
        self.manifest = str(manifest.file)
        if sinfo.length != self.length:
            self._mismatch()
        self.hasher = manifest.hasher()

    def finish(self, count: int) -> None:
        """Raise unless the ``count`` bytes hashed are the whole item and match its digest."""
        if count < self.length:
            raise ChecksumError(f"{self.where!r} could not be read: it is truncated (the tensor {self.name!r} needs"
                                f" bytes up to {self.offset + self.length}).{DAMAGED_HINT}")
        if self.hasher.intdigest() != self.digest:
            self._mismatch()

    def _mismatch(self) -> None:
        raise ChecksumError(f"{self.where!r} is corrupted: the bytes of the tensor {self.name!r} do not match the"
                            f" checksum recorded in {self.manifest!r} when the checkpoint was saved (one of the two is"
                            f" damaged, or copied from another checkpoint).{DAMAGED_HINT}")


# A read at least this large is hashed from the reader's own buffer as it arrives: torch reads a tensor's bytes in
# one such read, straight into the new tensor's memory. Smaller reads (zip headers, the pickle) are not worth it.
_HASH_AS_READ = 64 * 2**10
# Such a read is done in pieces of this size, each hashed at once while it is still in the CPU cache: hashing a
# 16 MiB tensor after reading it all reads it back from memory. 100 MB from the page cache here: read 8.9 ms, read
# then hashed 12.4 ms, read and hashed 1 MiB at a time 9.9 ms.
_READ_PIECE = 2**20
# Small reads are served from blocks of this size: torch's zip reader makes about 20 reads of 1 to 4,096 bytes per
# item, near its start and its end, and one system call each cost more than the item's hashing (profiled warm).
_BLOCK = 8 * 2**10


class _ItemSlice(BlockReader):
    """One item of a shard file, as a file of its own for DCP's reader, that hashes the item's bytes in order
    without reading them twice.

    The digest covers the item's bytes ``[0, _hashed)``. A large read that starts at or past ``_hashed`` (torch
    reading a tensor's data into the tensor) first catches the digest up (the few header bytes torch skipped or read
    piecewise, usually still in a cached block), then hashes the buffer piece by piece as it fills it.
    :meth:`finish` hashes what is left and compares. Any read pattern gives the same digest: bytes torch did not
    read, or read in another order, are simply read from the file.
    """

    def __init__(self, fd: int, offset: int, length: int, check: _ItemCheck) -> None:
        super().__init__()  # its blocks start at offsets within the item
        self._fd, self._base, self._length, self._check = fd, offset, length, check
        self._pos = self._hashed = 0

    def _extent(self) -> int:
        return self._length

    def _fill(self, view: memoryview, want: int) -> int:
        if want < _HASH_AS_READ:
            return super()._fill(view, want)  # through the two cached blocks
        if self._pos >= self._hashed:
            self._catch_up(self._pos)
        hashing = self._hashed == self._pos
        count = 0
        while count < want:
            end = min(want, count + _READ_PIECE)
            piece = os.preadv(self._fd, [view[count:end]], self._base + self._pos + count)
            if not piece:
                break
            if hashing:
                self._check.hasher.update(view[count:count + piece])
            count += piece
        if hashing:
            self._hashed += count
        return count

    def _fetch_block(self, position: int, want: int) -> tuple[int, bytes]:
        start = position - position % 4096
        return start, os.pread(self._fd, min(max(_BLOCK, position + want - start), self._length - start),
                               self._base + start)

    def read(self, size: Optional[int] = -1) -> bytes:
        want = self._length - self._pos if size is None or size < 0 else min(size, self._length - self._pos)
        buffer = bytearray(max(0, want))
        return bytes(memoryview(buffer)[:self.readinto(buffer)]) if want > 0 else b""

    def _catch_up(self, upto: int) -> None:
        for start, data in self._blocks:  # header bytes torch read a moment ago
            if start <= self._hashed < start + len(data):
                end = min(upto, start + len(data))
                self._check.hasher.update(memoryview(data)[self._hashed - start:end - start])
                self._hashed = end
        if self._hashed < upto:
            self._hashed += hash_file_range(self._fd, self._base + self._hashed, self._base + upto,
                                             self._check.hasher.update)

    def finish(self) -> None:
        self._catch_up(self._length)
        self._check.finish(self._hashed)


class VerifyingReader(SafeFileSystemReader):
    """The reader every sharded load uses: ``.metadata`` through the allow-list, and every item checked against
    its recorded digest as DCP reads it (see :class:`_ItemSlice`).

    An item is checked once DCP is done with it, at the next item or at the end of the read: its tensor has by
    then been copied into the state dict, but the load raises before it returns. A damaged item can also make
    torch fail to parse it; that failure is reported as the damage it is.
    """

    def __init__(self, path: Union[str, Path], *, allow_pickle: bool = False, verify: bool = True) -> None:
        super().__init__(path, allow_pickle=allow_pickle)
        self.verify = verify
        self._manifest: Optional[_Manifest] = None
        self._manifest_for: Optional[str] = None
        self._pending: Optional[_ItemSlice] = None
        self._fds: dict[str, int] = {}

    def set_up_storage_reader(self, metadata: Any, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        save_id = getattr(metadata.storage_meta, "save_id", None)
        if not (self._manifest is not None and save_id == self._manifest_for):  # one read per reader and save
            self._manifest = _read_manifest(Path(self.path), metadata) if self.verify else None
            self._manifest_for = save_id
        if self._manifest is None and self.verify and is_coordinator:
            note_unverified(Path(self.path))

    def read_data(self, plan: Any, planner: Any) -> Future:
        try:
            future = super().read_data(plan, planner)
            self._finish_pending()
        except ChecksumError:
            raise
        except Exception:
            self._finish_pending()  # raises ChecksumError (chained to torch's error) if the item was damaged
            raise
        finally:
            self._pending = None
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()
        return future

    # DCP's reader asks for a readable view of one item's bytes through a private method; `_compat` names it, and
    # the line after this class installs this method under that name.
    def _item_view(self, file: IO[bytes], sinfo: Any) -> IO[bytes]:
        self._finish_pending()  # DCP asks for the next item only when done with the previous one
        if self._manifest is None:
            return getattr(super(), DCP_READER_ITEM_VIEW)(file, sinfo)
        check = _ItemCheck(Path(self.path), sinfo, self._manifest)
        fd = self._fds.get(sinfo.relative_path)
        if fd is None:
            fd = self._fds[sinfo.relative_path] = os.open(Path(self.path) / sinfo.relative_path, os.O_RDONLY)
        self._pending = _ItemSlice(fd, sinfo.offset, sinfo.length, check)
        return self._pending

    def _finish_pending(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.finish()


setattr(VerifyingReader, DCP_READER_ITEM_VIEW, VerifyingReader._item_view)


def verify_sharded(path: Union[str, Path]) -> bool:
    """Check every item of a sharded checkpoint and its ``meta.pt`` without loading them into a model; False when
    the checkpoint carries no checksums (saved before checksums existed)."""
    path = Path(path)
    manifest = _read_manifest(path)  # first: checks that .metadata is the save's before anything relies on it
    metadata = load_dcp_metadata(path / DCP_METADATA_FILENAME)
    if (path / METADATA_FILENAME).is_file():
        verify_zip(path / METADATA_FILENAME)
    if manifest is None:
        return False
    by_file: dict[str, list] = {}
    for info in metadata.storage_data.values():
        by_file.setdefault(info.relative_path, []).append(info)
    for name, infos in sorted(by_file.items()):
        fd = os.open(path / name, os.O_RDONLY)
        try:
            for info in sorted(infos, key=lambda i: i.offset):
                check = _ItemCheck(path, info, manifest)
                check.finish(hash_file_range(fd, info.offset, info.offset + info.length, check.hasher.update))
        finally:
            os.close(fd)
    return True
