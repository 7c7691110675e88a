"""The GET side of a streaming load (issue 43): byte ranges of committed objects, fetched straight into memory.

A reader hands :func:`fetch` its *needs*: ``(object name, start, end, consume)``, each a byte range it wants and the
function that takes the bytes (a ``memoryview`` of exactly ``end - start`` bytes, on the calling thread, in order
of offset within each object, the objects the rank reads least of first). Here they become requests:

- **Coalesced** per object: a need joins the request before it when the gap between them is at most
  ``min(256 KiB, 1/16 of the merged range)`` (the gap's bytes are fetched and dropped: one request costs more than
  that) and the merged request stays within ``range_size``; a need longer than ``range_size`` is split. Gaps of up
  to 256 KiB that the ratio refuses (small needs far apart for their size) merge too, within a fetch-wide allowance
  of 1/256 of the bytes it needs (``SPARE_PART``).
- **A window** of ``ranges_in_flight`` requests runs on worker threads while the calling thread consumes them in
  order; the next request starts as one ends, while its body fits in the window's bytes, so the buffers held are at
  most ``ranges_in_flight * range_size`` (bodies in flight or not yet consumed), plus one need being assembled
  across requests (an item longer than a request). Small requests may run up to ``SMALL_REQUESTS`` times as many at
  once, within the same bytes.
- **One mapping for every body** (:class:`_Bodies`): the bodies are read into one anonymous mapping of the
  window's bytes, made for the fetch (each body in the lowest free region that fits it, given back in request
  order) and unmapped at its end. A body allocated per request on its worker thread came from that thread's malloc
  arena, which keeps freed memory resident: the first load of a process (new threads, new arenas) held 97 MiB above
  its start for an 86 MiB shard in ``benchmarks/object_storage.py`` (round 0; the other rounds 42-65 MiB), over the
  bound of 64 MiB + 0.1x the shard. A body starts at an address congruent to its offset in the object modulo 64,
  so a tensor's bytes are as aligned in memory as in the object.
- **Resumed, not restarted**: each request reads its body in chunks into its own buffer; a transient failure
  (a 503, a dropped connection) retries from the byte reached, within the store's one bound
  (``LFSDP_STORE_TIMEOUT_S``, :func:`.remote_errors.retrying`, through the store's own ``retry`` when it has one).

S3 is read through obstore where it is installed and the s3fs filesystem translates to it (``transport_download``:
the same requests, outside the GIL), else through s3fs's client, ``get_object`` with a ``Range``, the body streamed;
any other fsspec filesystem through ``fs.cat_file(url, start, end)``, one request per range. Measured on moto in one
process (one 32 MiB range, 6 rounds, 2026-11-28): streamed into the buffer 0.066 s median (0.064-0.075),
``cat_file`` 0.087 s (0.085-0.107), which reads the whole body and then joins it; the stream can also resume, which
``cat_file`` cannot.
"""

from __future__ import annotations

import concurrent.futures
import contextvars
import errno
import mmap
import os
import queue
import threading
from collections import deque
from typing import Any, Iterable, Optional

from lightning_fsdp.checkpoint.integrity.agreement import CheckpointError
from lightning_fsdp.checkpoint.io import transport_download
from lightning_fsdp.checkpoint.io.remote_errors import damaged, retrying
from lightning_fsdp.checkpoint.io.remote_source import RemoteObjects
from lightning_fsdp.checkpoint.io.transfers import transfers

__all__ = ["fetch", "Fetch", "coalesce", "Need", "MAX_GAP"]

Need = tuple  # (name, start, end, consume(memoryview) -> None)
MAX_GAP = 256 * 2**10
SPARE_PART = 256  # a fetch drops at most 1/SPARE_PART of the bytes it needs in gaps the ratio alone would not merge
SMALL_REQUESTS = 4  # small requests may run this many times ranges_in_flight at once, within its bytes (see fetch)
_CHUNK = 2**20  # a body is read this much at a time, so a failure costs at most the bytes not yet read
_ALIGN = 64  # a body's address is congruent to its offset in the object modulo this (torch.save aligns payloads so)


def coalesce(spans: Iterable[tuple[int, int]], range_size: int, spare: Optional[list[int]] = None
             ) -> list[tuple[int, int]]:
    """The requests that fetch every ``(start, end)`` of ``spans`` (one object's): neighbours merged while the gap
    is at most ``min(MAX_GAP, merged length / 16)`` and the merged request at most ``range_size``; longer spans
    split into pieces of ``range_size``. ``spare``: ``[bytes]`` a fetch may drop beyond that, shared by its objects
    and spent here: a gap of at most ``MAX_GAP`` the ratio refuses is merged while it fits (see :class:`Fetch`)."""
    requests: list[list[int]] = []
    for start, end in sorted(spans):
        if end <= start:
            continue
        if requests:
            last = requests[-1]
            if start < last[1]:  # overlapping needs (two ReadItems of one item): one fetch serves both
                start = last[1]
                if end <= start:
                    continue
            merged, gap = end - last[0], start - last[1]
            if merged <= range_size and (gap <= min(MAX_GAP, merged // 16)
                                         or (spare is not None and gap <= min(MAX_GAP, spare[0]))):
                if gap > merged // 16:
                    spare[0] -= gap
                last[1] = end
                continue
        while end - start > range_size:
            requests.append([start, start + range_size])
            start += range_size
        requests.append([start, end])
    return [(s, e) for s, e in requests]


class _Cut(CheckpointError):
    """An object shorter (or longer) than its COMMIT records, found while reading a range of it: damage. A
    CheckpointError, so the store's retry lets it through at once; :meth:`_Fetcher.get` says it with the real size
    (``size``, when the answer gave it)."""

    def __init__(self, message: str, size: Optional[int] = None) -> None:
        super().__init__(message)
        self.size = size


def _cut(url: str, size: Optional[int] = None) -> _Cut:
    return _Cut(f"{url!r} does not have the size its commit records. HINT: the checkpoint is damaged; load an earlier"
                " one", size)


def _total_size(content_range: Optional[str]) -> Optional[int]:
    """The object's size from a Content-Range header (``bytes 0-99/100``); None when absent or ``*``."""
    total = (content_range or "").rpartition("/")[2].strip()
    return int(total) if total.isdigit() else None


class _Fetcher:
    def __init__(self, source: RemoteObjects) -> None:
        self.source = source
        self.fs = source.fs
        self.s3 = hasattr(self.fs, "_call_s3") and hasattr(self.fs, "split_path")
        # obstore, where installed and the filesystem translates to it (transport_download): the same requests,
        # outside the GIL; None keeps s3fs.
        self.fast = transport_download.client_for(self.fs) if self.s3 else None

    def get(self, name: str, start: int, end: int, into: Optional[memoryview] = None) -> Any:
        """The bytes ``[start, end)`` of the object ``name``, read into ``into`` (``end - start`` bytes; a new buffer
        when None) and returned; a transient failure resumes from the byte reached."""
        url = self.source.url(name)
        buffer = bytearray(end - start) if into is None else into
        view = memoryview(buffer)
        reached = [0]

        def step() -> None:
            if reached[0] < len(buffer):
                self._read(url, start + reached[0], end, view[reached[0]:], reached, self._committed(name))

        retry = self.source.retry or (lambda s: retrying(self.fs, self.source.target, "downloading", s))
        try:
            retry(step)
        except _Cut as cut:
            # Damage, never retried: the same request gets the same short object. Said with its real size, as
            # verification says it (remote_windows), so `latest` falls back past it.
            real = cut.size if cut.size is not None else retry(lambda: int(self.fs.size(url)))
            raise damaged(url, f"it has {real} bytes, its commit records {self._committed(name)}") from cut
        return buffer

    def _committed(self, name: str) -> int:
        return self.source.objects[name][0]

    def _read(self, url: str, start: int, end: int, view: memoryview, reached: list[int], committed: int) -> None:
        if self.fast is not None and self.fast.on:
            try:
                self.fast.read(url, start, end, view, reached, committed)
                return
            except transport_download.Short as short:
                raise _cut(url, short.size) from short
            except transport_download.Unplaced:
                self.fast.on = False  # an answer obstore could not place (before any byte): s3fs from now on
        if self.s3:
            from fsspec.asyn import sync

            sync(self.fs.loop, self._read_s3, url, start, end, view, reached, committed)
            return
        data = self.fs.cat_file(url, start=start, end=end)
        if len(data) != end - start:  # the object ends before the range does: shorter than its commit records
            raise _cut(url)
        view[:len(data)] = data
        reached[0] += len(data)

    async def _read_s3(self, url: str, start: int, end: int, view: memoryview, reached: list[int],
                       committed: int) -> None:
        bucket, key, version = self.fs.split_path(url)
        extra = {"VersionId": version} if version else {}
        try:
            response = await self.fs._call_s3("get_object", Bucket=bucket, Key=key, Range=f"bytes={start}-{end - 1}",
                                              **extra)
        except Exception as err:
            # A range that starts at or past the object's end is refused with 416, which s3fs raises as
            # OSError(EINVAL, 'The requested range is not satisfiable'): the object is shorter than COMMIT records.
            text = f"{type(err).__name__} {err}".lower()
            if "invalidrange" in text or "416" in text or "not satisfiable" in text:
                raise _cut(url) from err
            raise
        body = response["Body"]
        # A range that starts inside a cut object is answered with the bytes up to its end (206), and the
        # Content-Range header gives the object's real size: checked before the short body looks like a dropped
        # connection (which is retried).
        total = _total_size(response.get("ContentRange"))
        if total is not None and total != committed:
            body.close()
            raise _cut(url, total)
        try:
            count = 0
            while count < len(view):
                try:
                    chunk = await body.read(min(_CHUNK, len(view) - count))
                except Exception as err:  # aiohttp's ClientPayloadError and the like: the connection broke mid-body
                    raise ConnectionError(errno.ECONNRESET, f"the body of {url!r} broke off at byte {start + count}"
                                          f" of a range to {end} ({type(err).__name__}: {err}). HINT: a transient"
                                          " failure, retried from that byte within LFSDP_STORE_TIMEOUT_S") from err
                if not chunk:  # the connection closed early: transient, the retry goes on from here
                    raise ConnectionError(errno.ECONNRESET, f"the body of {url!r} ended at byte {start + count} of a"
                                          f" range to {end}. HINT: a transient failure, retried from that byte within"
                                          " LFSDP_STORE_TIMEOUT_S")
                view[count:count + len(chunk)] = chunk
                count += len(chunk)
                reached[0] += len(chunk)
        finally:
            body.close()


def fetch(source: RemoteObjects, needs: list[Need], *, ranges_in_flight: Optional[int] = None,
          range_size: Optional[int] = None) -> None:
    """Fetch every need's bytes and hand them to its ``consume``, in order of (object, start); see the module."""
    Fetch(source, [n[:3] for n in needs], ranges_in_flight=ranges_in_flight, range_size=range_size).serve(needs)


class Fetch:
    """The requests for ``spans`` (``(object name, start, end)``), started at once: the first window of them runs
    while the caller has other work (a load's planning), and :meth:`serve` hands the bytes to the needs of exactly
    those spans as :func:`fetch` does. :meth:`cancel` (or the end of :meth:`serve`) waits for the requests in flight
    and gives their memory back; requests not started are never sent."""

    def __init__(self, source: RemoteObjects, spans: list[tuple[str, int, int]], *,
                 ranges_in_flight: Optional[int] = None, range_size: Optional[int] = None) -> None:
        settings = transfers()
        window = ranges_in_flight or settings.ranges_in_flight
        size = range_size or settings.range_size
        self.spans = sorted(spans)
        # The objects a rank reads least of go first: their requests are small and mostly round trips (rank 0 of
        # benchmarks/object_storage.py reads ~100 replicated scalars of 1.5 KB from the other rank's objects), which
        # then run while the load is still planning, not after the bulk of the bytes (0.1 s more for rank 0 there).
        wanted: dict[str, int] = {}
        for name, start, end in self.spans:
            wanted[name] = wanted.get(name, 0) + end - start
        self.order = {name: rank for rank, name in enumerate(sorted(wanted, key=lambda n: (wanted[n], n)))}
        # Small needs apart from each other by more than 1/16 of their merged length (replicated scalars saved
        # among another rank's tensors: rank 0 of benchmarks/object_storage.py made 103 requests of under 64 KiB of
        # its 114) also merge across gaps of up to MAX_GAP, dropping at most 1/256 more of the bytes the rank needs
        # (1/64 took a rank of the benchmark's world-4 load from 1.081x to 1.097x of its shard, by a bound of 1.1x):
        # 45 requests there for 0.64 MiB more of 82 MiB. A request costs a round trip, and a server's time.
        spare = [sum(wanted.values()) // SPARE_PART]
        requests: list[tuple[str, int, int]] = []
        for name in self.order:
            requests += [(name, s, e) for s, e in coalesce(((n[1], n[2]) for n in self.spans if n[0] == name), size,
                                                           spare)]
        self.following = deque(requests)
        self.futures: deque = deque()
        self.fetcher = _Fetcher(source)
        # Requests start from the calling thread and, as one ends, from its worker (a body that came in is not
        # waiting to be consumed in flight): one lock over the queue, the mapping and the count running. Each runs
        # in a copy of the caller's context (taken here: a worker's own is not the load's).
        self.lock = threading.RLock()
        self.context = contextvars.copy_context()
        self.unended, self.starting = set(), False  # futures not known to have ended
        # The window is one of bytes: at most `window` requests, or more small ones (up to SMALL_REQUESTS times as
        # many) while the bytes they ask for stay within `window * size`; so the bodies alive are at most window *
        # size bytes either way. Small requests are mostly round trips (rank 0 of benchmarks/object_storage.py reads
        # ~100 replicated scalars of 1.5 KB from the other rank's shard): four at a time left that rank's fetch twice
        # the other's.
        self.most = window * SMALL_REQUESTS
        # Never more than the requests themselves need: a small fetch maps little, and a window of 64 ranges of 1 GiB
        # is not asked of the kernel for a load of a few MiB.
        self.bodies = _Bodies(min(window * size, sum(e - s for _, s, e in requests) + _ALIGN * len(requests))
                              + _ALIGN) if requests else None
        with self.lock:
            self._start_more()

    def _start_more(self) -> None:
        # Under self.lock. The mapping holds the window's bytes: a request starts when its body fits there (and while
        # fewer than `most` run), so the bodies alive stay within window * size whatever their sizes. Each request
        # runs in a copy of the caller's context: its retries spend the caller's one budget
        # (remote_errors.one_budget, opened by the load) instead of a fresh bound per worker, so an outage fails the
        # load within LFSDP_STORE_TIMEOUT_S, not ranges_in_flight times it.
        self.starting = True
        try:
            while self.following and len(self.unended) < self.most:
                name, start, end = self.following[0]
                into = self.bodies.take(start, end - start)
                if into is None:
                    return
                self.following.popleft()
                body = [into]  # emptied where the request is cancelled before it starts: its task holds no body then
                future = _WORKERS.submit(self.context.copy().run, _get, self.fetcher, name, start, end, body)
                self.unended.add(future)
                self.futures.append(((name, start, end), body, future))
                future.add_done_callback(self._ended)  # at once where it already ended: then starting holds
        finally:
            self.starting = False

    def _ended(self, future: concurrent.futures.Future) -> None:
        with self.lock:
            self.unended.discard(future)
            if not self.starting:  # else this thread is inside _start_more, whose loop goes on
                self._start_more()

    def serve(self, needs: list[Need]) -> None:
        """Hand each need's bytes to its ``consume`` (the needs of the spans given at the start), then end."""
        if sorted(n[:3] for n in needs) != self.spans:
            self.cancel()
            raise RuntimeError("internal error: a fetch served needs other than those it was started for; please"
                               " report it")
        pending = _Pending(sorted(needs, key=lambda n: (self.order[n[0]], n[1], n[2])), self.order)
        assembling: dict[int, tuple[bytearray, list[int]]] = {}  # index in pending.needs -> (buffer, [bytes filled])
        try:
            while True:
                with self.lock:
                    if not self.futures:  # then none is left to start either: one always starts in an empty mapping
                        break
                    (name, start, end), held, future = self.futures.popleft()
                future.result()
                body = held.pop()
                _serve(name, start, end, body, pending, assembling)
                del body  # consumers copy what they keep: the region is the next request's
                with self.lock:
                    self.unended.discard(future)  # its callback may not have run yet
                    self.bodies.give_back()
                    self._start_more()
        finally:
            self.cancel()
        if pending.left:  # cannot happen: every need lies in the requests made for it
            raise RuntimeError(f"internal error: {pending.left} ranges were never served; please report it")

    def cancel(self) -> None:
        """Send no more requests, wait for those in flight, give the memory back (again: nothing)."""
        running = []
        with self.lock:
            self.following.clear()
            while self.futures:
                _, held, future = self.futures.popleft()
                if future.cancel():
                    held.clear()  # its task, still queued, holds the list: the body goes now
                else:
                    running.append(future)
                del held, future
        concurrent.futures.wait(running)  # a worker lets go of its task (and body) before its future is done
        if self.bodies is not None:
            self.bodies.close()  # no request writes into it any more


def _get(fetcher: _Fetcher, name: str, start: int, end: int, body: list) -> None:
    if body:
        fetcher.get(name, start, end, into=body[0])


class _Workers:
    """Daemon threads shared by the fetches of a process: a fetch submits at most its window of requests, and a
    thread starts only when none is idle, so a load runs as many as its window needs; one idle for ``IDLE_S`` ends.
    A pool per fetch started its threads anew for every load, each start a wait for the scheduler (7 % of the calling
    thread's time in a load of benchmarks/object_storage.py, py-spy, 2026-11-29). Daemons: an idle one never holds
    up the end of the process (a request in flight has a caller waiting for it)."""

    IDLE_S = 20.0

    def __init__(self) -> None:
        self.tasks: queue.SimpleQueue = queue.SimpleQueue()
        self.idle = threading.Semaphore(0)

    def submit(self, function: Any, *args: Any, **kwargs: Any) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self.tasks.put((future, function, args, kwargs))
        if not self.idle.acquire(blocking=False):
            threading.Thread(target=self._run, name="lfsdp-range", daemon=True).start()
        return future

    def _run(self) -> None:
        while True:
            try:
                task = self.tasks.get(timeout=self.IDLE_S)
            except queue.Empty:
                if self.idle.acquire(blocking=False):  # else a request was just handed to this thread: take it
                    return
                continue
            future, error = task[0], None
            if future.set_running_or_notify_cancel():
                try:
                    task[1](*task[2], **task[3])
                except BaseException as err:  # noqa: BLE001 (the caller gets it through the future)
                    error = err
            # Let go of the task (its body among its arguments) and count this thread idle before the future is
            # done: the caller may then close the body's mapping, and its next request finds this thread, at once.
            del task
            self.idle.release()
            if error is not None:
                future.set_exception(error)
                del error  # its traceback holds the body
            elif not future.cancelled():
                future.set_result(None)
            del future


def _new_workers() -> None:
    global _WORKERS
    _WORKERS = _Workers()


_WORKERS = _Workers()
os.register_at_fork(after_in_child=_new_workers)  # a forked child has none of its parent's threads


class _Bodies:
    """The bodies of a fetch's requests in flight, in one anonymous mapping (see the module): each request takes the
    lowest free region that fits its body, and regions are given back in request order (the oldest first). Lowest
    first, not round the mapping: the pages touched are those of the most bytes ever in flight at once, not the whole
    mapping (a window that is rarely full touches less). The kernel gives the pages on first touch and takes them back
    at :meth:`close`, whichever thread wrote them."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.map = mmap.mmap(-1, capacity)
        self.view = memoryview(self.map)
        self.live: deque = deque()  # (offset, end) of the regions taken and not given back, oldest first

    def take(self, start: int, length: int) -> Optional[memoryview]:
        """The lowest free ``length`` bytes at an offset congruent to ``start`` modulo ``_ALIGN``; None while they
        fit nowhere."""
        shift = start % _ALIGN
        low = 0
        for offset, end in sorted(self.live) + [(self.capacity, self.capacity)]:
            at = low + (shift - low) % _ALIGN
            if at + length <= offset:
                self.live.append((at, at + length))
                return self.view[at:at + length]
            low = max(low, end)
        return None

    def give_back(self) -> None:
        self.live.popleft()

    def close(self) -> None:
        self.view.release()
        try:
            self.map.close()
        except BufferError:  # a view still held (an error's traceback): unmapped when the last one goes
            pass


class _Pending:
    """The needs not yet served, sorted as the requests are. A request serves needs from the first one unserved
    onwards, so the scan starts at ``head`` (moved past every served need) instead of copying and searching a list
    of every need per request: that was quadratic in the needs (a checkpoint of many small items)."""

    def __init__(self, needs: list, order: dict[str, int]) -> None:
        self.needs, self.order = needs, order  # order: the objects' ranks, as the requests go
        self.served = [False] * len(needs)
        self.head = 0
        self.left = len(needs)

    def serve(self, index: int) -> None:
        self.served[index] = True
        self.left -= 1
        while self.head < len(self.needs) and self.served[self.head]:
            self.head += 1


def _serve(name: str, start: int, end: int, body: memoryview, pending: _Pending,
           assembling: dict[int, tuple[bytearray, list[int]]]) -> None:
    """Hand each pending need that this request's bytes ``[start, end)`` of ``name`` complete to its consumer."""
    for index in range(pending.head, len(pending.needs)):
        if pending.served[index]:
            continue
        need = pending.needs[index]
        need_name, need_start, need_end, consume = need
        if need_name != name:  # the needs are sorted by (object, start), objects in the requests' order
            if pending.order[need_name] > pending.order[name]:
                break
            continue
        if need_start >= end:
            break
        if need_end <= start:
            continue
        if index not in assembling and start <= need_start and need_end <= end:
            pending.serve(index)
            consume(body[need_start - start:need_end - start])
            continue
        buffer, filled = assembling.setdefault(index, (bytearray(need_end - need_start), [0]))
        low, high = max(start, need_start), min(end, need_end)
        buffer[low - need_start:high - need_start] = body[low - start:high - start]
        filled[0] += high - low
        if filled[0] >= need_end - need_start:
            del assembling[index]
            pending.serve(index)
            consume(memoryview(buffer))
