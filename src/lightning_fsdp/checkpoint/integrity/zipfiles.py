"""Full checkpoints and ``meta.pt`` (``torch.save`` zip archives): the full writer's per-record digests
(:class:`RecordDigests`), and the checks of a file against them or against the zip's own CRC-32s
(:func:`verify_zip`, :class:`LoadVerifier`; see :mod:`.digests` for the design)."""

from __future__ import annotations

import json
import struct
import zipfile
from collections import Counter
from dataclasses import dataclass
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, Callable, Iterator, Optional, Union

import torch

from lightning_fsdp.checkpoint.formats.commit_order import COMMIT_ORDER_KEY, NEW, order_to_record
from lightning_fsdp.checkpoint.integrity import digests
from lightning_fsdp.checkpoint.integrity.agreement import CheckpointError, unreadable
from lightning_fsdp.checkpoint.integrity.digests import (
    ALGORITHMS, DAMAGED_HINT, ZIP_CHECKSUMS_RECORD, ChecksumError, Crc32, hash_file_range, hasher_factory, storage_bytes,
)
from lightning_fsdp.checkpoint.integrity.zip_index import tensor_record_paths
from lightning_fsdp.checkpoint.integrity.tree import TreeLimitError

__all__ = ["RecordDigests", "verify_zip", "verify_loaded", "LoadVerifier"]

# ---------------------------------------------------------------------------------------------------- zip files


class RecordDigests:
    """The full writer's extra record: a digest of each tensor record, taken from the bytes as they are written."""

    def __init__(self, algorithm: Optional[str] = None, commit_order: Union[int, None, str] = NEW) -> None:
        self.commit_order = commit_order  # a convert keeps its source's (see `commit_order.NEW`)
        self.algorithm = algorithm or digests.ALGORITHM
        self._new_hasher = ALGORITHMS[self.algorithm][1]
        self._digests: dict[str, int] = {}

    @property
    def wanted(self) -> bool:
        return self.algorithm != "crc32"  # the zip's own CRC-32 already is that

    def add(self, record: str, data: torch.UntypedStorage) -> None:
        if self.wanted:
            hasher = self._new_hasher(0)
            hasher.update(storage_bytes(data))
            self._digests[record] = hasher.intdigest()

    def payload(self) -> bytes:
        # Written last, as the archive is finished: it also records the save's commit order (`commit_order`).
        return json.dumps({"algorithm": self.algorithm, "records": self._digests,
                           COMMIT_ORDER_KEY: order_to_record(self.commit_order)}).encode()


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
            fast, digests = hasher_factory(recorded["algorithm"], str(path)), recorded["records"]
        except (zipfile.BadZipFile, ValueError, KeyError, TypeError) as err:
            raise ChecksumError(f"{str(path)!r} is corrupted: its record {ZIP_CHECKSUMS_RECORD!r} is not readable"
                                f" ({err}).{DAMAGED_HINT}") from err
    crc_written = any(i.CRC for i in infos if i.file_size)  # `torch.serialization.set_crc32_options(False)` writes 0
    if not digests and not crc_written:
        return None
    records = []
    for info in infos:
        key = info.filename.partition("/")[2]
        if key in digests:
            records.append(_Record(info, key, fast, digests[key]))
        elif crc_written:
            records.append(_Record(info, key, Crc32, info.CRC))
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
        hasher.update(storage_bytes(storage))
        count = storage.nbytes()
    else:
        start = _data_offset(file, record.info)
        count = -1 if start is None else hash_file_range(file.fileno(), start, start + record.info.file_size,
                                                          hasher.update)
    if count != record.info.file_size or hasher.intdigest() != record.digest:
        raise ChecksumError(f"{str(path)!r} is corrupted: {_record_name(archive, record.key)} does not match the"
                            f" checksum recorded when it was saved.{DAMAGED_HINT}")


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
        hasher.update(storage_bytes(self._mapped[key]))
        if hasher.intdigest() != record.digest:
            self._failed.append(key)

    def finish(self) -> None:
        """Check every record :meth:`check` did not see; raise :class:`ChecksumError` for the first mismatch."""
        if not self._pending and not self._failed:
            return
        with _archive(self.path) as (file, archive):
            for key in self._failed:
                raise ChecksumError(f"{str(self.path)!r} is corrupted: {_record_name(archive, key)} does not match"
                                    f" the checksum recorded when it was saved.{DAMAGED_HINT}")
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
