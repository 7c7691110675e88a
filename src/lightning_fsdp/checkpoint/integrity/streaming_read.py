"""Sharded loads from object storage, the reading side (issue 43): each rank reads the byte ranges of the items it
needs, straight into memory, checks them, and copies them into the destination tensors. No shard file is fetched
whole and nothing is written to local disk.

:class:`StreamingReader` is the :class:`.sharded_read.VerifyingReader` of a checkpoint whose shard files are in a
bucket: ``.metadata``, ``checksums.json`` and ``meta.pt`` are in the local "skeleton" folder it is given (the
store fetched them), the shards are read through ``fetch`` (the io layer's ranged reads, passed in: this layer
does not import ``checkpoint.io``). Per DCP ``ReadItem``:

- **whole items**: the item's bytes ``[offset, offset + length)``, checked against its recorded digest *before*
  anything is unpickled or copied, then ``torch.load`` (torch's allow-list) from memory, narrowed, copied;
- **part of an item** (a resharded load needs some rows of a saved chunk), when ``checksums.json`` has the
  ``"payloads"`` key for it (the streaming writer's block digests): only the blocks of the payload that hold the
  rows needed, each block checked, then copied into the destination straight from the bytes (dtype and chunk shape
  from ``.metadata``). A region that is not a run of whole rows reads its rows' bounding run.

Anything else (an old checkpoint with no block digests, a byte item, a scalar) is read whole.

Each reader notes which items it checked whole against their digests (:func:`verified_items`): when the ranks of a
load together checked every item ``checksums.json`` lists, the load has verified the checkpoint as
``FsspecStore.verify`` would, and ``load_checkpoint`` marks it trusted so that retention does not read it again.
"""

from __future__ import annotations

import io
import json
import math
import os
import threading
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch
from torch.distributed.checkpoint.planner import LoadItemType
from torch.futures import Future

from lightning_fsdp.checkpoint.formats.layout import CHECKSUMS_FILENAME
from lightning_fsdp.checkpoint.integrity.digests import DAMAGED_HINT, ChecksumError
from lightning_fsdp.checkpoint.integrity.sharded_read import VerifyingReader, _ItemCheck

__all__ = ["StreamingReader", "parse_payloads", "verified_items", "MIN_BLOCK", "MAX_BLOCK"]

MIN_BLOCK, MAX_BLOCK = 64 * 2**10, 16 * 2**20  # the block sizes a save may record (common contract, issue 43)

# fetch(needs): needs are (object name, start, end, consume(memoryview)); every consume is called on this thread.
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
    item (or block) is copied into the destination, naming the object's URL and the tensor.
    """

    def __init__(self, path: Union[str, Path], *, fetch: Fetch, url_of: Callable[[str], str],
                 allow_pickle: bool = False) -> None:
        super().__init__(path, allow_pickle=allow_pickle)
        self._fetch, self._url_of = fetch, url_of
        self._metadata: Any = None
        self._payloads: Optional[dict] = None
        self._noted: Optional[tuple[list, set]] = None

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

    def read_data(self, plan: Any, planner: Any) -> Future:
        needs = [self._need(item, planner) for item in plan.items]
        self._fetch(needs)
        future: Future = Future()
        future.set_result(None)
        return future

    # --- one ReadItem -----------------------------------------------------------------------------------------

    def _need(self, item: Any, planner: Any) -> tuple:
        sinfo = self.storage_data[item.storage_index]
        check = None
        if self._manifest is not None:
            check = _ItemCheck(Path(self.path), sinfo, self._manifest)  # raises when the records disagree
            # Named by their URLs: the skeleton's path differs on every rank, and the agreed error is one rank's.
            check.where, check.manifest = self._url_of(sinfo.relative_path), self._manifest_url()
        if item.type != LoadItemType.BYTE_IO:
            partial = self._partial(item, planner, sinfo, check)
            if partial is not None:
                return partial
        return (sinfo.relative_path, sinfo.offset, sinfo.offset + sinfo.length,
                lambda view: self._whole(item, planner, view, check))

    def _whole(self, item: Any, planner: Any, view: memoryview, check: Optional[_ItemCheck]) -> None:
        if check is not None:
            check.hasher.update(view)
            check.finish(len(view))
            if self._noted is not None:  # every consume runs on the thread that called read_data
                self._noted[1].add((self.storage_data[item.storage_index].relative_path, check.offset))
        if item.type == LoadItemType.BYTE_IO:
            planner.load_bytes(item, io.BytesIO(view))
            return
        tensor = torch.load(io.BytesIO(view), map_location="cpu", weights_only=True)
        _copy(item, planner, _narrow(tensor, item.storage_offsets, item.lengths))

    def _partial(self, item: Any, planner: Any, sinfo: Any, check: Optional[_ItemCheck]) -> Optional[tuple]:
        """The need for only the blocks of the rows ``item`` reads, or None to read the whole item."""
        if check is None:
            return None
        recorded = self._payload_table().get((sinfo.relative_path, sinfo.offset))
        if recorded is None:
            return None
        chunk, dtype = self._chunk(item)
        if chunk is None or len(chunk) == 0:
            return None
        first, count = int(item.storage_offsets[0]), int(item.lengths[0])
        if count == 0 or (first == 0 and count == chunk[0]):
            return None  # every row: the whole item, checked by its own digest
        start, block, digests = recorded
        itemsize = torch.empty((), dtype=dtype).element_size()
        payload = math.prod(chunk) * itemsize
        if start + payload > sinfo.length or len(digests) != -(-payload // block):
            raise ChecksumError(f"{check.manifest!r} is not readable (its payloads record, for the tensor"
                                f" {check.name!r} at byte {sinfo.offset} of {check.where!r}, {len(digests)} blocks of"
                                f" {block} bytes from byte {start}, where .metadata gives it {payload} bytes in an item"
                                f" of {sinfo.length}).{DAMAGED_HINT}")
        row = math.prod(chunk[1:]) * itemsize
        low, high = first * row, (first + count) * row
        first_block, end_block = low // block, -(-high // block)
        begin, end = first_block * block, min(end_block * block, payload)
        base = sinfo.offset + start

        def consume(view: memoryview) -> None:
            for index in range(first_block, end_block):
                piece = view[(index - first_block) * block:min((index + 1 - first_block) * block, len(view))]
                hasher = self._manifest.hasher()
                hasher.update(piece)
                if hasher.intdigest() != digests[index]:
                    raise ChecksumError(f"{check.where!r} is corrupted: block {index} (bytes {base + index * block} to"
                                        f" {base + index * block + len(piece)}) of the tensor {check.name!r} does not"
                                        f" match the checksum recorded in {check.manifest!r} when the"
                                        f" checkpoint was saved.{DAMAGED_HINT}")
            rows = view[low - begin:high - begin]
            tensor = torch.frombuffer(rows, dtype=dtype) if len(rows) else torch.empty(0, dtype=dtype)
            if tensor.data_ptr() % itemsize:  # an unaligned start in the request's buffer: copy to an aligned one
                tensor = tensor.clone()
            tensor = tensor.view(count, *chunk[1:])
            _copy(item, planner, _narrow(tensor, [0, *item.storage_offsets[1:]], item.lengths))

        return (sinfo.relative_path, base + begin, base + end, consume)

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
