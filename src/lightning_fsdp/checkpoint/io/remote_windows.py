"""A committed checkpoint's objects, read in place for verification (issue 43): small ranges in one request each,
whole objects as a stream of windows with several in flight, and nothing written to disk.

Memory: at most ``ranges_in_flight`` windows of ``min(range_size, 8 MiB)`` (:mod:`.transfers`; 64 MiB at the
defaults), plus the one being hashed. Each request is retried on its own (:func:`.remote_errors.retrying` through the
store's ``retry``), within one budget for the whole operation where the caller opened one (``one_budget``), so a
failed window is fetched again, never the whole object. An object's size (and the digest COMMIT records for a small
one) is checked once its last window has arrived: one byte past the recorded end is asked for with the last window,
so an object longer than recorded is found without another request.
"""

from __future__ import annotations

import collections
import contextvars
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Iterator, Optional

import xxhash

from lightning_fsdp.checkpoint.io.remote_errors import damaged
from lightning_fsdp.checkpoint.io.transfers import transfers
from lightning_fsdp.checkpoint.io.urls import join

__all__ = ["CommittedObjects", "WINDOW_CAP"]

WINDOW_CAP = 8 * 2**20  # a verification's windows are at most this large, whatever range_size is: memory stays low
SMALL = 2**20  # objects up to this size are fetched in one request and kept while the verification runs


class CommittedObjects:
    """The objects one COMMIT (``record``) names, as :mod:`~lightning_fsdp.checkpoint.integrity.stream_verify` reads
    them. ``retry(step)`` runs one request with the store's retries and its reading of a vanished object."""

    def __init__(self, fs: Any, target: str, record: dict[str, Any],
                 retry: Callable[[Callable[[], Any]], Any]) -> None:
        self.fs, self.target, self._retry = fs, target, retry
        self.kind = "sharded" if record.get("kind") == "sharded" else "full"
        self.prefix = join(target, "." + record["token"])
        self._objects = {name: (int(size), digest) for name, (size, digest) in record["objects"].items()}
        self.names = set(self._objects)
        self._small: dict[str, bytes] = {}  # small objects read whole: `.metadata`, `meta.pt`, ...

    def where(self, name: str) -> str:
        """What messages call the object: its place in the checkpoint, as a local copy's would be renamed to."""
        return self.target if self.kind == "full" else join(self.target, name)

    def url(self, name: str) -> str:
        return join(self.prefix, name)

    def size(self, name: str) -> int:
        return self._objects[name][0]

    def read(self, name: str, start: int = 0, end: Optional[int] = None) -> bytes:
        """Bytes ``[start, end)`` of the object (``end=None``: to its recorded end), in one request. A small object
        read whole is checked against COMMIT's size and digest."""
        size, digest = self._objects[name]
        end = size if end is None else min(end, size)
        if end <= start:
            return b""
        whole = start == 0 and end == size
        if whole and name in self._small:
            return self._small[name]
        data = self._fetch(name, start, end + 1 if whole else end)
        if whole:
            self._check(name, len(data), digest, lambda: xxhash.xxh3_64_intdigest(data))
            if size <= SMALL:
                self._small[name] = data
        elif len(data) != end - start:
            self._check(name, None, None, lambda: 0)
        return data

    def windows(self, name: str) -> Iterator[tuple[int, bytes]]:
        """The whole object as ``(offset, bytes)`` pieces in order, ``ranges_in_flight`` requests ahead; its size and
        digest are checked after the last piece."""
        size, digest = self._objects[name]
        if 0 < size <= SMALL:  # one request, kept for every pass that needs it once checked
            data = self._small.get(name) or self._fetch(name, 0, size + 1)
            yield 0, data[:size]
            # Checked after the pass, as a large object is: damage inside is named by the item it hits first.
            self._check(name, len(data), digest, lambda: xxhash.xxh3_64_intdigest(data))
            self._small[name] = data
            return
        settings = transfers()
        window = max(1, min(settings.range_size, WINDOW_CAP))
        hasher = xxhash.xxh3_64() if digest is not None else None
        starts = collections.deque(range(0, size, window))
        if not starts:
            self._check(name, None, None, lambda: 0)  # an empty object: its size alone (one HEAD)
            return
        # Requests run on pool threads: each gets a copy of this context, so they share the caller's budget.
        pool = ThreadPoolExecutor(max_workers=min(settings.ranges_in_flight, len(starts)),
                                  thread_name_prefix="lfsdp-verify")
        pending: collections.deque[tuple[int, Future]] = collections.deque()

        def submit() -> None:
            start = starts.popleft()
            end = min(start + window, size)
            ask = end + 1 if end == size else end  # one byte more at the end: a longer object shows itself
            pending.append((start, pool.submit(contextvars.copy_context().run, self._fetch, name, start, ask)))

        try:
            while starts and len(pending) < settings.ranges_in_flight:
                submit()
            total = 0
            while pending:
                start, future = pending.popleft()
                data = future.result()
                if starts:
                    submit()
                expected = min(start + window, size) - start
                if len(data) != expected:  # shorter (or, for the last, longer) than COMMIT records
                    self._check(name, None, None, lambda: 0)
                if hasher is not None:
                    hasher.update(data)
                total += len(data)
                yield start, data
            self._check(name, total, digest, lambda: hasher.intdigest() if hasher is not None else 0)
        finally:
            pool.shutdown(wait=True, cancel_futures=True)

    def _fetch(self, name: str, start: int, end: int) -> bytes:
        url = self.url(name)
        try:
            return self._retry(lambda: self.fs.cat_file(url, start=start, end=end))
        except OSError as err:
            # A range that begins past the object's end (it is shorter than COMMIT records) is refused by S3 (416);
            # the store says so as an error about the range: damage, said with the object's real size.
            text = str(err).lower()
            if "invalidrange" in text or "416" in text or "not satisfiable" in text:
                self._check(name, None, None, lambda: 0)
            raise

    def _check(self, name: str, count: Optional[int], digest: Optional[int], actual_digest: Callable[[], int]) -> None:
        """Raise the damage of an object whose size is not COMMIT's (``count`` None: ask the store for it) or whose
        bytes do not give the digest COMMIT records."""
        size = self._objects[name][0]
        if count is None:
            count = int(self._retry(lambda: self.fs.size(self.url(name))))
        if count != size:
            raise damaged(self.url(name), f"it has {count} bytes, its commit records {size}")
        if digest is not None and actual_digest() != digest:
            raise damaged(self.url(name), "its bytes do not match the digest its commit records")
