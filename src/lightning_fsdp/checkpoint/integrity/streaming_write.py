"""A sharded save whose shard files go straight from memory to where they are kept (issue 43): no local copy.

:class:`StreamingWriter` is DCP's storage writer for sharded saves to object storage. Planning, ``.metadata`` and
``checksums.json`` are :class:`~.sharded_write.ChecksumWriter`'s (rank 0 writes those two, small, to its local
staging folder beside ``meta.pt``, and the store uploads them with COMMIT's other objects); what changes is
``write_data``: each rank's ``__<rank>_0.distcp`` is written, item after item, into an object opened by
``open_object(name, size_hint=bytes)`` -- a context manager with ``write``/``tell`` whose normal end makes the object and whose error
leaves none (the upload sink, :func:`lightning_fsdp.checkpoint.io.sink.open_upload`; passed in, as this layer may
not import ``io``). A sink may take several objects (``split_at``, ``next_object``): the shard is then DCP's
``__<rank>_0.distcp``, ``__<rank>_1.distcp``, ..., as ``FileSystemWriter`` names the files of a rank that writes
several, each item whole in one of them.

The write loop is ours, not DCP's ``_write_files_from_queue``, which keeps every tensor it wrote alive until its
file is closed (a dict for its safetensors format) and so holds a whole shard's copy at once. Here, per item:

- resolve it, ``detach().cpu()``, and a contiguous clone only when its storage is larger than itself (FSDP2's padded
  shards), so the payload is exactly the tensor's bytes in row-major order;
- ``torch.save`` it straight into the object through a tee that hashes the item (its digest, seeded with the save id
  as every item digest is) and keeps only the zip's first and last 64 KiB, where ``data/0``'s local header and the
  central directory are: so where the tensor's raw bytes start is found without holding the item; the payload's
  block digests (``"payloads"`` below) are taken from the tensor's own memory; then the item is dropped.

``checksums.json`` gains ``"payloads"``: ``[file, item_offset, payload_start, block_size, [d0, d1, ...]]`` per tensor
item, ``d_i`` the seeded digest of payload bytes ``[i*block_size, min((i+1)*block_size, payload_len))``, so a load
that needs part of an item can fetch and check only the blocks it covers. Items not listed are read whole and
checked by their item digest; readers that do not know the key ignore it.

The file is DCP's own format, byte for byte what ``FileSystemWriter`` would write for these items (byte items
first, then tensors, each a ``torch.save``), so plain ``dcp.load`` with a ``FileSystemReader`` loads a downloaded
copy.
"""

from __future__ import annotations

import struct
import zipfile
from dataclasses import replace
from typing import Any, Callable, ContextManager, Optional

import torch
from lightning_fsdp._base.compat import DCPStorageInfo as _StorageInfo
from lightning_fsdp._base.seekable import SizedReader
from torch.distributed.checkpoint.planner import WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from lightning_fsdp.checkpoint.integrity.digests import ALGORITHMS, storage_bytes
from lightning_fsdp.checkpoint.integrity.sharded_write import ChecksumWriter

__all__ = ["StreamingWriter", "payload_start", "block_size", "block_digests", "PAYLOADS_KEY"]

PAYLOADS_KEY = "payloads"
_MIN_BLOCK, _MAX_BLOCK, _BLOCKS = 64 * 2**10, 16 * 2**20, 64
_LOCAL_HEADER = struct.Struct("<4s2B4HL2L2H")  # a zip local file header, 30 bytes
_LOCAL_SIGNATURE = b"PK\x03\x04"
_ENDS = 64 * 2**10  # bytes kept of each item's start and end: its zip headers and central directory
_ZIP_BYTES = 4096  # at most, per item, what torch.save adds to the payload (zip records and the pickle: ~1.5 KiB)


def block_size(payload_len: int) -> int:
    """The smallest power of two >= ``payload_len / 64``, within [64 KiB, 16 MiB]: at most 64 blocks per item (so
    at most 64 digests), and a partial read fetches at most one extra block at each end."""
    size = _MIN_BLOCK
    while size < _MAX_BLOCK and size * _BLOCKS < payload_len:
        size *= 2
    return size


def block_digests(payload: memoryview, size: int, new_hasher: Callable[[], Any]) -> list[int]:
    out = []
    for start in range(0, len(payload), size):
        hasher = new_hasher()
        hasher.update(payload[start:start + size])
        out.append(hasher.intdigest())
    return out


def payload_start(head: Any, tail: Any, total: int, payload_len: int) -> Optional[int]:
    """Where the tensor's raw bytes start in a ``torch.save`` zip of one tensor (``data/0``'s data), from the zip's
    first bytes (``head``: its local headers) and last bytes (``tail``: the central directory) only, the item being
    ``total`` bytes long; None when those do not say so plainly (another layout, compression, a size that is not the
    tensor's, a directory longer than the tail): that item is then read whole."""
    try:
        with zipfile.ZipFile(_Ends(bytes(head), bytes(tail), total)) as archive:
            records = [i for i in archive.infolist() if i.filename.endswith("/data/0")]
            storages = [i for i in archive.infolist() if "/data/" in i.filename and not i.filename.endswith(".pkl")]
    except (zipfile.BadZipFile, ValueError, EOFError, _Unknown):
        return None
    if len(records) != 1 or len(storages) != 1:
        return None
    record = records[0]
    if record.compress_type != zipfile.ZIP_STORED or record.file_size != payload_len:
        return None
    header = bytes(head[record.header_offset:record.header_offset + _LOCAL_HEADER.size])
    if len(header) != _LOCAL_HEADER.size:
        return None
    fields = _LOCAL_HEADER.unpack(header)
    if fields[0] != _LOCAL_SIGNATURE:
        return None
    start = record.header_offset + _LOCAL_HEADER.size + fields[-2] + fields[-1]  # + name length + extra length
    return start if start + payload_len <= total else None


class _Unknown(Exception):
    """A read of bytes that were neither kept at the start nor at the end of the item."""


class _Ends(SizedReader):
    """A file of ``total`` bytes of which only the first (``head``) and last (``tail``) are known: enough for
    ``zipfile`` to read a zip's central directory, which sits at its end."""

    def __init__(self, head: bytes, tail: bytes, total: int) -> None:
        super().__init__()
        self._head, self._tail, self._total, self._pos = head, tail, total, 0

    def _extent(self) -> int:
        return self._total

    def readinto(self, buffer: Any) -> int:
        start = self._pos
        end = min(self._total, start + len(buffer))
        tail_from = self._total - len(self._tail)
        if end <= len(self._head):
            data = self._head[start:end]
        elif start >= tail_from:
            data = self._tail[start - tail_from:end - tail_from]
        else:
            raise _Unknown()
        buffer[:len(data)] = data
        self._pos = end
        return len(data)


class _ItemTee:
    """What ``torch.save`` writes of one item: passed on to the object as it comes, hashed (the item digest), and
    only its first and last ``_ENDS`` bytes kept (where the zip's headers and directory are)."""

    def __init__(self, sink: Any, hasher: Any) -> None:
        self._sink, self.hasher = sink, hasher
        self.size = 0
        self.head, self.tail = bytearray(), bytearray()

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        size = len(view)
        self.hasher.update(view)
        written = self._sink.write(view)
        assert written == size
        if len(self.head) < _ENDS:
            self.head += view[:_ENDS - len(self.head)]
        if size >= _ENDS:
            self.tail = bytearray(view[size - _ENDS:])
        else:
            self.tail += view
            del self.tail[:-_ENDS]
        self.size += size
        return size

    def flush(self) -> None:
        pass


class StreamingWriter(ChecksumWriter):
    """See the module. ``path``: rank 0's local staging folder (``.metadata``, ``checksums.json``); ``open_object``:
    ``name -> context manager`` of the object for the shard file ``name``; ``on_written(name, size, digest)`` is
    called once each object is complete (the store's record of what COMMIT names)."""

    def __init__(self, path: Any, *, save_id: str, open_object: Callable[..., ContextManager[Any]],
                 on_written: Optional[Callable[[str, int, Optional[int]], None]] = None, **kwargs: Any) -> None:
        super().__init__(path, save_id=save_id, sync_files=False, thread_count=1, **kwargs)
        self._open_object, self._on_written = open_object, on_written

    def prepare_local_plan(self, plan: Any) -> Any:
        # DCP's version makes the local folder on every rank and looks for an old `.metadata` in it: here only rank
        # 0's staging folder (made with `meta.pt` in it) holds anything, and every save has a new token prefix.
        return plan

    def write_data(self, plan: Any, planner: Any) -> Future:
        # Autograd off (grad mode is per thread: a background save writes on a thread of its own): a DTensor's
        # `to_local`, in DCP's `resolve_data` of every item, otherwise goes through an autograd Function; with the
        # planner's (save._CachedPlans) about a tenth of a save's main-thread samples under py-spy
        # (benchmarks/profile_checkpoint.py --mode save --py-spy FILE).
        with torch.no_grad():
            return self._write_data(plan, planner)

    def _write_data(self, plan: Any, planner: Any) -> Future:
        seed_of, new_hasher = ALGORITHMS[self._algorithm]
        seed = seed_of(self._save_id)
        self._recording.start(lambda: new_hasher(seed))  # the local files `finish` writes go through it
        prefix, index = plan.storage_data.prefix, 0
        name = f"{prefix}{index}.distcp"
        results: list[WriteResult] = []
        # DCP's order: byte items, then tensors (the offsets it would record are the ones recorded here).
        items = sorted(plan.items, key=lambda item: item.type != WriteItemType.BYTE_IO)
        # Expected bytes (payloads plus about 1.5 KiB of zip per item): the sink raises its part size if S3's part
        # limit needs it, and says whether the shard goes as several objects.
        hint = sum(_item_bytes(item) + _ZIP_BYTES for item in items)
        with self._open_object(name, size_hint=hint) as sink:
            # A sink that takes several objects (`split_at`: bytes each should stay under) gets a new one, DCP's next
            # file name for this rank, before an item that would take the current one past it: each object is
            # then one PUT (see `io.sink`). An item larger than that is an object of its own.
            split_at = getattr(sink, "split_at", None)
            for item in items:
                if split_at and sink.tell() and sink.tell() + _item_bytes(item) + _ZIP_BYTES > split_at:
                    index += 1
                    name = f"{prefix}{index}.distcp"
                    sink.next_object(name)
                results.append(self._write_item(sink, name, item, planner, lambda: new_hasher(seed)))
            size = sink.tell()
        written = getattr(sink, "objects", None) or [(name, size, getattr(sink, "digest", None))]
        if self._on_written is not None:
            for object_name, object_size, digest in written:
                self._on_written(object_name, object_size, digest)
        future: Future = Future()
        future.set_result(results)
        return future

    def _write_item(self, sink: Any, name: str, item: Any, planner: Any, new_hasher: Callable[[], Any]) -> Any:
        offset = sink.tell()
        hasher = new_hasher()
        payload: Optional[list] = None
        if item.type == WriteItemType.BYTE_IO:
            view = planner.resolve_data(item).getbuffer()
            hasher.update(view)
            sink.write(view)
            length = len(view)
        else:
            tensor = planner.resolve_data(item).detach().cpu()
            if tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size() \
                    or not tensor.is_contiguous():
                # Exactly the tensor's bytes, row-major: what ranged reads assume (one copy, of this item only).
                tensor = tensor.clone(memory_format=torch.contiguous_format)
            # Straight into the object: the item is never copied whole; its block digests are taken from the
            # tensor's own memory, which is the payload byte for byte.
            tee = _ItemTee(sink, hasher)
            torch.save(tensor, tee)
            length = tee.size
            size = tensor.numel() * tensor.element_size()
            start = payload_start(tee.head, tee.tail, length, size) if size else None
            if start is not None:
                block = block_size(size)
                payload = [name, offset, start, block,
                           block_digests(storage_bytes(tensor.untyped_storage()), block, new_hasher)]
            del tensor
        info = _StorageInfo(name, offset, length)
        return WriteResult(index=item.index, size_in_bytes=length, storage_data=(info, hasher.intdigest(), payload))

    def finish(self, metadata: Any, results: list) -> None:
        payloads, plain = [], []
        for rank_results in results:
            unpacked = []
            for result in rank_results:
                info, digest, payload = result.storage_data
                if payload is not None:
                    payloads.append(payload)
                unpacked.append(replace(result, storage_data=(info, digest)))
            plain.append(unpacked)
        self._payloads = sorted(payloads, key=lambda p: (p[0], p[1]))
        # `.metadata` and `checksums.json` (with the key added, `_extend_manifest`), in rank 0's staging folder,
        # written once and not fsynced (`sync_files=False`): they are only read back by the upload.
        super().finish(metadata, plain)

    def _extend_manifest(self, manifest: dict, results: list) -> None:
        manifest[PAYLOADS_KEY] = self._payloads


def _item_bytes(item: Any) -> int:
    if item.type == WriteItemType.BYTE_IO or item.tensor_data is None:
        return 0
    return item.tensor_data.chunk.sizes.numel() * _element_size(item.tensor_data.properties.dtype)


def _element_size(dtype: torch.dtype) -> int:
    # The dtype's own attribute: making a tensor per item to ask it was 1% of a sharded save to S3 (py-spy).
    return dtype.itemsize
