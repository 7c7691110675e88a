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
from typing import Any, Optional

import xxhash
from fsspec.asyn import sync

from lightning_fsdp.checkpoint.io.transfers import MiB, transfers
from lightning_fsdp.checkpoint.io.transport_upload import FileUpload, S3Upload, is_s3

__all__ = ["open_upload", "UploadSink", "MAX_PARTS"]

MAX_PARTS = 10_000  # S3's limit per multipart upload
_PARTS_BEFORE_GROWING = 9_000  # past this many parts, each next part is larger (S3 allows any size but the last)


def open_upload(fs: Any, url: str, *, size_hint: Optional[int] = None) -> "UploadSink":
    """A sink whose bytes become the object ``url`` when its ``with`` block ends normally (see the module)."""
    return UploadSink(fs, url, size_hint=size_hint)


class UploadSink:
    def __init__(self, fs: Any, url: str, *, size_hint: Optional[int] = None) -> None:
        settings = transfers()
        self.url = url
        self.part_size = settings.part_size
        if size_hint and math.ceil(size_hint / self.part_size) > _PARTS_BEFORE_GROWING:
            self.part_size = math.ceil(size_hint / _PARTS_BEFORE_GROWING / MiB) * MiB
        self.window = settings.parts_in_flight
        self.size = 0
        self.digest: Optional[int] = None  # set when the object is complete
        self.peak_in_flight = 0  # the most parts that were out at once (tests hold the window with it)
        self._hasher = xxhash.xxh3_64()
        self._s3: Optional[S3Upload] = S3Upload(fs, url) if is_s3(fs) else None
        self._file: Optional[FileUpload] = None if self._s3 is not None else FileUpload(fs, url, self.part_size)
        self._buffer = bytearray(self.part_size) if self._s3 is not None else bytearray()
        self._filled = 0
        # Buffers of parts that were sent, filled again instead of allocating (and zero-filling, and faulting in)
        # 8 MiB per part: 10% of an upload's time on a fast server (py-spy). At most window + 1 buffers ever exist.
        self._free: list[bytearray] = []
        self._slots = threading.Semaphore(self.window)
        self._lock = threading.Lock()
        self._in_flight = 0
        self._parts: list[concurrent.futures.Future] = []
        self._failure: Optional[BaseException] = None
        self._done = False

    # --- the file-like side ------------------------------------------------------------------------------------

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        size = len(view)
        self._hasher.update(view)
        if self._file is not None:
            self._file.write(view)
        else:
            while view:
                take = min(len(view), self.part_size - self._filled)
                self._buffer[self._filled:self._filled + take] = view[:take]
                self._filled += take
                view = view[take:]
                if self._filled == self.part_size:
                    self._send_part()
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
        if self._failure is not None:
            raise self._failure

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
        # The window: wait for a slot before this part's buffer is handed over, so at most `window` parts are out
        # and one more is being filled.
        self._slots.acquire()
        with self._lock:
            self._in_flight += 1
            self.peak_in_flight = max(self.peak_in_flight, self._in_flight)
        try:
            future = asyncio.run_coroutine_threadsafe(self._s3.put_part(number, data), self._s3.loop)
        except BaseException:
            self._part_done(None)
            raise
        future.add_done_callback(lambda done: self._part_done(done, buffer))
        self._parts.append(future)
        if number >= _PARTS_BEFORE_GROWING:  # an object larger than the size hint said: keep under the limit
            self.part_size *= 2
        with self._lock:
            reuse = self._free.pop() if self._free else None
        self._buffer = reuse if reuse is not None and len(reuse) == self.part_size else bytearray(self.part_size)
        self._filled = 0

    def _part_done(self, future: Optional[concurrent.futures.Future], buffer: Optional[bytearray] = None) -> None:
        with self._lock:
            self._in_flight -= 1
            failed = future is None or future.cancelled() or future.exception() is not None
            if not failed and not self._done and buffer is not None:
                self._free.append(buffer)  # sent: its bytes are no longer needed for a retry
            if future is not None and not future.cancelled() and future.exception() is not None \
                    and self._failure is None:
                self._failure = future.exception()
        self._slots.release()

    def _finish(self) -> None:
        if self._done:
            return
        try:
            if self._file is not None:
                self._file.finish()
            elif self._s3 is not None and self._s3.upload_id is None and not self._parts:
                del self._buffer[self._filled:]
                self._run(self._s3.put_whole(self._buffer))  # under one part: one PUT
            else:
                if self._filled:
                    self._send_part()
                parts = [future.result() for future in self._parts]  # the first failure is raised
                self._run(self._s3.complete(parts))
        except BaseException:
            self._abort()
            raise
        self._done = True
        self._buffer, self._free = bytearray(), []
        self.digest = self._hasher.intdigest()

    def _abort(self) -> None:
        """Drop the buffers, stop the parts in flight, abort the multipart upload (best effort)."""
        if self._done:
            return
        self._done = True
        self._buffer, self._free = bytearray(), []
        if self._file is not None:
            with contextlib.suppress(Exception):
                self._file.abort()
            return
        for future in self._parts:
            future.cancel()
        concurrent.futures.wait(self._parts)
        if self._s3 is not None and self._s3.upload_id is not None:
            with contextlib.suppress(Exception):  # what is left is aborted by `clean` and the next save's sweep
                self._run(self._s3.abort())
