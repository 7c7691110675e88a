"""A full (one-file) checkpoint in a bucket, read by byte ranges on the one rank that reads it (issue 43 item 3).

A full load reads the file on rank 0 and broadcasts it tensor by tensor; the other ranks need none of its bytes, so
they fetch nothing. Rank 0 fetches no more than the file either, and never to local disk:

1. the zip's tail (EOCD and central directory: one GET, a second one only for a directory larger than it);
2. the index (``data.pkl``) and the full writer's ``checksums.json``, each checked (CRC-32, as ``zipfile`` reads it);
3. the index is unpickled by ``torch.load(map_location="meta")`` from a small archive built in memory with the same
   index and empty data records, under the same rule as every other load (``weights_only`` unless the user allowed
   pickle): every tensor of the checkpoint becomes a meta tensor, which costs no memory and tells its record
   (:func:`~lightning_fsdp._base.compat.meta_record_offset`), dtype, shape, strides and storage offset;
4. each tensor's record is fetched when the load asks for it (:meth:`RemoteFullFile.stream`), in the order it will
   ask, the next ones prefetched (``ranges_in_flight`` GETs, :mod:`.transfers`; neighbouring records merged up to
   ``range_size``, a larger one split), into fresh memory, and checked against its recorded digest.

A record that does not match, or that could not be fetched, never raises in the middle of the load's broadcasts
(the other ranks would wait in them): its tensor is given as zeros and :meth:`RemoteFullFile.finish`, which the load
runs agreed on every rank, raises the first such error. Records the load never asks for (entries not requested)
are not fetched, so not checked either.
"""

from __future__ import annotations

import contextvars
import io
import json
import pickle
import struct
import sys
import threading
import zipfile
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Iterable

import torch

from lightning_fsdp._base.compat import meta_record_offset, open_zipfile_writer
from lightning_fsdp._base.seekable import SizedReader
from lightning_fsdp.checkpoint.integrity.agreement import CheckpointError, unreadable
from lightning_fsdp.checkpoint.integrity.digests import (
    DAMAGED_HINT, ZIP_CHECKSUMS_RECORD, ChecksumError, Crc32, hasher_factory, storage_bytes,
)
from lightning_fsdp.checkpoint.integrity.tree import map_leaves
from lightning_fsdp.checkpoint.integrity.zipfiles import LoadVerifier
from lightning_fsdp.checkpoint.io.remote_errors import retrying
from lightning_fsdp.checkpoint.io.remote_source import RemoteObjects
from lightning_fsdp.checkpoint.io.transfers import transfers

__all__ = ["RemoteFullFile", "CheckedOnRead", "TAIL_BYTES"]

TAIL_BYTES = 16 * 2**10  # the first GET of the zip's end: EOCD and the central directory of ~150 records (a larger
# directory costs one GET more, of exactly its bytes)
_INDEX_SPAN = 64 * 2**10  # the small records torch writes right after the index are fetched with it up to this
_LOCAL_HEADER = struct.Struct("<4s22xHH")  # signature, ..., file name length, extra field length
_MERGE_GAP = 4096  # records this close together are fetched in one GET (data descriptors, small skipped records)


class _Tail(SizedReader):
    """The file as ``zipfile`` sees it while it parses the central directory: seekable, its size COMMIT's, its bytes
    the spans fetched so far; a read outside them fetches what it asks for (the directory of a huge file)."""

    def __init__(self, size: int, fetch: Callable[[int, int], bytes]) -> None:
        self.size, self._fetch, self._pos = size, fetch, 0
        self._spans: list[tuple[int, bytes]] = []

    def add(self, start: int, data: bytes) -> None:
        self._spans.append((start, data))

    def _extent(self) -> int:
        return self.size

    def read(self, n: int = -1) -> bytes:
        end = self.size if n is None or n < 0 else min(self.size, self._pos + n)
        if end <= self._pos:
            return b""
        for start, data in self._spans:
            if start <= self._pos and end <= start + len(data):
                out = data[self._pos - start:end - start]
                break
        else:
            out = self._fetch(self._pos, end)
            self.add(self._pos, out)
        self._pos += len(out)
        return bytes(out)


class RemoteFullFile:
    """One full checkpoint's file in a bucket (``objects``: the committed objects a load registered), read by
    ranges. Open it on the reading rank only; :meth:`load` gives its contents with meta tensors."""

    def __init__(self, objects: RemoteObjects) -> None:
        if len(objects.objects) != 1:
            raise CheckpointError(f"{objects.target!r} is committed as a full checkpoint but its COMMIT names"
                                  f" {len(objects.objects)} objects, not one.{DAMAGED_HINT}")
        self.name = next(iter(objects.objects))
        self.fs, self.target, self.url = objects.fs, objects.target, objects.url(self.name)
        self.size = objects.size(self.name)
        self._retry = getattr(objects, "retry", None) or (lambda step: retrying(self.fs, self.target, "downloading",
                                                                                 step))
        self.fetched = 0  # payload bytes received (what a test compares with the file's size)
        self._lock = threading.Lock()
        self._failures: list[BaseException] = []
        self._open()

    # --- the archive's directory, index and checksums ------------------------------------------------------

    def _read(self, start: int, end: int) -> bytes:
        """Bytes ``[start, end)``: from the end of the file fetched first when they lie there, else fetched."""
        tail_start, tail = getattr(self, "_end", (0, b""))
        if tail and tail_start <= start and end <= tail_start + len(tail):
            return tail[start - tail_start:end - tail_start]
        return self._get(start, end)

    def _get(self, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of the object; fewer than asked is damage (the object is shorter than COMMIT says)."""
        data = self._retry(lambda: self.fs.cat_file(self.url, start=start, end=end))
        with self._lock:
            self.fetched += len(data)
        if len(data) != end - start:
            raise ChecksumError(f"{self.target!r} is corrupted: its file {self.url!r} has fewer bytes than its COMMIT"
                                f" records ({self.size}).{DAMAGED_HINT}")
        return data

    def _open(self) -> None:
        tail = _Tail(self.size, self._get)
        start = max(0, self.size - TAIL_BYTES)
        self._end = (start, self._get(start, self.size) if self.size else b"")
        tail.add(*self._end)
        try:
            archive = zipfile.ZipFile(tail)
        except CheckpointError:
            raise
        except Exception as err:  # noqa: BLE001 - BadZipFile, struct.error, ...: not the archive a save writes
            raise unreadable(self.target, err) from err
        infos = sorted((i for i in archive.infolist() if not i.is_dir()), key=lambda i: i.header_offset)
        if not infos:
            raise unreadable(self.target, ValueError("the archive holds no records"))
        self.prefix = infos[0].filename.partition("/")[0]
        directory = archive.start_dir
        # A record's span runs from its local header to the next record's (or the directory): header, data, and
        # the data descriptor torch's writer puts after it.
        ends = [i.header_offset for i in infos[1:]] + [directory]
        self._records = {i.filename.partition("/")[2]: (i, end) for i, end in zip(infos, ends)}
        for info, end in zip(infos, ends):
            # A record must fit in its span: a size read from a damaged directory never sizes a buffer.
            fits = info.header_offset + _LOCAL_HEADER.size + len(info.orig_filename) + info.file_size <= end
            if info.compress_type != zipfile.ZIP_STORED or not info.header_offset < directory or not fits:
                raise unreadable(self.target, ValueError(f"the record {info.filename!r} is compressed or misplaced"))
        # The index and the small records torch writes beside it (before the first tensor's): one GET.
        index_info, index_end = self._record("data.pkl")
        small = [k for k in ("data.pkl", ".format_version", ".storage_alignment", "byteorder", "version")
                 if k in self._records and self._records[k][0].header_offset >= index_info.header_offset
                 and self._records[k][1] - index_info.header_offset <= _INDEX_SPAN]
        # The index's own span counts even when it is alone: an index over _INDEX_SPAN (hundreds of tensors) leaves
        # `small` empty, and the GET must still cover it.
        end = max([index_end] + [self._records[k][1] for k in small])
        tail.add(index_info.header_offset, self._get(index_info.header_offset, end))
        self._digests: dict[str, tuple[Callable[[int], Any], int]] = {}
        table = self._records.get(ZIP_CHECKSUMS_RECORD)
        try:
            # zipfile checks each record's CRC-32 as it reads it (a record outside the spans fetched is fetched).
            self._small = {k: archive.read(self._records[k][0]) for k in (".format_version", "byteorder")
                           if k in self._records}
            self.index = archive.read(index_info)
            if table is not None:
                tail.add(table[0].header_offset, self._get(table[0].header_offset, table[1]))
                recorded = json.loads(archive.read(table[0]))
                fast = hasher_factory(recorded["algorithm"], self.target)
                self._digests = {k: (fast, int(v)) for k, v in dict(recorded["records"]).items()}
        except CheckpointError:
            raise
        except Exception as err:  # noqa: BLE001 - BadZipFile, EOFError, NotImplementedError (flags), ValueError...
            raise ChecksumError(f"{self.target!r} is corrupted: its index or its record {ZIP_CHECKSUMS_RECORD!r} is"
                                f" not readable ({err}).{DAMAGED_HINT}") from err
        order = self._small.get("byteorder", sys.byteorder.encode()).decode(errors="replace")
        self._swap = order != sys.byteorder  # a file written on a machine of the other byte order
        crc_written = any(i.CRC for i in infos if i.file_size)  # `set_crc32_options(False)` writes 0
        for key, (info, _) in self._records.items():
            if key not in self._digests and crc_written and key.startswith("data/"):
                self._digests[key] = (Crc32, info.CRC)
        self.recorded = bool(self._digests)

    def _record(self, key: str) -> tuple[zipfile.ZipInfo, int]:
        try:
            return self._records[key]
        except KeyError:
            raise unreadable(self.target, KeyError(f"the archive has no record {key!r}")) from None

    def load(self, allow_pickle: bool) -> Any:
        """The checkpoint's contents, every tensor a meta tensor (see the module docstring). ``torch.load``'s own
        errors (a ``weights_only`` refusal) are raised as they are, for the caller to explain."""
        archive = io.BytesIO()
        data_keys = [k for k in self._records if k.startswith("data/")]
        with open_zipfile_writer(archive) as writer:
            # No `.format_version`: torch then asks the archive where each (empty) record starts, which is what
            # tells the records apart (with it, torch computes offsets from the sizes, equal here). No byteorder
            # either: a file of the other byte order is swapped as its records arrive (`_Stream.take`).
            writer.write_record("data.pkl", self.index, len(self.index))
            for key in data_keys:
                writer.write_record(key, b"", 0)
        built = zipfile.ZipFile(archive)
        offsets = {}
        for info in built.infolist():
            archive.seek(info.header_offset)
            _, name_length, extra_length = _LOCAL_HEADER.unpack(archive.read(_LOCAL_HEADER.size))
            offsets[info.header_offset + _LOCAL_HEADER.size + name_length + extra_length] = \
                info.filename.partition("/")[2]
        archive.seek(0)
        try:
            contents = torch.load(archive, map_location="meta", weights_only=not allow_pickle)
        except pickle.UnpicklingError:
            raise  # the allow-list's refusal, in bytes as saved (their CRC-32 matched): the caller explains it
        except Exception as err:  # noqa: BLE001 - an index naming records the directory lacks, ...
            if "weights_only" in str(err):
                raise
            raise unreadable(self.target, err) from err
        self._key_of_offset = offsets
        return contents

    def _data_start(self, span: bytes, info: zipfile.ZipInfo) -> int:
        """Where a record's bytes start in ``span`` (which starts at its local header)."""
        header = span[:_LOCAL_HEADER.size]
        if len(header) < _LOCAL_HEADER.size or header[:4] != b"PK\x03\x04":
            raise ChecksumError(f"{self.target!r} is corrupted: the local header of its record {info.filename!r} is"
                                f" damaged.{DAMAGED_HINT}")
        _, name_length, extra_length = _LOCAL_HEADER.unpack(header)
        return _LOCAL_HEADER.size + name_length + extra_length

    # --- tensors ----------------------------------------------------------------------------------------------

    def key_of(self, tensor: torch.Tensor) -> str:
        """The data record a meta tensor of :meth:`load` stands for."""
        offset = meta_record_offset(tensor.untyped_storage())
        key = self._key_of_offset.get(offset) if offset is not None else None
        if key is None:
            raise RuntimeError("internal error: a meta tensor of a full checkpoint read by ranges names no record;"
                               " please report it with the torch version")
        return key

    def stream(self, tensors: Iterable[torch.Tensor]) -> "_Stream":
        """Fetch the records of the meta ``tensors``, in that order, prefetching ahead; :meth:`_Stream.take` gives
        each as a real tensor."""
        return _Stream(self, [t for t in tensors if _is_meta(t)])

    def materialize(self, obj: Any) -> Any:
        """``obj`` with every meta tensor replaced by its data (fetched, checked; shared records fetched once)."""
        found: list[torch.Tensor] = []
        map_leaves(obj, lambda leaf, _: found.append(leaf) if _is_meta(leaf) else None, what=repr(self.target))
        stream = self.stream(found)
        try:
            return map_leaves(obj, lambda leaf, _: stream.take(leaf) if _is_meta(leaf) else leaf,
                              what=repr(self.target))
        finally:
            stream.close()

    def failed(self, err: BaseException) -> None:
        with self._lock:
            self._failures.append(err)

    def finish(self) -> None:
        """Raise the first error of a record fetched for this load (damage, or the store failing), if any."""
        if self._failures:
            raise self._failures[0]

    def check_record(self, key: str, data: torch.Tensor) -> None:
        recorded = self._digests.get(key)
        if recorded is None:
            return
        new_hasher, digest = recorded
        hasher = new_hasher(0)
        hasher.update(storage_bytes(data.untyped_storage()))
        if hasher.intdigest() != digest:
            raise ChecksumError(f"{self.target!r} is corrupted: {self._describe(key)} does not match the checksum"
                                f" recorded when it was saved.{DAMAGED_HINT}")

    def _describe(self, key: str) -> str:
        from lightning_fsdp.checkpoint.integrity.zip_index import tensor_record_paths

        paths = tensor_record_paths(self.index, what=repr(self.target))
        name = key.removeprefix("data/")
        return (f"the tensor {'.'.join(map(str, paths[name]))!r} (record {key!r})" if name in paths
                else f"the record {key!r}")


def _is_meta(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.device.type == "meta"


class CheckedOnRead(dict):
    """A model's full state dict on rank 0 (the full load's) that hands each tensor to its file's reader as the
    state-dict API takes it to broadcast it (``state_dict[key]``): a local file's record is hashed right before the
    broadcast reads the same pages (:class:`~lightning_fsdp.checkpoint.integrity.zipfiles.LoadVerifier`); a file in
    a bucket gives the record's data, fetched (the next ones prefetched, in this dict's order) and checked as it
    arrives (:class:`RemoteFullFile`)."""

    def __init__(self, entries: dict[str, Any], reader: Any) -> None:
        super().__init__(entries)
        self._check = reader.check if isinstance(reader, LoadVerifier) else None
        self._stream = None if self._check is not None else reader.stream(v for v in entries.values()
                                                                          if isinstance(v, torch.Tensor))

    def __getitem__(self, key: str) -> Any:
        value = super().__getitem__(key)
        if self._check is not None:
            self._check(value)
            return value
        return self._stream.take(value) if isinstance(value, torch.Tensor) and value.device.type == "meta" else value

    def close(self) -> None:
        """End the prefetch threads (entries a non-strict load skipped are never taken)."""
        if self._stream is not None:
            self._stream.close()


class _Stream:
    """The records of a list of meta tensors, fetched in the order they will be taken: neighbouring records merged
    into one GET up to ``range_size``, larger ones split into ``range_size`` pieces, at most ``ranges_in_flight``
    GETs and ``2 * range_size`` bytes fetched ahead of the one taken."""

    def __init__(self, file: RemoteFullFile, tensors: list[torch.Tensor]) -> None:
        self.file = file
        settings = transfers()
        self._range, self._window, self._ahead = settings.range_size, settings.ranges_in_flight, 2 * settings.range_size
        order: list[str] = []
        self._uses: dict[str, int] = {}  # tensors still to take, per record (views and ties share one)
        for tensor in tensors:
            key = file.key_of(tensor)
            if key not in self._uses:
                order.append(key)
            self._uses[key] = self._uses.get(key, 0) + 1
        self._units: list[tuple[int, int]] = []  # byte ranges, in the order they are needed
        self._unit_of: dict[str, list[int]] = {}
        self._readers: dict[int, int] = {}  # records not taken yet, per unit: its bytes go when none is left
        for key in order:
            info, end = file._record(key)
            start, last = info.header_offset, (self._units[-1] if self._units else None)
            if (last is not None and end - start < self._range and 0 <= start - last[1] <= _MERGE_GAP
                    and end - last[0] <= self._range and self._readers[len(self._units) - 1] > 0):
                self._units[-1] = (last[0], end)
                self._unit_of[key] = [len(self._units) - 1]
            else:
                self._unit_of[key] = []
                for piece in range(start, end, self._range):
                    self._units.append((piece, min(piece + self._range, end)))
                    self._unit_of[key].append(len(self._units) - 1)
                    self._readers[len(self._units) - 1] = 0
            for unit in self._unit_of[key]:
                self._readers[unit] += 1
        self._pending: dict[int, Future] = {}
        self._next = 0  # the next unit to start
        self._kept: dict[str, torch.Tensor] = {}  # records taken that another tensor still shares
        self._pool = (ThreadPoolExecutor(self._window, thread_name_prefix="lightning-fsdp-full-read")
                      if self._units else None)

    def _start_ahead(self, needed: int) -> None:
        """Start every unit up to ``needed`` (wanted now), then more while the window allows."""
        while self._next < len(self._units):
            start, end = self._units[self._next]
            held = sum(self._units[i][1] - self._units[i][0] for i in self._pending)
            if self._next > needed and (len(self._pending) >= self._window or held + end - start > self._ahead):
                return
            # In the caller's context: its retry budget (remote_errors.one_budget) bounds these GETs too, rather
            # than each thread starting a fresh one.
            self._pending[self._next] = self._pool.submit(contextvars.copy_context().run, self.file._read, start, end)
            self._next += 1

    def take(self, tensor: torch.Tensor) -> torch.Tensor:
        """The data of the meta ``tensor``, as a CPU tensor of its dtype, shape, strides and offset (zeros when its
        record failed: the error is kept for :meth:`RemoteFullFile.finish`)."""
        key = self.file.key_of(tensor)
        data = self._kept.pop(key, None)
        if data is None:
            data = self._fetch(key)
        self._uses[key] = self._uses.get(key, 1) - 1
        if self._uses[key] > 0:
            self._kept[key] = data
        nbytes = tensor.untyped_storage().nbytes()
        if data.numel() != nbytes:  # the index says another size than the record has: damage
            self.file.failed(ChecksumError(f"{self.file.target!r} is corrupted: {self.file._describe(key)} holds"
                                           f" {data.numel()} bytes, its index says {nbytes}.{DAMAGED_HINT}"))
            data = torch.zeros(nbytes, dtype=torch.uint8)
        if tensor.numel() == 0:
            return torch.empty(tensor.shape, dtype=tensor.dtype)
        if self.file._swap:  # each element's bytes in the other order
            data = data.view(-1, tensor.element_size()).flip(1).contiguous().view(-1)
        return data.view(tensor.dtype).as_strided(tensor.shape, tensor.stride(), tensor.storage_offset())

    def _fetch(self, key: str) -> torch.Tensor:
        info, end = self.file._record(key)
        try:
            units = self._unit_of.get(key)
            if units is None:  # a record the plan did not list: fetched on its own
                spans = [(info.header_offset, self.file._read(info.header_offset, end))]
            else:
                self._start_ahead(units[-1])
                spans = [(self._units[u][0], self._pending[u].result()) for u in units]
                for unit in units:
                    self._readers[unit] -= 1
                    if not self._readers[unit]:
                        del self._pending[unit]
            first_start, first = spans[0]
            at = info.header_offset - first_start
            start = info.header_offset + self.file._data_start(first[at:at + 1024], info)
            # The local header's lengths may differ from the directory's (which the fits check in `_open` used): the
            # record's bytes must still lie within its span, and the spans fetched must cover all of them, or part of
            # `out` would stay uninitialised memory when the file has no checks to catch it.
            out = torch.empty(info.file_size, dtype=torch.uint8)
            view, covered = out.numpy(), 0  # the spans (disjoint: a plan's units are) copied into `out`
            for span_start, span in spans if start + info.file_size <= end else ():
                lo, hi = max(start, span_start), min(start + info.file_size, span_start + len(span))
                if lo < hi:
                    view[lo - start:hi - start] = memoryview(span)[lo - span_start:hi - span_start]
                    covered += hi - lo
            if covered != info.file_size:
                raise ChecksumError(f"{self.file.target!r} is corrupted: the local header of its record"
                                    f" {info.filename!r} places its {info.file_size} bytes outside the record's span"
                                    f" [{info.header_offset}, {end}).{DAMAGED_HINT}")
            self.file.check_record(key, out)
            return out
        except Exception as err:  # noqa: BLE001 - raised by `finish`, on every rank (see the module docstring)
            self.file.failed(err)
            return torch.zeros(info.file_size, dtype=torch.uint8)

    def close(self) -> None:
        if self._pool is not None:
            for future in self._pending.values():
                future.cancel()
            self._pool.shutdown(wait=True)
            self._pending.clear()
