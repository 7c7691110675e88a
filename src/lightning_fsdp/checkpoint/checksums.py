"""Checksums that make a corrupted checkpoint raise instead of loading wrong numbers.

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
import io
import json
import mmap
import os
import struct
import threading
import uuid
import warnings
import zipfile
import zlib
from collections import Counter
from dataclasses import dataclass, replace
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, Callable, Iterator, Optional, Union

import torch
import torch.distributed.checkpoint as dcp
import xxhash
from torch.futures import Future

from lightning_fsdp._compat import DCP_READER_ITEM_VIEW
from lightning_fsdp.checkpoint.agreement import CheckpointError, unreadable
from lightning_fsdp.checkpoint.layout import CHECKSUMS_FILENAME, DCP_METADATA_FILENAME, METADATA_FILENAME
from lightning_fsdp.checkpoint.torch_versions import MANIFEST_KEY
from lightning_fsdp.checkpoint.safe_pickle import (
    SafeFileSystemReader,
    UnsafeCheckpointError,
    load_dcp_metadata,
    tensor_record_paths,
)
from lightning_fsdp.checkpoint.tree import TreeLimitError
from lightning_fsdp.checkpoint.write_errors import RecordingFileSystem, WriteRecorder

__all__ = [
    "ChecksumError",
    "ChecksumWriter",
    "VerifyingReader",
    "RecordDigests",
    "new_save_id",
    "verify_zip",
    "verify_loaded",
    "LoadVerifier",
    "verify_sharded",
    "check_files",
    "verify_checkpoint",
    "note_unverified",
]

SAVE_ID_PREFIX = "lightning-fsdp:"
# The save ids of checkpoints whose checksums.json also binds every file (format 2). The id is inside `.metadata`,
# so a checkpoint that says it was saved so cannot pass for an older one without the binding (see `_read_manifest`).
BOUND_SAVE_ID_PREFIX = SAVE_ID_PREFIX + "bound:"
MANIFEST_FORMAT = 2
ZIP_CHECKSUMS_RECORD = "checksums.json"  # the full writer's extra record: {"algorithm": ..., "records": {...}}
_HINT = " HINT: the checkpoint is damaged; load an earlier one, or save this one again."


class ChecksumError(CheckpointError):
    """A checkpoint's bytes do not match the checksums recorded when it was saved."""


def new_save_id() -> str:
    """An id for one save; every rank must use the same one (broadcast it)."""
    return BOUND_SAVE_ID_PREFIX + uuid.uuid4().hex


# --------------------------------------------------------------------------------------------------- algorithms


class _Crc32:
    """zlib's CRC-32 behind the interface of xxhash's hashers. What checkpoints were recorded with before xxh3, and
    what zip records carry."""

    def __init__(self, seed: int = 0) -> None:
        self._value = seed

    def update(self, data: Any) -> None:
        self._value = zlib.crc32(data, self._value)

    def intdigest(self) -> int:
        return self._value


# name -> (the seed of a save id, a hasher from a seed). The name is recorded with the digests.
_ALGORITHMS: dict[str, tuple[Callable[[str], int], Callable[[int], Any]]] = {
    "crc32": (lambda save_id: zlib.crc32(save_id.encode()), _Crc32),
    "xxh3_64": (lambda save_id: xxhash.xxh3_64_intdigest(save_id.encode()), lambda seed: xxhash.xxh3_64(seed=seed)),
}
ALGORITHM = "xxh3_64"  # what new checkpoints record


def _hasher_factory(algorithm: str, where: str) -> Callable[[int], Any]:
    try:
        return _ALGORITHMS[algorithm][1]
    except (KeyError, TypeError):
        raise ChecksumError(f"{where!r} records checksums of the algorithm {algorithm!r}, which this version of"
                            f" lightning-fsdp does not know (it knows {', '.join(_ALGORITHMS)}). HINT: load it with"
                            " the lightning-fsdp version that saved it, or a newer one.") from None


_CHUNK = 8 * 2**20
_MAP_FROM = 64 * 2**10  # below this, a copy costs less than setting up a mapping


def _hash_file_range(fd: int, start: int, end: int, update: Callable[[Any], None]) -> int:
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


def _storage_bytes(storage: torch.UntypedStorage) -> memoryview:
    """The bytes of a CPU storage, without copying them (the caller keeps ``storage`` alive while it uses them)."""
    if not storage.nbytes():
        return memoryview(b"")
    return memoryview((ctypes.c_ubyte * storage.nbytes()).from_address(storage.data_ptr())).cast("B")


# ------------------------------------------------------------------------------------------------------ sharded


class _RunDigests:
    """A write stream that hashes the bytes written between two consecutive ``tell()`` calls (a *run*).

    DCP's writer asks the stream for its position right before and right after each item it writes
    (``_write_item``: ``offset = stream.tell()``, then ``length = stream.tell() - offset``), so each item's bytes are
    exactly one run, hashed while they are still in the cache on their way to the file: nothing is read back. A run
    is known by its ``(start, end)``; :meth:`ChecksumWriter.write_data` looks each item up by its offset and length
    and hashes any item that is not one run (a future DCP that asks for the position more often, or seeks) from the
    file instead, so the digest is always that of the item's bytes.
    """

    def __init__(self, stream: WriteRecorder, new_hasher: Callable[[], Any]) -> None:
        self._stream, self._new_hasher = stream, new_hasher
        self._start = self._position = 0  # DCP opens each file with "wb": writes start at byte 0
        self._hasher = new_hasher()
        self.runs: dict[tuple[int, int], int] = {}
        self.seeked = False

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        written = self._stream.write(view)  # completes short writes, or raises
        self._hasher.update(view[:written])
        self._position += written
        return written

    def tell(self) -> int:
        position = self._stream.tell()
        if position != self._position:
            self.seeked = True  # bytes reached the file some other way: every item of the file is hashed from it
        if position > self._start:
            self.runs[(self._start, position)] = self._hasher.intdigest()
        self._start, self._hasher = position, self._new_hasher()
        return position

    def seek(self, *args: Any) -> int:
        self.seeked = True
        return self._stream.seek(*args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)

    def __enter__(self) -> "_RunDigests":
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stream.close()


class _DigestingFileSystem(RecordingFileSystem):
    """The recording file system (a full disk is named, see ``write_errors``) whose write streams also hash each
    item's bytes as they are written (:class:`_RunDigests`). :meth:`take` hands over the digests by file."""

    def __init__(self) -> None:
        super().__init__()
        self._new_hasher: Callable[[], Any] = lambda: None
        self._files: dict[str, _RunDigests] = {}
        self._files_lock = threading.Lock()

    def start(self, new_hasher: Callable[[], Any]) -> None:
        self._new_hasher, self._files = new_hasher, {}

    @contextmanager
    def create_stream(self, path: Union[str, Path], mode: str) -> Iterator[Any]:
        with super().create_stream(path, mode) as stream:
            if not (isinstance(stream, WriteRecorder) and mode == "wb"):
                yield stream
                return
            digests = _RunDigests(stream, self._new_hasher)
            with self._files_lock:  # DCP's writer threads open files concurrently
                self._files[str(Path(path))] = digests
            yield digests

    def take(self, path: Path) -> Optional[dict[tuple[int, int], int]]:
        """The digests of the runs written to ``path``, or None when they cannot be trusted (or none were taken)."""
        with self._files_lock:
            digests = self._files.pop(str(path), None)
        return None if digests is None or digests.seeked else digests.runs


class ChecksumWriter(dcp.FileSystemWriter):
    """DCP's file writer that also records a digest per item (see the module docstring)."""

    def __init__(self, path: Union[str, Path], *, save_id: str, algorithm: Optional[str] = None, **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        self._save_id = self.save_id = save_id
        self._algorithm = algorithm or ALGORITHM
        # A disk that fills inside one of DCP's `torch.save` records raises only "unexpected pos"; the recording file
        # system keeps the OSError that says why (see `write_errors`), and hashes each item as it is written.
        self.fs = self._recording = _DigestingFileSystem()

    def reset(self, checkpoint_id: Any = None) -> None:
        super().reset(checkpoint_id)
        self.save_id = self._save_id  # DCP draws a fresh id per rank; ours is the same on every rank

    def write_data(self, plan: Any, planner: Any) -> Future:
        seed_of, new_hasher = _ALGORITHMS[self._algorithm]
        seed = seed_of(self._save_id)
        self._recording.start(lambda: new_hasher(seed))
        try:
            results = super().write_data(plan, planner).wait()
        except BaseException as err:
            self._recording.raise_recorded(err)
            raise
        by_file: dict[str, list] = {}
        for result in results:
            by_file.setdefault(result.storage_data.relative_path, []).append(result)
        stamped = []
        for name, items in by_file.items():
            runs = self._recording.take(Path(self.path) / name) or {}
            fd: Optional[int] = None
            try:
                for result in sorted(items, key=lambda r: r.storage_data.offset):
                    info = result.storage_data
                    digest = runs.get((info.offset, info.offset + info.length))
                    if digest is None:  # not one run as written: hash it from the file (page cache)
                        if fd is None:
                            fd = os.open(Path(self.path) / name, os.O_RDONLY)
                        hasher = new_hasher(seed)
                        _hash_file_range(fd, info.offset, info.offset + info.length, hasher.update)
                        digest = hasher.intdigest()
                    # DCP gathers write results to the coordinator as they are; `finish` unpacks them again.
                    stamped.append(replace(result, storage_data=(info, digest)))
            finally:
                if fd is not None:
                    os.close(fd)
        future: Future = Future()  # torch's future, as DCP expects
        future.set_result(stamped)
        return future

    def finish(self, metadata: Any, results: list) -> None:
        items, plain = [], []
        for rank_results in results:
            unpacked = []
            for result in rank_results:
                info, digest = result.storage_data
                items.append([info.relative_path, info.offset, info.length, digest, _item_name(result.index)])
                unpacked.append(replace(result, storage_data=info))
            plain.append(unpacked)
        try:
            super().finish(metadata, plain)  # writes `.metadata`, which the manifest binds too
            # Written last: a staging directory is committed as a whole (`atomic`), so the order only decides what
            # the manifest can record, and it records `.metadata` and `meta.pt` (written before DCP starts).
            seed_of, new_hasher = _ALGORITHMS[self._algorithm]
            files = _file_digests(Path(self.path), lambda: new_hasher(seed_of(self._save_id)))
            manifest = {"format": MANIFEST_FORMAT, "algorithm": self._algorithm, "save_id": self._save_id,
                        "items": items, "files": files,
                        MANIFEST_KEY: torch.__version__}  # names the writer if a later, older torch cannot read it
            with open(Path(self.path) / CHECKSUMS_FILENAME, "w") as file:
                json.dump(manifest, file)
                file.flush()
                os.fsync(file.fileno())
        except BaseException as err:
            self._recording.raise_recorded(err)
            raise


# The files of a sharded checkpoint that are not shard files, each bound to the save by a digest of all its bytes
# seeded with the save id: `.metadata` decides where every item's bytes go, `meta.pt` holds the step and the rest.
_WHOLE_FILES = (DCP_METADATA_FILENAME, METADATA_FILENAME)


def _file_digests(path: Path, new_hasher: Callable[[], Any]) -> dict[str, list[int]]:
    digests = {}
    for name in _WHOLE_FILES:
        if (path / name).is_file():
            digests[name] = _whole_file_digest(path / name, new_hasher)
    return digests


def _whole_file_digest(file: Path, new_hasher: Callable[[], Any]) -> list[int]:
    """``[size, digest]`` of a file's bytes."""
    hasher = new_hasher()
    fd = os.open(file, os.O_RDONLY)
    try:
        size = _hash_file_range(fd, 0, os.fstat(fd).st_size, hasher.update)
    finally:
        os.close(fd)
    return [size, hasher.intdigest()]


def _item_name(index: Any) -> str:
    offsets = list(getattr(index, "offset", None) or [])
    return index.fqn + (f" (chunk at {offsets})" if any(offsets) else "")


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
            raise ChecksumError(f"{str(file)!r} is missing, though {str(path)!r} was saved with checksums.{_HINT}")
        return None
    manifest = _parse_manifest(file)
    save_id, algorithm, files = manifest["save_id"], manifest.get("algorithm", "crc32"), manifest.get("files")
    table = {(f, o): (n, c, name) for f, o, n, c, name in manifest["items"]}
    new_hasher = _hasher_factory(algorithm, str(file))
    seed = _ALGORITHMS[algorithm][0](str(save_id))
    if files is not None:
        _check_files(path, files, {f for f, _ in table}, lambda: new_hasher(seed), save_id_of_metadata, save_id)
    elif str(save_id).startswith(BOUND_SAVE_ID_PREFIX):
        # A save that bound its files, with a manifest that does not: stripping the binding is refused, or every
        # file but the shards could be swapped unseen.
        raise ChecksumError(f"{str(file)!r} does not record the digests of the checkpoint's files, though it was"
                            f" saved with them (it was edited, or replaced by an older manifest).{_HINT}")
    if save_id_of_metadata() != save_id:
        raise _other_save(path)
    return _Manifest(table, new_hasher, seed, file)


def _parse_manifest(file: Path) -> dict[str, Any]:
    """``checksums.json``, with every field of the type a save writes; ``ChecksumError`` naming it otherwise."""
    try:
        manifest = json.loads(file.read_bytes())
    except (ValueError, RecursionError) as err:  # not JSON (UnicodeDecodeError is a ValueError), or nested absurdly
        raise ChecksumError(f"{str(file)!r} is not readable ({type(err).__name__}: {str(err)[:200]}).{_HINT}") from err
    problem = _manifest_problem(manifest)
    if problem:
        raise ChecksumError(f"{str(file)!r} is not readable ({problem}).{_HINT}")
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
    return ""


def _count(value: Any) -> bool:
    """An offset, a length or a digest as a save records it: a non-negative int of at most 64 bits."""
    return type(value) is int and 0 <= value < 2**64


def _other_save(path: Path) -> ChecksumError:
    return ChecksumError(f"{str(path / CHECKSUMS_FILENAME)!r} and {str(path / DCP_METADATA_FILENAME)!r} belong to"
                         " different saves (their save ids differ): one of them was copied in from another"
                         f" checkpoint.{_HINT}")


def _check_files(path: Path, files: dict[str, tuple[int, int]], shard_files: set[str],
                 new_hasher: Callable[[], Any], save_id_of_metadata: Callable[[], str], save_id: str) -> None:
    """Every file of a sharded checkpoint belongs to the save ``files`` (the manifest's) was recorded for: each of
    ``.metadata`` and ``meta.pt`` has the digest recorded for it, or is absent where none was; and every shard file
    in the directory is one the save's items live in."""
    for name in _WHOLE_FILES:
        where = path / name
        if name not in files:
            if where.exists():
                raise ChecksumError(f"{str(where)!r} is not part of the checkpoint: its save wrote no {name}, so it"
                                    " was put there later (e.g. copied in from another checkpoint). HINT: move it"
                                    " out of the checkpoint directory.")
            continue
        if not where.is_file():
            raise ChecksumError(f"{str(where)!r} is missing, though the checkpoint was saved with it.{_HINT}")
        if tuple(_whole_file_digest(where, new_hasher)) != files[name]:
            if name == DCP_METADATA_FILENAME and _readable_save_id(save_id_of_metadata) not in (save_id, None):
                raise _other_save(path)
            raise ChecksumError(f"{str(where)!r} does not match the checksum recorded in"
                                f" {str(path / CHECKSUMS_FILENAME)!r} when the checkpoint was saved (one of the two is"
                                f" damaged, or copied in from another checkpoint).{_HINT}")
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
                                f" checkpoint's .metadata and {str(manifest.file)!r} disagree.{_HINT}")
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
                                f" bytes up to {self.offset + self.length}).{_HINT}")
        if self.hasher.intdigest() != self.digest:
            self._mismatch()

    def _mismatch(self) -> None:
        raise ChecksumError(f"{self.where!r} is corrupted: the bytes of the tensor {self.name!r} do not match the"
                            f" checksum recorded in {self.manifest!r} when the checkpoint was saved (one of the two is"
                            f" damaged, or copied from another checkpoint).{_HINT}")


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


class _ItemSlice(io.RawIOBase):
    """One item of a shard file, as a file of its own for DCP's reader, that hashes the item's bytes in order
    without reading them twice.

    The digest covers the item's bytes ``[0, _hashed)``. A large read that starts at or past ``_hashed`` (torch
    reading a tensor's data into the tensor) first catches the digest up (the few header bytes torch skipped or read
    piecewise, usually still in a cached block), then hashes the buffer piece by piece as it fills it.
    :meth:`finish` hashes what is left and compares. Any read pattern gives the same digest: bytes torch did not
    read, or read in another order, are simply read from the file.
    """

    def __init__(self, fd: int, offset: int, length: int, check: _ItemCheck) -> None:
        super().__init__()
        self._fd, self._base, self._length, self._check = fd, offset, length, check
        self._pos = self._hashed = 0
        self._blocks: list[tuple[int, bytes]] = []  # (start in the item, bytes): the two most recently read

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        start = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._length}[whence]
        self._pos = max(0, start + offset)
        return self._pos

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        want = min(len(view), self._length - self._pos)
        if want <= 0:
            return 0
        if want < _HASH_AS_READ:
            count = self._read_small(view, want)
        else:
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
        self._pos += count
        return count

    def _read_small(self, view: memoryview, want: int) -> int:
        data, start = self._block_at(self._pos, want)
        count = max(0, min(want, start + len(data) - self._pos))
        view[:count] = data[self._pos - start:self._pos - start + count]
        return count

    def _block_at(self, position: int, want: int) -> tuple[bytes, int]:
        """Cached bytes from ``position`` on: at least ``want`` of them unless the item ends first."""
        for start, data in self._blocks:
            if start <= position and position + want <= start + len(data):
                return data, start
        start = position - position % 4096
        data = os.pread(self._fd, min(max(_BLOCK, position + want - start), self._length - start), self._base + start)
        self._blocks = [(start, data), *self._blocks[:1]]
        return data, start

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
            self._hashed += _hash_file_range(self._fd, self._base + self._hashed, self._base + upto,
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
                check.finish(_hash_file_range(fd, info.offset, info.offset + info.length, check.hasher.update))
        finally:
            os.close(fd)
    return True


# ---------------------------------------------------------------------------------------------------- zip files


class RecordDigests:
    """The full writer's extra record: a digest of each tensor record, taken from the bytes as they are written."""

    def __init__(self, algorithm: Optional[str] = None) -> None:
        self.algorithm = algorithm or ALGORITHM
        self._new_hasher = _ALGORITHMS[self.algorithm][1]
        self._digests: dict[str, int] = {}

    @property
    def wanted(self) -> bool:
        return self.algorithm != "crc32"  # the zip's own CRC-32 already is that

    def add(self, record: str, data: torch.UntypedStorage) -> None:
        if self.wanted:
            hasher = self._new_hasher(0)
            hasher.update(_storage_bytes(data))
            self._digests[record] = hasher.intdigest()

    def payload(self) -> bytes:
        return json.dumps({"algorithm": self.algorithm, "records": self._digests}).encode()


_LOCAL_HEADER = struct.Struct("<4s22xHH")  # signature, ..., file name length, extra field length


@dataclass
class _Record:
    info: zipfile.ZipInfo
    key: str  # the name inside the archive's folder, e.g. "data/3"
    new_hasher: Callable[[int], Any]
    digest: int


def _records(archive: zipfile.ZipFile, path: Path) -> Optional[list[_Record]]:
    """The stored records of a ``torch.save`` archive with the digest each must have: the full writer's fast digest
    where it recorded one, else the zip's CRC-32. None when the file records no checksums at all."""
    infos = [i for i in archive.infolist() if i.compress_type == zipfile.ZIP_STORED and not i.is_dir()]
    prefix = infos[0].filename.partition("/")[0] if infos else ""
    digests: dict[str, int] = {}
    table = next((i for i in infos if i.filename == f"{prefix}/{ZIP_CHECKSUMS_RECORD}"), None)
    if table is not None:
        try:
            recorded = json.loads(archive.read(table))  # zipfile checks this record's CRC-32 as it reads it
            fast, digests = _hasher_factory(recorded["algorithm"], str(path)), recorded["records"]
        except (zipfile.BadZipFile, ValueError, KeyError, TypeError) as err:
            raise ChecksumError(f"{str(path)!r} is corrupted: its record {ZIP_CHECKSUMS_RECORD!r} is not readable"
                                f" ({err}).{_HINT}") from err
    crc_written = any(i.CRC for i in infos if i.file_size)  # `torch.serialization.set_crc32_options(False)` writes 0
    if not digests and not crc_written:
        return None
    records = []
    for info in infos:
        key = info.filename.partition("/")[2]
        if key in digests:
            records.append(_Record(info, key, fast, digests[key]))
        elif crc_written:
            records.append(_Record(info, key, _Crc32, info.CRC))
    return records


def _data_offset(file: IO[bytes], info: zipfile.ZipInfo) -> Optional[int]:
    """Where a record's bytes start (after its local header), or None when the header is damaged."""
    file.seek(info.header_offset)
    header = file.read(_LOCAL_HEADER.size)
    if len(header) < _LOCAL_HEADER.size:
        return None
    signature, name_length, extra_length = _LOCAL_HEADER.unpack(header)
    return info.header_offset + _LOCAL_HEADER.size + name_length + extra_length if signature == b"PK\x03\x04" else None


def _check_record(path: Path, archive: zipfile.ZipFile, file: IO[bytes], record: _Record,
                  storage: Optional[torch.UntypedStorage] = None) -> None:
    hasher = record.new_hasher(0)
    if storage is not None:
        hasher.update(_storage_bytes(storage))
        count = storage.nbytes()
    else:
        start = _data_offset(file, record.info)
        count = -1 if start is None else _hash_file_range(file.fileno(), start, start + record.info.file_size,
                                                          hasher.update)
    if count != record.info.file_size or hasher.intdigest() != record.digest:
        raise ChecksumError(f"{str(path)!r} is corrupted: {_record_name(archive, record.key)} does not match the"
                            f" checksum recorded when it was saved.{_HINT}")


def verify_zip(path: Union[str, Path]) -> bool:
    """Check every record of a ``torch.save`` file from the file; False when it records no checksums
    (a ``torch.save`` with ``torch.serialization.set_crc32_options(False)``)."""
    path = Path(path)
    with _archive(path) as (file, archive):
        records = _records(archive, path)
        if records is None:
            return False
        for record in records:
            _check_record(path, archive, file, record)
    return True


@contextmanager
def _archive(path: Path) -> Iterator[tuple[IO[bytes], zipfile.ZipFile]]:
    """The open file and zip archive at ``path``. Bytes that are no zip archive (a truncated file, a damaged
    directory) raise ``CheckpointError`` naming the file, whatever the zip reader raised for them."""
    with open(path, "rb", buffering=0) as file:
        try:
            with zipfile.ZipFile(file) as archive:
                yield file, archive
        except (CheckpointError, TreeLimitError):  # they name the file already
            raise
        except Exception as err:  # noqa: BLE001 - BadZipFile, struct.error, EOFError, NotImplementedError, ...
            raise unreadable(path, err) from err


def verify_loaded(path: Union[str, Path], contents: Any) -> bool:
    """Check every record of a ``torch.save`` file that was just loaded with ``torch.load(mmap=True)`` into
    ``contents``, all at once (see :class:`LoadVerifier` to check each tensor as the load reads it). False when the
    file records no checksums."""
    verifier = LoadVerifier.open(path, contents)
    verifier.finish()
    return verifier.recorded


class LoadVerifier:
    """Checks a ``torch.save`` file loaded with ``torch.load(mmap=True)`` while the load reads it, not before.

    Hashing the whole mapping before a load uses it is a pass of its own over the file: from a cold page cache it
    reads the disk alone, serially, before the load's own reads (32% on a cold full load). Instead the load calls
    :meth:`check` on each tensor just before it reads it (the full load does so as the state-dict API takes each
    model tensor to broadcast it): the hash takes the page faults, the read that follows finds the pages cached,
    and the disk is read once, overlapped with the broadcasts as without verification. :meth:`finish` then checks
    every record nobody asked about (optimizer state, which the state-dict API flattens into dicts of its own,
    0-d tensors, non-tensor records), from the same mapping, and raises for the first mismatch.

    :meth:`check` never raises: a load that fails on one rank in the middle of a broadcast would leave the other
    ranks waiting. So a damaged tensor is still broadcast, and :meth:`finish`, run before the load returns and
    agreed across ranks, raises on every rank.
    """

    def __init__(self, path: Path, records: Optional[list[_Record]], mapped: dict[str, torch.UntypedStorage]) -> None:
        self.path = path
        self.recorded = records is not None
        self._records = {r.key: r for r in records or []}
        self._mapped = mapped
        self._by_address = {storage.data_ptr(): key for key, storage in mapped.items() if storage.nbytes()}
        self._pending = set(self._records)
        self._failed: list[str] = []

    @classmethod
    def open(cls, path: Union[str, Path], contents: Any) -> "LoadVerifier":
        path = Path(path)
        with _archive(path) as (file, archive):
            records = _records(archive, path)
            mapped = _mapped_storages(archive, file, records, contents, repr(str(path))) if records else {}
        return cls(path, records, mapped)

    @classmethod
    def unchecked(cls) -> "LoadVerifier":
        """A verifier that checks nothing and says the file records checksums (for measuring a load without)."""
        verifier = cls(Path(), [], {})
        return verifier

    def check(self, tensor: Any) -> None:
        """Hash the record ``tensor`` was mapped from, unless done already; anything else is ignored."""
        if type(tensor) is not torch.Tensor or tensor.device.type != "cpu":  # e.g. the model's own DTensors
            return
        key = self._by_address.get(tensor.untyped_storage().data_ptr())
        if key is None or key not in self._pending:
            return
        self._pending.discard(key)
        record = self._records[key]
        hasher = record.new_hasher(0)
        hasher.update(_storage_bytes(self._mapped[key]))
        if hasher.intdigest() != record.digest:
            self._failed.append(key)

    def finish(self) -> None:
        """Check every record :meth:`check` did not see; raise :class:`ChecksumError` for the first mismatch."""
        if not self._pending and not self._failed:
            return
        with _archive(self.path) as (file, archive):
            for key in self._failed:
                raise ChecksumError(f"{str(self.path)!r} is corrupted: {_record_name(archive, key)} does not match"
                                    f" the checksum recorded when it was saved.{_HINT}")
            for key in sorted(self._pending, key=lambda k: self._records[k].info.header_offset):
                _check_record(self.path, archive, file, self._records[key], storage=self._mapped.get(key))
            self._pending.clear()


def _mapped_storages(archive: zipfile.ZipFile, file: IO[bytes], records: list[_Record],
                     contents: Any, what: str) -> dict[str, torch.UntypedStorage]:
    """The storage ``torch.load(mmap=True)`` made of each tensor record that ``contents`` still reaches, found
    through the file's index. Only storages that provably are their record's bytes count: with ``mmap=True``
    every storage sits in one mapping of the whole file, at its record's offset, so every storage's address minus
    its record's offset must give the same base address. Any other record is checked from the file."""
    by_key = {r.key: r for r in records}
    prefix = records[0].info.filename.partition("/")[0] if records else ""
    try:
        paths = tensor_record_paths(archive.read(f"{prefix}/data.pkl"), what=what)
    except (zipfile.BadZipFile, KeyError):
        return {}
    found: dict[str, tuple[torch.UntypedStorage, int]] = {}
    for key, where in paths.items():
        record, tensor = by_key.get(f"data/{key}"), _follow(contents, where)
        if record is None or not isinstance(tensor, torch.Tensor) or tensor.device.type != "cpu":
            continue
        storage = tensor.untyped_storage()
        start = _data_offset(file, record.info)
        if start is not None and storage.nbytes() == record.info.file_size:
            found[record.key] = (storage, storage.data_ptr() - start)
    if not found:
        return {}
    base, _ = Counter(b for _, b in found.values()).most_common(1)[0]
    return {key: storage for key, (storage, b) in found.items() if b == base}


def _follow(contents: Any, where: tuple) -> Any:
    for step in where:
        try:
            contents = contents[step]
        except (KeyError, IndexError, TypeError):
            return None
    return contents


def _record_name(archive: zipfile.ZipFile, record: str) -> str:
    """``the tensor 'model.fc.weight' (record data/3)``, or the record alone when the index cannot say."""
    if not record.startswith("data/"):
        return f"the record {record!r}"
    prefix = archive.namelist()[0].partition("/")[0]
    try:
        paths = tensor_record_paths(archive.read(f"{prefix}/data.pkl"))  # zipfile checks data.pkl's own CRC
    except (zipfile.BadZipFile, KeyError, TreeLimitError):  # only names the record: the error says why elsewhere
        paths = {}
    key = record.removeprefix("data/")
    return (f"the tensor {'.'.join(map(str, paths[key]))!r} (record {record!r})" if key in paths
            else f"the record {record!r}")


def verify_checkpoint(path: Union[str, Path]) -> bool:
    """Check a full or sharded checkpoint against its checksums; False when it carries none. Raises
    :class:`ChecksumError` naming the file and the tensor on the first mismatch."""
    from lightning_fsdp.checkpoint.layout import is_sharded_checkpoint

    path = Path(path)
    return verify_sharded(path) if is_sharded_checkpoint(path) else verify_zip(path)

# ---------------------------------------------------------------------------------------------------- the note


_NOTED: set[str] = set()


def note_unverified(path: Path) -> None:
    """Warn once per checkpoint and process that ``path`` carries no checksums, so it loads unchecked."""
    if str(path) in _NOTED:
        return
    _NOTED.add(str(path))
    warnings.warn(f"{str(path)!r} carries no checksums (it was saved before lightning-fsdp recorded them), so"
                  " its integrity is not checked. HINT: save it again to add them.", stacklevel=3)
