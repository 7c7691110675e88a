"""An object written straight from memory into object storage (issue 43): no local staging copy.

``with open_upload(fs, url) as sink: sink.write(b); sink.tell()`` -- leaving the block normally completes the object;
an exception aborts the upload, and no object appears at ``url``.

- **S3**: bytes are copied into a part buffer of ``part_size`` bytes; a full buffer goes out as ``upload_part`` on
  s3fs's event loop, and the writer goes on filling a new one. At most ``parts_in_flight`` parts are out at once (a
  sliding window: a slow part holds up only its own slot, not a batch); the writer blocks beyond that, so a sink holds
  at most ``(parts_in_flight + 1) * part_size`` bytes of buffers. The last part is sent when the block ends, then
  ``complete_multipart_upload`` with ``If-None-Match: *``. An object that never filled one part is one ``put_object``
  (same condition): no multipart upload for the small objects. A part that fails transiently is sent again alone
  (:mod:`.transport_upload`); an error aborts the multipart upload (best effort: ``clean`` and the next save abort
  what a killed process left).
- **Other stores** (GCS, Azure, ``memory://``): the store's own write-mode file, one block at a time.

A rank's shard file may be written as several objects (:class:`ShardUpload`, what a sharded save opens): when the
shard's expected size is at most ``SPLIT_OBJECTS`` parts, the writer starts a new object (``next_object``) before an
item that would take the current one past one part, so each object is one ``put_object`` (conditional, as above) of a
buffer the writer already filled, and goes out while the writer fills the next. No multipart upload, hence no
``complete_multipart_upload``, which a store answers by assembling (moto: copying and hashing) the whole object
again: on the benchmark's server that was a third of a save's time. The objects of one shard share one window of
``parts_in_flight`` requests, the buffers, and one retry budget, so memory and the time bound are those of one
object. A larger shard stays one multipart object (fewer objects for ``COMMIT`` to name at scale); an item larger than
a part gets an object of its own, multipart.

Settings come from :func:`.transfers.transfers` (the strategy's ``part_size`` and ``parts_in_flight``).
``size_hint`` (bytes expected) raises the part size when S3's 10,000-part limit would otherwise be reached.
The sink counts what passes (``tell()``, ``size``) and hashes it (``digest``: xxh3-64 of the whole object, unseeded,
what COMMIT records for small objects).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import math
import threading
from typing import Any, Callable, Optional

import xxhash
from fsspec.asyn import sync

from lightning_fsdp.checkpoint.io.transfers import MiB, transfers
from lightning_fsdp.checkpoint.io.transport_upload import Budget, FileUpload, S3Upload, is_s3

__all__ = ["open_upload", "UploadSink", "ShardUpload", "MAX_PARTS", "SPLIT_OBJECTS", "release_buffers"]

MAX_PARTS = 10_000  # S3's limit per multipart upload
_PARTS_BEFORE_GROWING = 9_000  # past this many parts, each next part is larger (S3 allows any size but the last)
# A shard expected to be at most this many parts is written as objects of one part each. Above it, one multipart
# object: at 1,000 ranks, COMMIT names every object, and a few objects per rank keep it small.
SPLIT_OBJECTS = 16


def open_upload(fs: Any, url: str, *, size_hint: Optional[int] = None) -> "UploadSink":
    """A sink whose bytes become the object ``url`` when its ``with`` block ends normally (see the module)."""
    return UploadSink(fs, url, size_hint=size_hint)


# The part buffers of the last upload that ended well, for the next one (`_Lane`): at most `parts_in_flight + 1` of
# the current part size, what one sink holds while it runs. A save allocated its buffers afresh before, and
# zero-filling and faulting in a new bytearray costs 0.6 CPU-s per GB here (8 MiB parts: ~5 per rank and save,
# 0.07 s of a 1.2 s sharded save, py-spy of profile_checkpoint.py --mode save, 2026-11-29). Between saves the process
# so keeps up to that many bytes (40 MiB with the defaults); `release_buffers()` lets them go.
_KEPT: list[bytearray] = []
_KEPT_LOCK = threading.Lock()


def release_buffers() -> None:
    """Drop the part buffers kept for the next upload."""
    with _KEPT_LOCK:
        _KEPT.clear()


def _take_kept(size: int) -> Optional[bytearray]:
    with _KEPT_LOCK:
        for i, buffer in enumerate(_KEPT):
            if len(buffer) == size:
                return _KEPT.pop(i)
    return None


def _keep(buffers: list[bytearray]) -> None:
    settings = transfers()
    with _KEPT_LOCK:
        same = [b for b in _KEPT + buffers if len(b) == settings.part_size]
        _KEPT[:] = same[:settings.parts_in_flight + 1]


class _Lane:
    """What the uploads of one shard share, one object or several: the window of requests in flight, the part
    buffers (refilled instead of allocated: zero-filling and faulting in 8 MiB per part was 10% of an upload's time
    on a fast server, py-spy; and kept for the next upload, ``_KEPT``), one retry budget, and the first failure."""

    def __init__(self, window: int) -> None:
        self.window = window
        self.slots = threading.Semaphore(window)
        self.lock = threading.Lock()
        self.in_flight = 0
        self.peak = 0
        self.free: list[bytearray] = []
        self.budget: Any = None  # made by the first S3 upload, on the writer's thread (transport_upload.Budget)
        self.failure: Optional[BaseException] = None
        self.closed = False

    def buffer(self, size: int) -> bytearray:
        with self.lock:
            reuse = self.free.pop() if self.free else None
        if reuse is None or len(reuse) != size:
            reuse = _take_kept(size)
        return reuse if reuse is not None else bytearray(size)

    def submit(self, loop: Any, coroutine: Any, buffer: Optional[bytearray]) -> concurrent.futures.Future:
        """Run ``coroutine`` on ``loop`` once a slot of the window is free (the writer waits here: at most `window`
        requests are out and one more buffer is being filled); ``buffer`` is refilled after it succeeds."""
        self.slots.acquire()
        with self.lock:
            self.in_flight += 1
            self.peak = max(self.peak, self.in_flight)
        try:
            future = asyncio.run_coroutine_threadsafe(coroutine, loop)
        except BaseException:
            coroutine.close()
            self._done(None, None)
            raise
        future.add_done_callback(lambda done: self._done(done, buffer))
        return future

    def _done(self, future: Optional[concurrent.futures.Future], buffer: Optional[bytearray]) -> None:
        with self.lock:
            self.in_flight -= 1
            failed = future is None or future.cancelled() or future.exception() is not None
            if not failed and not self.closed and buffer is not None:
                self.free.append(buffer)  # sent: its bytes are no longer needed for a retry
            if future is not None and not future.cancelled() and future.exception() is not None \
                    and self.failure is None:
                self.failure = future.exception()
        self.slots.release()

    def close(self, keep: bool = False) -> None:
        """No buffer is refilled after this; ``keep``: the upload ended well, and its free buffers (every request
        that used them answered) are kept for the next upload."""
        with self.lock:
            self.closed = True
            free, self.free = self.free, []
        if keep:
            _keep(free)

    def settle(self) -> None:
        """Until every answered request's callback has run (a waiter on its future may wake before it): each
        releases its slot last, so taking them all means every buffer sent is back in ``free``."""
        for _ in range(self.window):
            self.slots.acquire()
        for _ in range(self.window):
            self.slots.release()


class UploadSink:
    def __init__(self, fs: Any, url: str, *, size_hint: Optional[int] = None, lane: Optional[_Lane] = None) -> None:
        settings = transfers()
        self.url = url
        self.part_size = settings.part_size
        if size_hint and math.ceil(size_hint / self.part_size) > _PARTS_BEFORE_GROWING:
            self.part_size = math.ceil(size_hint / _PARTS_BEFORE_GROWING / MiB) * MiB
        self.window = settings.parts_in_flight
        self.size = 0
        self.digest: Optional[int] = None  # set when the object is complete
        self._hasher = xxhash.xxh3_64()
        # One of several objects of a shard (a shared lane): its PUT is left in flight at the end of the block, and
        # `wait` collects it; alone, the block's end waits for it.
        self._deferred = lane is not None
        self._lane = lane if lane is not None else _Lane(settings.parts_in_flight)
        self._s3: Optional[S3Upload] = None
        if is_s3(fs):
            if self._lane.budget is None:
                self._lane.budget = Budget()
            self._s3 = S3Upload(fs, url, self._lane.budget)
        self._file: Optional[FileUpload] = None if self._s3 is not None else FileUpload(fs, url, self.part_size)
        self._buffer = self._lane.buffer(self.part_size) if self._s3 is not None else bytearray()
        self._filled = 0
        self._parts: list[concurrent.futures.Future] = []
        self._whole: Optional[concurrent.futures.Future] = None  # the deferred PUT of an object under one part
        self._done = False
        self._aborted = False

    @property
    def peak_in_flight(self) -> int:
        """The most requests that were out at once (tests hold the window with it)."""
        return self._lane.peak

    # --- the file-like side ------------------------------------------------------------------------------------

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        size = len(view)
        self._hasher.update(view)
        if self._file is not None:
            self._file.write(view)
        else:
            while view:
                # A full buffer goes out when more bytes come, not as it fills: an object of exactly one part is
                # then one PUT, as a shard's objects of at most one part (`ShardUpload`) must be.
                if self._filled == self.part_size:
                    self._send_part()
                take = min(len(view), self.part_size - self._filled)
                self._buffer[self._filled:self._filled + take] = view[:take]
                self._filled += take
                view = view[take:]
        self.size += size
        return size

    def tell(self) -> int:
        return self.size

    def flush(self) -> None:
        """Nothing: parts go out as they fill (``torch.save`` and DCP call it)."""

    def writable(self) -> bool:
        return True

    @property
    def requests(self) -> int:
        """Requests sent so far, retries included (S3 only)."""
        return self._s3.requests if self._s3 is not None else 0

    def __enter__(self) -> "UploadSink":
        return self

    def __exit__(self, kind: Any, error: Any, trace: Any) -> None:
        if error is None:
            self._finish()
        else:
            self._abort()

    # --- S3 parts ----------------------------------------------------------------------------------------------

    def _run(self, coroutine: Any) -> Any:
        assert self._s3 is not None
        return sync(self._s3.loop, lambda: coroutine)

    def _raise_failure(self) -> None:
        if self._lane.failure is not None:
            raise self._lane.failure

    def _send_part(self) -> None:
        assert self._s3 is not None
        self._raise_failure()  # a part that failed for good fails the write at the next part, not at the end
        if self._s3.upload_id is None:
            self._run(self._s3.create())
        number = len(self._parts) + 1
        if number > MAX_PARTS:
            raise ValueError(f"{self.url!r} would need more than {MAX_PARTS} parts of {self.part_size} bytes (S3's"
                             " limit). HINT: pass a larger `part_size` to the strategy.")
        buffer = self._buffer
        # The last part is shorter: a view of it, not a trim (a buffer sent before may still be exported).
        data = buffer if self._filled == len(buffer) else memoryview(buffer)[:self._filled]
        self._parts.append(self._lane.submit(self._s3.loop, self._s3.put_part(number, data), buffer))
        if number >= _PARTS_BEFORE_GROWING:  # an object larger than the size hint said: keep under the limit
            self.part_size *= 2
        self._buffer = self._lane.buffer(self.part_size)
        self._filled = 0

    def _finish(self) -> None:
        if self._done:
            return
        try:
            if self._file is not None:
                self._file.finish()
            elif self._s3 is not None and self._s3.upload_id is None and not self._parts:
                buffer = self._buffer
                data = memoryview(buffer)[:self._filled]  # under one part: one PUT
                if self._deferred:
                    self._raise_failure()
                    self._whole = self._lane.submit(self._s3.loop, self._s3.put_whole(data), buffer)
                else:
                    self._run(self._s3.put_whole(data))
            else:
                if self._filled:
                    self._send_part()
                parts = [future.result() for future in self._parts]  # the first failure is raised
                self._run(self._s3.complete(parts))
        except BaseException:
            self._abort()
            raise
        self._done = True
        self._buffer = bytearray()
        if not self._deferred:
            self._lane.close(keep=True)
        self.digest = self._hasher.intdigest()

    def wait(self) -> None:
        """Until the object exists: its deferred PUT answered (its failure raised here)."""
        if self._whole is not None:
            self._whole.result()

    def _abort(self) -> None:
        """Drop the buffers, stop the requests in flight, abort the multipart upload. One of a shard's objects whose
        block had ended (its PUT sent, or its multipart upload completed) is removed: a later object of the shard
        failed. Best effort: ``clean`` and the next save remove what is left under the save's token."""
        finished = self._done
        if self._aborted or (finished and not self._deferred):
            return
        self._aborted = self._done = True
        self._buffer = bytearray()
        if not self._deferred:
            self._lane.close()
        if self._file is not None:
            if not finished:
                with contextlib.suppress(Exception):
                    self._file.abort()
            return
        whole = self._whole
        pending = self._parts + ([whole] if whole is not None else [])
        for future in pending:
            future.cancel()
        concurrent.futures.wait(pending)
        if self._s3 is None:
            return
        with contextlib.suppress(Exception):  # what is left is aborted by `clean` and the next save's sweep
            if finished:
                if whole is None or (not whole.cancelled() and whole.exception() is None):
                    self._run(self._s3.delete())
            elif self._s3.upload_id is not None:
                self._run(self._s3.abort())


class ShardUpload:
    """A rank's shard file as one object or several (see the module): the file-like side of the current object,
    ``split_at`` (bytes past which the writer should start a new object before an item; None: never), and
    ``next_object(name)``. Leaving the block normally waits until every object exists and lists them in
    ``objects`` (``(name, size, digest)``); an error aborts them all."""

    def __init__(self, fs: Any, url_of: Callable[[str], str], name: str, *, size_hint: Optional[int] = None) -> None:
        settings = transfers()
        self._fs, self._url_of = fs, url_of
        self._lane = _Lane(settings.parts_in_flight)
        self._done: list[tuple[str, UploadSink]] = []
        self._name = name
        self._sink = UploadSink(fs, url_of(name), size_hint=size_hint, lane=self._lane)
        small = size_hint is not None and size_hint <= SPLIT_OBJECTS * settings.part_size
        self.split_at: Optional[int] = settings.part_size if self._sink._s3 is not None and small else None
        self.objects: list[tuple[str, int, Optional[int]]] = []

    def write(self, data: Any) -> int:
        return self._sink.write(data)

    def tell(self) -> int:
        return self._sink.tell()

    def flush(self) -> None:
        """Nothing: parts go out as they fill."""

    def writable(self) -> bool:
        return True

    @property
    def size(self) -> int:
        return self._sink.size

    @property
    def digest(self) -> Optional[int]:
        return self._sink.digest

    @property
    def requests(self) -> int:
        return sum(sink.requests for _, sink in self._done) + self._sink.requests

    @property
    def peak_in_flight(self) -> int:
        return self._lane.peak

    def next_object(self, name: str) -> None:
        """End the current object (its PUT goes out in the background) and go on writing into a new one, ``name``."""
        self._sink._finish()
        self._done.append((self._name, self._sink))
        self._name = name
        self._sink = UploadSink(self._fs, self._url_of(name), lane=self._lane)

    def __enter__(self) -> "ShardUpload":
        return self

    def __exit__(self, kind: Any, error: Any, trace: Any) -> None:
        sinks = self._done + [(self._name, self._sink)]
        failed = error is not None
        try:
            if not failed:
                self._sink._finish()
                for _, sink in sinks:
                    sink.wait()  # the first failure is raised
                self._lane.settle()  # so that every buffer is kept for the next save (`_KEPT`)
                self.objects = [(name, sink.size, sink.digest) for name, sink in sinks]
        except BaseException:
            failed = True
            raise
        finally:
            if failed:
                for _, sink in reversed(sinks):
                    sink._abort()
            self._lane.close(keep=not failed)
