"""Verification of a checkpoint whose bytes are not on this host (issue 43): every object is read once, front to
back, in windows the caller fetches (several in flight, from a bucket), and each item or record is hashed as its
bytes pass, so nothing is written to disk and memory holds a few windows, whatever the checkpoint's size.

The verdicts and messages are those of the local verification (:func:`.verify.verify_checkpoint`): the same
manifest parser, the same per-item check (:class:`.sharded_read._ItemCheck`) and the same zip record table
(:func:`.zipfiles._records`), with the objects named by the URLs the caller gives.

What the caller provides (:class:`Objects`; ``checkpoint.io.remote_windows`` for a store's committed objects):
``kind`` (``"sharded"`` or ``"full"``), ``names``, ``where(name)`` (what messages call it), ``read(name, start,
end)`` (one small range: ``.metadata``, ``checksums.json``, a zip's directory) and ``windows(name)`` (the whole
object as ``(offset, bytes)`` pieces in order; it checks the object's size, and any digest its store records, once
the last piece is taken).
"""

from __future__ import annotations

import contextlib
import errno
import struct
import zipfile
from typing import Any, Callable, Iterator, Optional, Protocol

from lightning_fsdp._base.seekable import BlockReader
from lightning_fsdp.checkpoint.formats.layout import CHECKSUMS_FILENAME, DCP_METADATA_FILENAME, METADATA_FILENAME
from lightning_fsdp.checkpoint.integrity import sharded_read, zipfiles
from lightning_fsdp.checkpoint.integrity.agreement import CheckpointError, unreadable
from lightning_fsdp.checkpoint.integrity.digests import (
    ALGORITHMS, BOUND_SAVE_ID_PREFIX, DAMAGED_HINT, SAVE_ID_PREFIX, WHOLE_FILES, ChecksumError, hasher_factory,
)
from lightning_fsdp.checkpoint.integrity.safe_pickle import load_dcp_metadata
from lightning_fsdp.checkpoint.integrity.tree import TreeLimitError
from lightning_fsdp.checkpoint.integrity.zip_index import tensor_record_paths

__all__ = ["Objects", "verify_objects", "entry_names"]


class Objects(Protocol):
    kind: str
    target: str  # the checkpoint's URL
    names: set[str]

    def where(self, name: str) -> str: ...

    def size(self, name: str) -> int: ...

    def read(self, name: str, start: int = 0, end: Optional[int] = None) -> bytes: ...

    def windows(self, name: str) -> Iterator[tuple[int, bytes]]: ...


class _Named(str):
    """A URL that the local checks can use where they take a ``Path``, for naming only: ``/`` joins a name,
    ``read_bytes`` gives the bytes already read (no ``Path`` of a URL: it would fold ``s3://`` into ``s3:/``)."""

    data = b""

    def __truediv__(self, name: str) -> "_Named":
        return _Named(f"{self}/{name}")

    def read_bytes(self) -> bytes:
        return self.data


def verify_objects(objects: Objects) -> bool:
    """Check a committed checkpoint of either kind from its objects; False when it carries no checksums. Raises
    :class:`ChecksumError` naming the object and the tensor on the first mismatch, as the local verification does."""
    if objects.kind == "sharded":
        return _verify_sharded(objects)
    (name,) = objects.names or {""}
    return _verify_zip(objects, name)


# ------------------------------------------------------------------------------------------------------- sharded


def _verify_sharded(objects: Objects) -> bool:
    root = _Named(objects.target)
    if DCP_METADATA_FILENAME not in objects.names:
        raise unreadable(root, FileNotFoundError(f"its COMMIT names no {DCP_METADATA_FILENAME}"))
    metadata_bytes = objects.read(DCP_METADATA_FILENAME)
    loaded: list[Any] = []

    def metadata() -> Any:
        if not loaded:
            loaded.append(load_dcp_metadata(objects.where(DCP_METADATA_FILENAME), data=metadata_bytes))
        return loaded[0]

    manifest = _manifest(objects, root, metadata_bytes, metadata)  # first: .metadata must be the save's
    metadata()
    if METADATA_FILENAME in objects.names:
        _verify_zip(objects, METADATA_FILENAME)
    if manifest is None:
        return False
    by_file: dict[str, list] = {}
    for info in metadata().storage_data.values():
        by_file.setdefault(info.relative_path, []).append(info)
    for name, infos in sorted(by_file.items()):
        if name not in objects.names:  # as opening the missing file of a local checkpoint says it (OSError picks
            raise OSError(errno.ENOENT, "No such file or directory", objects.where(name))  # FileNotFoundError)
        cursor = _Cursor(objects.windows(name))
        for info in sorted(infos, key=lambda i: i.offset):
            check = sharded_read._ItemCheck(root, info, manifest)  # noqa: SLF001 - the local check, shared
            check.finish(cursor.feed(info.offset, info.offset + info.length, check.hasher.update))
        cursor.drain()
    return True


def _manifest(objects: Objects, root: _Named, metadata_bytes: bytes,
              metadata: Callable[[], Any]) -> Optional["sharded_read._Manifest"]:
    """:func:`.sharded_read._read_manifest` over objects: the recorded digests, once ``.metadata`` and ``meta.pt``
    are shown to be the save's; None for a checkpoint saved without checksums."""
    def save_id_of_metadata() -> str:
        save_id = getattr(getattr(metadata(), "storage_meta", None), "save_id", None)
        return save_id if isinstance(save_id, str) else ""

    file = root / CHECKSUMS_FILENAME
    if CHECKSUMS_FILENAME not in objects.names:
        if save_id_of_metadata().startswith(SAVE_ID_PREFIX):
            raise ChecksumError(f"{str(file)!r} is missing, though {str(root)!r} was saved with checksums.{DAMAGED_HINT}")
        return None
    file.data = objects.read(CHECKSUMS_FILENAME)
    parsed = sharded_read._parse_manifest(file)  # type: ignore[arg-type]  # noqa: SLF001 - one parser
    save_id, algorithm, files = parsed["save_id"], parsed.get("algorithm", "crc32"), parsed.get("files")
    table = {(f, o): (n, c, name) for f, o, n, c, name in parsed["items"]}
    new_hasher = hasher_factory(algorithm, str(file))
    seed = ALGORITHMS[algorithm][0](str(save_id))
    if files is not None:
        _check_whole_files(objects, root, files, {f for f, _ in table}, lambda: new_hasher(seed), metadata_bytes,
                           save_id_of_metadata, save_id)
    elif str(save_id).startswith(BOUND_SAVE_ID_PREFIX):
        raise ChecksumError(f"{str(file)!r} does not record the digests of the checkpoint's files, though it was"
                            f" saved with them (it was edited, or replaced by an older manifest).{DAMAGED_HINT}")
    if save_id_of_metadata() != save_id:
        raise _other_save(root)
    return sharded_read._Manifest(table, new_hasher, seed, file)  # type: ignore[arg-type]  # noqa: SLF001


def _check_whole_files(objects: Objects, root: _Named, files: dict[str, tuple[int, int]], shard_files: set[str],
                       new_hasher: Callable[[], Any], metadata_bytes: bytes, save_id_of_metadata: Callable[[], str],
                       save_id: str) -> None:
    """:func:`.sharded_read._check_files` over objects (the same messages)."""
    for name in WHOLE_FILES:
        where = root / name
        if name not in files:
            if name in objects.names:
                raise ChecksumError(f"{str(where)!r} is not part of the checkpoint: its save wrote no {name}, so it"
                                    " was put there later (e.g. copied in from another checkpoint). HINT: move it"
                                    " out of the checkpoint directory.")
            continue
        if name not in objects.names:
            raise ChecksumError(f"{str(where)!r} is missing, though the checkpoint was saved with it.{DAMAGED_HINT}")
        hasher, size = new_hasher(), 0
        if name == DCP_METADATA_FILENAME:
            hasher.update(metadata_bytes)
            size = len(metadata_bytes)
        else:
            for _, piece in objects.windows(name):
                hasher.update(piece)
                size += len(piece)
        if (size, hasher.intdigest()) != tuple(files[name]):
            if name == DCP_METADATA_FILENAME and sharded_read._readable_save_id(  # noqa: SLF001
                    save_id_of_metadata) not in (save_id, None):
                raise _other_save(root)
            raise ChecksumError(f"{str(where)!r} does not match the checksum recorded in"
                                f" {str(root / CHECKSUMS_FILENAME)!r} when the checkpoint was saved (one of the two is"
                                f" damaged, or copied in from another checkpoint).{DAMAGED_HINT}")
    for entry in sorted(objects.names):
        if entry.endswith(".distcp") and entry not in shard_files:
            raise ChecksumError(f"{str(root / entry)!r} is not part of the checkpoint: its save wrote no such shard"
                                " file (e.g. it was copied in from a checkpoint saved on more ranks). HINT: move it"
                                " out of the checkpoint directory.")


def _other_save(root: _Named) -> ChecksumError:
    """:func:`.sharded_read._other_save`'s error, for objects."""
    return ChecksumError(f"{str(root / CHECKSUMS_FILENAME)!r} and {str(root / DCP_METADATA_FILENAME)!r} belong to"
                         " different saves (their save ids differ): one of them was copied in from another"
                         f" checkpoint.{DAMAGED_HINT}")


# ------------------------------------------------------------------------------------------- torch.save zip files


_LOCAL_HEADER = struct.Struct("<4s22xHH")  # as zipfiles reads it: signature, ..., name length, extra length


def _verify_zip(objects: Objects, name: str) -> bool:
    """:func:`.zipfiles.verify_zip` over one object: its directory and checksum record by ranges, then every record
    hashed as the object streams past, front to back."""
    where = objects.where(name)
    with _archive(objects, name) as archive:
        records = zipfiles._records(archive, where)  # type: ignore[arg-type]  # noqa: SLF001 - one record table
        if records is None:
            return False
        cursor = _Cursor(objects.windows(name))
        for record in sorted(records, key=lambda r: r.info.header_offset):
            hasher = record.new_hasher(0)
            start = record.info.header_offset
            if start < cursor.position:  # records that overlap: no file torch writes
                raise unreadable(where, ValueError(f"the zip record {record.info.filename!r} overlaps another"))
            header = cursor.read(start, start + _LOCAL_HEADER.size)
            count = -1
            if len(header) == _LOCAL_HEADER.size:
                signature, name_length, extra_length = _LOCAL_HEADER.unpack(header)
                if signature == b"PK\x03\x04":
                    data = start + _LOCAL_HEADER.size + name_length + extra_length
                    count = cursor.feed(data, data + record.info.file_size, hasher.update)
            if count != record.info.file_size or hasher.intdigest() != record.digest:
                raise ChecksumError(f"{where!r} is corrupted: {zipfiles._record_name(archive, record.key)} does"  # noqa: SLF001
                                    f" not match the checksum recorded when it was saved.{DAMAGED_HINT}")
        cursor.drain()
    return True


@contextlib.contextmanager
def _archive(objects: Objects, name: str) -> Iterator[zipfile.ZipFile]:
    """The zip archive of one object, read by ranges (:class:`_RangeFile`). Bytes that are no zip archive raise
    ``CheckpointError`` naming the object, as :func:`.zipfiles._archive` does for a file; a store's own errors
    (``OSError``: it could not be read) pass as they are."""
    file = _RangeFile(objects, name)
    try:
        with zipfile.ZipFile(file) as archive:
            yield archive
    except (CheckpointError, TreeLimitError, OSError):
        raise
    except Exception as err:  # noqa: BLE001 - BadZipFile, struct.error, EOFError, NotImplementedError, ...
        if file.failure is not None:  # zipfile says BadZipFile for any OSError of its reads: the store's, here
            raise file.failure from err
        raise unreadable(objects.where(name), err) from err


class _RangeFile(BlockReader):
    """One object as a seekable file for ``zipfile``, read by ranges. A zip reader reads its end (the directory)
    and a few records; the end is fetched once (the last 1 MiB), other reads in 64 KiB blocks, the two last kept."""

    _TAIL = 2**20
    _BLOCK = 64 * 2**10

    def __init__(self, objects: Objects, name: str) -> None:
        super().__init__()
        self._objects, self._name = objects, name
        self._size = objects.size(name)
        self._pos = 0
        self.failure: Optional[OSError] = None

    def _extent(self) -> int:
        return self._size

    def _fetch_block(self, position: int, want: int) -> tuple[int, bytes]:
        if not self._blocks and self._size - position <= self._TAIL:  # the first read: the end, in one request
            start = max(0, self._size - self._TAIL)
        else:
            start = position
        end = min(self._size, max(position + want, start + self._BLOCK))
        try:
            data = self._objects.read(self._name, start, end)
        except OSError as err:  # the store could not be read: kept, since zipfile turns it into "not a zip file"
            self.failure = err
            raise
        return start, data


# ------------------------------------------------------------------------------------------------- the one pass


class _Cursor:
    """An object's bytes in order, from the windows its source gives, for consumers that ask for increasing ranges:
    bytes nobody asks for are passed over, never kept."""

    def __init__(self, windows: Iterator[tuple[int, bytes]]) -> None:
        self._windows = windows
        self._at, self._data = 0, memoryview(b"")
        self.position = 0  # everything before this was handed out or passed over

    def feed(self, start: int, end: int, update: Callable[[Any], None]) -> int:
        """Hand bytes ``[start, end)`` to ``update`` in pieces; returns how many there were (fewer when the object
        ends first)."""
        position = max(start, self.position)
        while position < end:
            if position >= self._at + len(self._data):
                taken = next(self._windows, None)
                if taken is None:
                    break
                self._at, self._data = taken[0], memoryview(taken[1])
                continue
            first = position - self._at
            last = min(end - self._at, len(self._data))
            update(self._data[first:last])
            position += last - first
        self.position = max(self.position, position)
        return max(0, position - start)

    def read(self, start: int, end: int) -> bytes:
        parts: list[bytes] = []
        self.feed(start, end, lambda piece: parts.append(bytes(piece)))
        return b"".join(parts)

    def drain(self) -> None:
        """Take the rest of the windows: the source checks the object's size (and digest) at its end."""
        for _ in self._windows:
            pass
        self._data = memoryview(b"")


# ----------------------------------------------------------------------------------------- what a checkpoint holds


def entry_names(objects: Objects) -> Optional[set[str]]:
    """The dotted names of the tensors a checkpoint holds (``model.fc.weight``, ``optimizer.state.fc.weight.exp_avg``),
    read from ``.metadata`` (sharded) or the zip's index (full) without any tensor byte; None when that record is
    unreadable (damaged: a load stops before it writes any tensor then)."""
    try:
        if objects.kind == "sharded":
            data = objects.read(DCP_METADATA_FILENAME)
            return set(load_dcp_metadata(objects.where(DCP_METADATA_FILENAME), data=data).state_dict_metadata)
        (name,) = objects.names
        with _archive(objects, name) as archive:
            prefix = archive.namelist()[0].partition("/")[0]
            paths = tensor_record_paths(archive.read(f"{prefix}/data.pkl"), what=repr(objects.where(name)))
        return {".".join(map(str, where)) for where in paths.values()}
    except (CheckpointError, TreeLimitError, zipfile.BadZipFile, KeyError, ValueError, IndexError):
        return None
