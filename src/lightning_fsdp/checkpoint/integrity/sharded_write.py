"""Sharded checkpoints, the writing side of the checksums: each rank hashes every DCP item as it is written
(:class:`_DigestingFileSystem`), and the coordinator writes ``checksums.json`` with the digests of every item and of
the whole ``.metadata`` and ``meta.pt`` (see :mod:`.digests` for the design)."""

from __future__ import annotations

import json
import os
import threading
from dataclasses import replace
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Union

import torch
import torch.distributed.checkpoint as dcp
from torch.futures import Future

from lightning_fsdp.checkpoint.formats.commit_order import COMMIT_ORDER_KEY, NEW, order_to_record
from lightning_fsdp.checkpoint.formats.layout import CHECKSUMS_FILENAME
from lightning_fsdp.checkpoint.formats.torch_versions import MANIFEST_KEY
from lightning_fsdp.checkpoint.integrity import digests
from lightning_fsdp.checkpoint.integrity.digests import ALGORITHMS, MANIFEST_FORMAT, file_digests, hash_file_range, item_name
from lightning_fsdp.checkpoint.integrity.write_errors import RecordingFileSystem, WriteRecorder

__all__ = ["ChecksumWriter"]

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

    def __init__(self, path: Union[str, Path], *, save_id: str, algorithm: Optional[str] = None,
                 commit_order: Union[int, None, str] = NEW, **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        self._commit_order = commit_order  # a convert keeps its source's (see `commit_order.NEW`)
        self._save_id = self.save_id = save_id
        self._algorithm = algorithm or digests.ALGORITHM
        # A disk that fills inside one of DCP's `torch.save` records raises only "unexpected pos"; the recording file
        # system keeps the OSError that says why (see `write_errors`), and hashes each item as it is written.
        self.fs = self._recording = _DigestingFileSystem()

    def reset(self, checkpoint_id: Any = None) -> None:
        super().reset(checkpoint_id)
        self.save_id = self._save_id  # DCP draws a fresh id per rank; ours is the same on every rank

    def write_data(self, plan: Any, planner: Any) -> Future:
        seed_of, new_hasher = ALGORITHMS[self._algorithm]
        seed = seed_of(self._save_id)
        self._recording.start(lambda: new_hasher(seed))
        try:
            with torch.no_grad():  # DCP's `resolve_data`: a DTensor's `to_local` skips autograd (see streaming_write)
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
                        hash_file_range(fd, info.offset, info.offset + info.length, hasher.update)
                        digest = hasher.intdigest()
                    # DCP gathers write results to the coordinator as they are; `finish` unpacks them again.
                    stamped.append(replace(result, storage_data=(info, digest)))
            finally:
                if fd is not None:
                    os.close(fd)
        future: Future = Future()  # torch's future, as DCP expects
        future.set_result(stamped)
        return future

    def _extend_manifest(self, manifest: dict[str, Any], results: list) -> None:
        """What a subclass adds to ``checksums.json`` before it is written (nothing here)."""

    def finish(self, metadata: Any, results: list) -> None:
        items, plain = [], []
        for rank_results in results:
            unpacked = []
            for result in rank_results:
                info, digest = result.storage_data[:2]
                items.append([info.relative_path, info.offset, info.length, digest, item_name(result.index)])
                unpacked.append(replace(result, storage_data=info))
            plain.append(unpacked)
        try:
            super().finish(metadata, plain)  # writes `.metadata`, which the manifest binds too
            # Written last: a staging directory is committed as a whole (`atomic`), so the order only decides what
            # the manifest can record, and it records `.metadata` and `meta.pt` (written before DCP starts).
            seed_of, new_hasher = ALGORITHMS[self._algorithm]
            files = file_digests(Path(self.path), lambda: new_hasher(seed_of(self._save_id)))
            manifest = {"format": MANIFEST_FORMAT, "algorithm": self._algorithm, "save_id": self._save_id,
                        "items": items, "files": files, COMMIT_ORDER_KEY: order_to_record(self._commit_order),
                        MANIFEST_KEY: torch.__version__}  # names the writer if a later, older torch cannot read it
            self._extend_manifest(manifest, results)
            with open(Path(self.path) / CHECKSUMS_FILENAME, "w") as file:
                json.dump(manifest, file)
                file.flush()
                if self.sync_files:  # a staging folder that is only read back for an upload needs no fsync
                    os.fsync(file.fileno())
        except BaseException as err:
            self._recording.raise_recorded(err)
            raise


# The files of a sharded checkpoint that are not shard files, each bound to the save by a digest of all its bytes
# seeded with the save id: `.metadata` decides where every item's bytes go, `meta.pt` holds the step and the rest.
