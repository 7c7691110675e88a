"""Sharded loads from object storage, the reading side (issue 43): each rank reads the byte ranges of the items it
needs, straight into memory, checks them, and copies them into the destination tensors. No shard file is fetched
whole and nothing is written to local disk.

:class:`StreamingReader` is the :class:`.sharded_read.VerifyingReader` of a checkpoint whose shard files are in a
bucket: ``.metadata``, ``checksums.json`` and ``meta.pt`` are in the local "skeleton" folder it is given (the
store fetched them), the shards are read through ``fetch`` (the io layer's ranged reads, passed in: this layer
does not import ``checkpoint.io``). Per DCP ``ReadItem``:

- **items with block digests** (``checksums.json``'s ``"payloads"`` row for the item, the streaming writer's): the
  tensor's raw bytes (the payload) in pieces of whole blocks, at most ``piece_size`` each; every block is checked
  against its digest as its piece arrives, then the piece is taken as a flat run of elements (``torch.frombuffer``
  with the dtype and chunk shape ``.metadata`` records, or the dtype the item's own pickle names where a read of the
  whole item sees that they differ: :func:`_pickled_dtype`) and its elements that the read wants are
  copied into the destination, whatever its dtype, strides or device. A read of the whole chunk fetches the whole
  item and also checks the item digest across the pieces in order (the zip records around the payload); a read of
  part of it (a resharded load) fetches only the blocks that hold its rows (dimension 0). Nothing item-sized is
  held: at most the fetch's window and one piece (the previous reader assembled the item, copied it for
  ``torch.load`` and loaded a third copy: 3x the largest item);
- **other items** (an old checkpoint with no block digests, an empty tensor, a byte item): the item's bytes
  ``[offset, offset + length)``, checked against its recorded digest *before* anything is unpickled or copied,
  then ``torch.load`` (torch's allow-list) reading straight from those bytes, narrowed, copied.

Each reader notes which items it checked whole against their digests (:func:`verified_items`): when the ranks of a
load together checked every item ``checksums.json`` lists, the load has verified the checkpoint as
``FsspecStore.verify`` would, and ``load_checkpoint`` marks it trusted so that retention does not read it again.
"""

from __future__ import annotations

import io
import json
import math
import os
import re
import threading
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch
from torch.distributed.checkpoint.metadata import StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType
from torch.futures import Future

from lightning_fsdp._base.seekable import SizedReader
from lightning_fsdp.checkpoint.formats.layout import CHECKSUMS_FILENAME, DCP_METADATA_FILENAME
from lightning_fsdp.checkpoint.integrity.digests import DAMAGED_HINT, ChecksumError
from lightning_fsdp.checkpoint.integrity.safe_pickle import load_dcp_metadata
from lightning_fsdp.checkpoint.integrity.sharded_read import VerifyingReader, _ItemCheck, _read_manifest

__all__ = ["StreamingReader", "parse_payloads", "verified_items", "MIN_BLOCK", "MAX_BLOCK"]

MIN_BLOCK, MAX_BLOCK = 64 * 2**10, 16 * 2**20  # the block sizes a save may record (common contract, issue 43)
# The most payload bytes one need asks for (whole blocks; one block when a block is larger): the default range_size,
# so that a piece is served from one request's body, never assembled across requests; consecutive pieces merge into
# requests of up to range_size at the fetch. With a smaller range_size a piece is assembled, still at most this.
PIECE = 8 * 2**20

# fetch(needs): needs are (object name, start, end, consume(memoryview)); every consume is called on this thread,
# in order of (object name, start): a block read hashes an item's bytes in order across its needs.
Fetch = Callable[[list], None]

# Per skeleton folder (a load's own, new for every load): the items checksums.json lists, in one order every rank
# shares, and those this process's reader checked whole against their digests.
_VERIFIED: dict[str, tuple[list[tuple[str, int]], set[tuple[str, int]]]] = {}
_VERIFIED_LOCK = threading.Lock()


def verified_items(path: Union[str, Path]) -> Optional[tuple[list[tuple[str, int]], set[tuple[str, int]]]]:
    """``(every item checksums.json lists, sorted; the items this process's reader checked whole)`` for the load
    whose skeleton folder is ``path``, forgotten once asked; None when no reader of it checked digests (a checkpoint
    saved without them, or no read). A partly read item (some blocks of a resharded load) is not counted."""
    with _VERIFIED_LOCK:
        return _VERIFIED.pop(os.path.realpath(os.fspath(path)), None)


def parse_payloads(manifest: Any, where: str) -> dict[tuple[str, int], tuple[int, int, list[int]]]:
    """``checksums.json``'s ``"payloads"`` (absent: none) as {(file, item offset): (payload start, block size,
    digests)}, every field checked for type and bounds; ``ChecksumError`` naming the file otherwise. The counts are
    checked against ``.metadata`` where an item is read (:meth:`StreamingReader._payload`)."""
    if not isinstance(manifest, dict) or "payloads" not in manifest:
        return {}
    rows = manifest["payloads"]

    def bad(why: str) -> ChecksumError:
        return ChecksumError(f"{where!r} is not readable (its payloads {why}).{DAMAGED_HINT}")

    if not isinstance(rows, list):
        raise bad("are not a list")
    table: dict[tuple[str, int], tuple[int, int, list[int]]] = {}
    for row in rows:
        if not (isinstance(row, list) and len(row) == 5 and isinstance(row[0], str) and isinstance(row[4], list)
                and all(_count(v) for v in row[1:4]) and all(_count(d) for d in row[4])):
            raise bad(f"hold {str(row)[:100]}, which is not [file, item_offset, payload_start, block_size, digests]")
        file, offset, start, block, digests = row
        if not (MIN_BLOCK <= block <= MAX_BLOCK and block & (block - 1) == 0):
            raise bad(f"give the item at byte {offset} of {file!r} a block size of {block}, not a power of two"
                      f" from {MIN_BLOCK} to {MAX_BLOCK}")
        if (file, offset) in table:
            raise bad(f"list the item at byte {offset} of {file!r} twice")
        table[(file, offset)] = (start, block, digests)
    return table


def _count(value: Any) -> bool:
    return type(value) is int and 0 <= value < 2**64


class StreamingReader(VerifyingReader):
    """A :class:`VerifyingReader` whose shard bytes come from ``fetch`` by ranges (see the module).

    ``url_of(file)``: the object URL of a shard file, for errors. Damage is raised before any byte of the damaged
    item (or block) is copied into the destination, naming the object's URL and the tensor; damage in the zip
    records around a payload read by blocks, once the item's last byte is in. ``piece_size``: see :data:`PIECE`.
    """

    def __init__(self, path: Union[str, Path], *, fetch: Fetch, url_of: Callable[[str], str],
                 allow_pickle: bool = False, piece_size: Optional[int] = None,
                 prefetch: Optional[Callable[[list], Any]] = None) -> None:
        super().__init__(path, allow_pickle=allow_pickle)
        self._fetch, self._url_of = fetch, url_of
        # prefetch(spans) starts the requests of those (object, start, end) at once and returns what serves them
        # (``serve(needs)``, ``cancel()``): the io layer's ranged reads, passed in as ``fetch`` is.
        self._prefetch = prefetch
        self._started: Optional[Any] = None
        self._piece = piece_size or PIECE
        self._metadata: Any = None
        self._payloads: Optional[dict] = None
        self._noted: Optional[tuple[list, set]] = None
        self._adopted: Any = None  # `.metadata` as the load unpickled it (adopt_metadata), for DCP's read_metadata

    def adopt_metadata(self) -> Optional[tuple[bool, Any]]:
        """``.metadata`` unpickled with the allow-list, once, and the files checked with it (``check_files``'s check),
        both kept for DCP's :meth:`read_metadata` and :meth:`set_up_storage_reader` (each was read two or three times
        before the first GET). ``(whether the checkpoint carries checksums, the metadata)``; None where the bytes do
        not unpickle: the caller's own file check then names the damage first, as it always has."""
        try:
            metadata = load_dcp_metadata(Path(self.path) / DCP_METADATA_FILENAME)
        except Exception:  # noqa: BLE001 (raised again, in its place, by the caller's checks)
            return None
        if getattr(metadata, "storage_meta", None) is None:  # an old file: stamped as read_metadata stamps it
            metadata.storage_meta = StorageMeta()
        self._manifest = _read_manifest(Path(self.path), metadata)
        self._manifest_for = metadata.storage_meta.save_id
        self._adopted = metadata
        return self._manifest is not None, metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        adopted, self._adopted = self._adopted, None  # once: a second load through this reader parses again
        if adopted is None or kwargs.get("rank") is not None:
            return super().read_metadata(*args, **kwargs)
        adopted.storage_meta.load_id = self.load_id  # what the file reader stamps after unpickling
        return adopted

    def set_up_storage_reader(self, metadata: Any, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        self._metadata = metadata
        self._payloads = None
        self._noted = None if self._manifest is None else (sorted(self._manifest.items), set())
        if self._noted is not None:
            with _VERIFIED_LOCK:
                _VERIFIED[os.path.realpath(os.fspath(self.path))] = self._noted

    def _manifest_url(self) -> str:
        try:
            return self._url_of(CHECKSUMS_FILENAME)
        except KeyError:
            return str(self._manifest.file)

    def _payload_table(self) -> dict:
        if self._payloads is None:
            self._payloads = {}
            if self._manifest is not None:  # block digests are trusted only where the item digests are
                file = Path(self.path) / CHECKSUMS_FILENAME
                # Already parsed and checked as a whole by the manifest's reader; only the new key is read here.
                self._payloads = parse_payloads(json.loads(file.read_bytes()), self._manifest_url())
        return self._payloads

    def prepare_local_plan(self, plan: Any) -> Any:
        """The rank's own plan, known before DCP's planning gathers and scatters the plans of every rank (about a
        tenth of a second of a load in ``benchmarks/object_storage.py``): the first window of its requests starts
        now, and :meth:`read_data` serves them when the plan it gets reads the same bytes (a load's plan comes back
        as it went). Where the needs cannot be made here (damaged records), nothing starts: read_data says why."""
        plan = super().prepare_local_plan(plan)
        self.cancel()
        if self._prefetch is not None:
            try:
                spans = [n[:3] for item in plan.items for n in self._needs(item, None)]
            except Exception:  # noqa: BLE001 (read_data makes the same needs and raises the error where it belongs)
                spans = None
            if spans:
                self._started = self._prefetch(spans)
        return plan

    def cancel(self) -> None:
        """Stop the requests :meth:`prepare_local_plan` started and give their memory back (a load that failed
        before it read)."""
        started, self._started = self._started, None
        if started is not None:
            started.cancel()

    def read_data(self, plan: Any, planner: Any) -> Future:
        started, self._started = self._started, None
        try:
            needs: list = []
            for item in plan.items:
                needs += self._needs(item, planner)
            # Every consume runs on this thread: with autograd off, DCP's lookup of each destination takes a
            # DTensor's local tensor as it is (to_local() through an autograd Function otherwise: a tenth of the
            # calling thread's time in a load of benchmarks/object_storage.py, py-spy, 2026-11-29), and the copies
            # record nothing.
            with torch.no_grad():
                if started is not None and sorted(n[:3] for n in needs) == started.spans:
                    started, serving = None, started
                    serving.serve(needs)
                else:
                    if started is not None:  # started for another plan: its window goes before this one is made
                        started, stale = None, started
                        stale.cancel()
                    self._fetch(needs)
        finally:
            if started is not None:  # started for another plan: its requests are dropped
                started.cancel()
        future: Future = Future()
        future.set_result(None)
        return future

    # --- one ReadItem -----------------------------------------------------------------------------------------

    def _needs(self, item: Any, planner: Any) -> list:
        sinfo = self.storage_data[item.storage_index]
        check = None
        if self._manifest is not None:
            check = _ItemCheck(Path(self.path), sinfo, self._manifest)  # raises when the records disagree
            # Named by their URLs: the skeleton's path differs on every rank, and the agreed error is one rank's.
            check.where, check.manifest = self._url_of(sinfo.relative_path), self._manifest_url()
        if item.type != LoadItemType.BYTE_IO and check is not None:
            recorded = self._payload_table().get((sinfo.relative_path, sinfo.offset))
            if recorded is not None:
                blocks = _BlockRead.of(self, item, planner, sinfo, check, recorded)
                if blocks is not None:
                    return blocks.needs()
        return [(sinfo.relative_path, sinfo.offset, sinfo.offset + sinfo.length,
                 lambda view: self._whole(item, planner, view, check))]

    def _whole(self, item: Any, planner: Any, view: memoryview, check: Optional[_ItemCheck]) -> None:
        if check is not None:
            check.hasher.update(view)
            check.finish(len(view))
            self._note(item, check)
        if item.type == LoadItemType.BYTE_IO:
            planner.load_bytes(item, io.BytesIO(view))
            return
        tensor = torch.load(_ViewFile(view), map_location="cpu", weights_only=True)
        _copy(item, planner, _narrow(tensor, item.storage_offsets, item.lengths))

    def _note(self, item: Any, check: _ItemCheck) -> None:
        """Count the item as checked whole against its digest (every consume runs on the thread of read_data)."""
        if self._noted is not None:
            self._noted[1].add((self.storage_data[item.storage_index].relative_path, check.offset))

    def _chunk(self, item: Any) -> tuple[Optional[list[int]], Any]:
        """The saved chunk's shape and dtype, from ``.metadata``; (None, None) when it records none."""
        entry = getattr(self._metadata, "state_dict_metadata", {}).get(item.storage_index.fqn)
        chunks = getattr(entry, "chunks", None)
        if not chunks:
            return None, None
        offset = list(item.storage_index.offset or ())
        for chunk in chunks:
            if list(chunk.offsets) == offset:
                return list(chunk.sizes), entry.properties.dtype
        return None, None


class _BlockRead:
    """One ReadItem of an item with block digests, read in pieces of whole blocks (see the module).

    The pieces of one read are consumed in order of offset (the fetch's promise), so the item digest of a whole read
    sees the item's bytes in order: the zip records before the payload, the pieces, the records after it."""

    def __init__(self, reader: StreamingReader, item: Any, planner: Any, sinfo: Any, check: _ItemCheck,
                 chunk: list[int], dtype: torch.dtype, recorded: tuple[int, int, list[int]]) -> None:
        self.reader, self.item, self.planner, self.sinfo, self.check = reader, item, planner, sinfo, check
        self.chunk, self.dtype = chunk, dtype
        self.start, self.block, self.digests = recorded
        self.offsets = [int(o) for o in item.storage_offsets]
        self.lengths = [int(n) for n in item.lengths]
        self.itemsize = torch.empty((), dtype=dtype).element_size()
        self.payload = math.prod(chunk) * self.itemsize
        self.whole = self.offsets == [0] * len(chunk) and self.lengths == chunk
        self.target: Optional[torch.Tensor] = None
        self.flat: Optional[torch.Tensor] = None  # the destination's bytes, where a piece is copied as bytes
        self.hashed = 0
        self.unpickled: Optional[bytearray] = None  # the item's bytes, where it must be read as a whole (_head)

    @classmethod
    def of(cls, reader: StreamingReader, item: Any, planner: Any, sinfo: Any, check: _ItemCheck,
           recorded: tuple[int, int, list[int]]) -> Optional["_BlockRead"]:
        """The block read of ``item``, or None to read it whole (``.metadata`` records no chunk for it, or the read
        wants no element). Payload records that do not fit ``.metadata`` are a ``ChecksumError``."""
        chunk, dtype = reader._chunk(item)
        if chunk is None or len(item.storage_offsets) != len(chunk) or not all(int(n) for n in item.lengths):
            return None
        read = cls(reader, item, planner, sinfo, check, chunk, dtype, recorded)
        blocks = -(-read.payload // read.block)
        inside = all(0 <= o and o + n <= c for o, n, c in zip(read.offsets, read.lengths, chunk))
        if not read.payload or read.start + read.payload > sinfo.length or len(read.digests) != blocks or not inside:
            if read.whole and inside:
                # Read whole and unpickled, as the previous reader did with every whole chunk: the row may be right
                # and .metadata stale (DCP's cached save plan keeps a tensor's old dtype, see _pickled_dtype).
                return None
            raise ChecksumError(f"{check.manifest!r} is not readable (its payloads record, for the tensor"
                                f" {check.name!r} at byte {sinfo.offset} of {check.where!r}, {len(read.digests)} blocks"
                                f" of {read.block} bytes from byte {read.start}, where .metadata gives it"
                                f" {read.payload} bytes (shape {chunk}, {dtype}) in an item of {sinfo.length}, read"
                                f" at {read.offsets} for {read.lengths}).{DAMAGED_HINT}")
        return read

    def needs(self) -> list:
        name, item_at = self.sinfo.relative_path, self.sinfo.offset
        base = item_at + self.start  # the payload's first byte in the object
        if self.whole:
            begin, end = 0, self.payload
        else:  # the blocks holding the rows wanted (dimension 0): their bounding run
            row = math.prod(self.chunk[1:]) * self.itemsize
            first, count = self.offsets[0], self.lengths[0]
            begin = first * row // self.block * self.block
            end = min(-(-(first + count) * row // self.block) * self.block, self.payload)
        step = max(self.block, self.reader._piece // self.block * self.block)
        needs: list = []
        high = min(end, begin + step)
        if self.whole and self.start:
            needs.append((name, item_at, base, self._head))
            # The zip records before the payload and the first piece within one piece's bytes: the fetch merges
            # them into one request of at most range_size (else the records would cost a request of their own).
            high = min(end, max(self.block, (step - self.start) // self.block * self.block))
        low = begin
        while low < end:
            needs.append((name, base + low, base + high, lambda view, low=low: self._piece(low, view)))
            low, high = high, min(end, high + step)
        tail = item_at + self.sinfo.length
        if self.whole and base + self.payload < tail:
            needs.append((name, base + self.payload, tail, self._tail))
        else:  # the last piece ends the read (a payload at the item's very end: never in a torch.save zip)
            last = needs[-1]
            needs[-1] = (*last[:3], lambda view, consume=last[3]: (consume(view), self._finish()))
        return needs

    def _head(self, view: memoryview) -> None:
        """The zip records before the payload (the pickle among them), before any piece: a dtype that differs from
        ``.metadata``'s is the bytes' own (what ``torch.load`` would give). One of another size makes the payload's
        length another, so its blocks are not where ``.metadata`` puts them: the item (the needs cover all of it) is
        then kept and read whole, as the previous reader read every item."""
        pickled = _pickled_dtype(bytes(view))
        if pickled is not None and pickled != self.dtype:
            if torch.empty((), dtype=pickled).element_size() != self.itemsize:
                self.unpickled = bytearray(view)
                return
            self.dtype = pickled
        self._hash(view)

    def _tail(self, view: memoryview) -> None:
        if self.unpickled is not None:
            self.unpickled += view
        else:
            self._hash(view)
        self._finish()

    def _hash(self, view: memoryview) -> None:
        self.check.hasher.update(view)
        self.hashed += len(view)

    def _piece(self, low: int, view: memoryview) -> None:
        """Bytes ``[low, low + len(view))`` of the payload: each block checked, then copied where the read wants."""
        if self.unpickled is not None:
            self.unpickled += view
            return
        check = self.check
        for at in range(0, len(view), self.block):
            part = view[at:at + self.block]
            hasher = self.reader._manifest.hasher()
            hasher.update(part)
            index = (low + at) // self.block
            if hasher.intdigest() != self.digests[index]:  # before any byte of the block reaches the destination
                first = self.sinfo.offset + self.start + low + at
                raise ChecksumError(f"{check.where!r} is corrupted: block {index} (bytes {first} to"
                                    f" {first + len(part)}) of the tensor {check.name!r} does not match the checksum"
                                    f" recorded in {check.manifest!r} when the checkpoint was saved.{DAMAGED_HINT}")
        if self.whole:
            self._hash(view)
        if self.target is None:
            self.target = self.planner.resolve_tensor(self.item).detach()
            if list(self.target.size()) != self.lengths:
                raise ChecksumError(f"the checkpoint's piece of {self.item.dest_index.fqn!r} has shape"
                                    f" {self.lengths}, where the load expects {list(self.target.size())}: its .metadata"
                                    f" does not describe its bytes.{DAMAGED_HINT}")
            if self.whole and self.target.dtype == self.dtype and self.target.is_contiguous():
                # The destination holds the chunk's bytes in the payload's order: each piece is one byte copy into
                # it, wherever the piece lies in memory (a payload's offset in an object is rarely a multiple of its
                # element size, and a typed view of it needed a copy of the piece first).
                self.flat = self.target.reshape(-1).view(torch.uint8)
        data = torch.frombuffer(view, dtype=torch.uint8)
        if self.flat is not None:
            self.flat[low:low + len(view)].copy_(data)
            return
        if data.data_ptr() % self.itemsize:  # the piece starts unaligned in the request's buffer: an aligned copy
            data = data.clone()
        _scatter(self.target, data.view(self.dtype), low // self.itemsize, self.chunk, self.offsets)

    def _finish(self) -> None:
        if self.unpickled is not None:  # checked against the item digest before it is unpickled or copied
            self.reader._whole(self.item, self.planner, memoryview(self.unpickled), self.check)
            return
        if self.whole:
            self.check.finish(self.hashed)  # damage in the zip records around the payload (each block was checked)
            self.reader._note(self.item, self.check)
        self.planner.commit_tensor(self.item, self.target)


def _scatter(target: torch.Tensor, source: torch.Tensor, first: int, shape: list[int], offsets: list[int]) -> None:
    """Copy into ``target`` (the box of a row-major tensor of ``shape`` at ``offsets``, of ``target``'s size) the
    elements of that box among ``source``: the tensor's elements ``[first, first + source.numel())``, flat. Whole rows
    are one copy; a row cut by the run's ends is handled one dimension down (at most two per dimension)."""
    if not shape:
        target.copy_(source.view(()))
        return
    inner = math.prod(shape[1:])
    last = first + source.numel()
    row, stop = max(offsets[0], first // inner), min(offsets[0] + target.size(0), -(-last // inner))
    while row < stop:
        begin = row * inner
        if begin >= first and begin + inner <= last:
            end = min(stop, last // inner)  # rows row..end-1 are whole in the run
            rows = source[begin - first:end * inner - first].view(end - row, *shape[1:])
            target[row - offsets[0]:end - offsets[0]].copy_(_narrow(rows, [0, *offsets[1:]], [end - row,
                                                                                             *target.shape[1:]]))
            row = end
        else:
            low, high = max(first, begin), min(last, begin + inner)
            _scatter(target[row - offsets[0]], source[low - first:high - first], low - begin, shape[1:], offsets[1:])
            row += 1


# The storage a torch.save pickle names (protocol 2, as torch.save writes it): a legacy typed storage, or (torch's
# newer dtypes) an untyped storage followed by the dtype itself.
_LEGACY_STORAGE = re.compile(rb"ctorch\n(\w+)Storage\n")
_UNTYPED_STORAGE = re.compile(rb"ctorch\.storage\nUntypedStorage\n.*?ctorch\n(\w+)\n", re.DOTALL)
_LEGACY_DTYPES = {"Float": torch.float32, "Double": torch.float64, "Half": torch.float16, "BFloat16": torch.bfloat16,
                  "Long": torch.int64, "Int": torch.int32, "Short": torch.int16, "Char": torch.int8,
                  "Byte": torch.uint8, "Bool": torch.bool, "ComplexFloat": torch.complex64,
                  "ComplexDouble": torch.complex128}


def _pickled_dtype(head: bytes) -> Optional[torch.dtype]:
    """The dtype the pickle in an item's first bytes gives its tensor; None when it cannot tell.

    ``.metadata`` can be wrong about it: DCP's plan cache (the save's ``_CachedPlans``) compares shapes, not dtypes,
    so a save in the same process after a tensor changed dtype (same shape) records the dtype of the earlier save.
    The item's own bytes are right, and the previous reader, which unpickled every whole item, loaded them right."""
    found = _LEGACY_STORAGE.search(head)
    if found is not None:
        return _LEGACY_DTYPES.get(found.group(1).decode())
    found = _UNTYPED_STORAGE.search(head)
    named = getattr(torch, found.group(1).decode(), None) if found is not None else None
    return named if isinstance(named, torch.dtype) else None


class _ViewFile(SizedReader):
    """The checked bytes of an item as a read-only file for ``torch.load``, which reads each record into its own
    memory through ``readinto``: ``io.BytesIO(view)`` would first copy the whole item."""

    def __init__(self, view: memoryview) -> None:
        super().__init__()
        self._view, self._pos = view.cast("B"), 0

    def _extent(self) -> int:
        return len(self._view)

    def readinto(self, buffer: Any) -> int:
        out = memoryview(buffer).cast("B")
        count = max(0, min(len(out), len(self._view) - self._pos))
        out[:count] = self._view[self._pos:self._pos + count]
        self._pos += count
        return count


def _narrow(tensor: torch.Tensor, offsets: Any, lengths: Any) -> torch.Tensor:
    for dim, (offset, length) in enumerate(zip(offsets, lengths)):
        tensor = tensor.narrow(dim, int(offset), int(length))
    return tensor


def _copy(item: Any, planner: Any, tensor: torch.Tensor) -> None:
    target = planner.resolve_tensor(item).detach()
    if target.size() != tensor.size():
        raise ChecksumError(f"the checkpoint's piece of {item.dest_index.fqn!r} has shape {list(tensor.size())}, where"
                            f" the load expects {list(target.size())}: its .metadata does not describe its bytes."
                            f"{DAMAGED_HINT}")
    target.copy_(tensor)
    planner.commit_tensor(item, target)
