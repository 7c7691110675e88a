"""The requests of one streamed upload (issue 43): S3 multipart through s3fs's own client, or any other fsspec store
through its file object. :mod:`.sink` decides what to send and when; this module only sends.

- **S3** (:class:`S3Upload`): ``create_multipart_upload``, ``upload_part``, ``complete_multipart_upload`` with
  ``If-None-Match: *`` (a token collision fails instead of replacing an object), ``abort_multipart_upload``; an
  object under one part is one ``put_object`` with the same condition, sent through obstore where the filesystem
  translates to it (:mod:`.transport_put`: less of the rank's CPU per byte), else through s3fs. The requests are
  coroutines run on s3fs's own event loop (the one its client lives on; obstore's are awaited there too), so several
  parts are in flight while the writer fills the next.
- **Retries do not stack**: s3fs and botocore are at one attempt (:func:`.remote_errors.client_options`), and ours
  retry one *request*, never the whole object: a part that fails is sent again alone, from the buffer the sink keeps
  until it succeeds. Every request of one upload shares one budget of ``LFSDP_STORE_TIMEOUT_S``, spent as
  :func:`.remote_errors.retrying` spends it (a request that got no answer spends its wait, each backoff its sleep),
  so the whole upload fails within the bound when the store stops answering. The budget is passed in, not read from
  the context: the requests run on the loop's thread, where the caller's context variables are not visible.
- **A lost reply is no conflict**: a store may apply a request whose answer never arrives (the connection is cut on
  the way back). Sent again, the conditional PUT or complete is then refused (412: the object is there now; a store
  that forgot the completed upload: 404 ``NoSuchUpload``), by our own object. So such a refusal is checked with a
  HEAD: the object is ours when it carries this upload's own mark (``x-amz-meta-lfsdp-upload``, a random value sent
  with its PUT or its multipart create) and the size we sent; only otherwise is it another writer's
  (:func:`~.remote_errors.lost_write`). Every refusal is checked, not only one of our own retries: aiohttp resends
  a PUT once by itself when a reused connection breaks and its body can be replayed, so the attempt that was
  applied may not be one we counted (a real conflict costs one HEAD more).
- **Other stores** (:class:`FileUpload`): ``fs.open(url, "wb", block_size=part_size)``, written in order, one part
  at a time (gcsfs and adlfs upload their blocks as the buffer fills). Still nothing on local disk.
"""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from typing import Any, Optional

from lightning_fsdp.checkpoint.io import remote_errors
from lightning_fsdp.checkpoint.io.remote_errors import explain, lost_write, transient
from lightning_fsdp.checkpoint.io.transport_download import Unplaced
from lightning_fsdp.checkpoint.io.transport_put import puts_for

__all__ = ["Budget", "S3Upload", "FileUpload", "PartBody", "is_s3"]

PIECE = 2**20  # bytes handed to the socket at once from a part buffer (what aiohttp and asyncio copy, at most)
MARK = "lfsdp-upload"  # the user metadata (x-amz-meta-...) that tells this upload's object from any other writer's


def is_s3(fs: Any) -> bool:
    """Whether ``fs`` is s3fs (its async client calls are what :class:`S3Upload` sends)."""
    return getattr(fs, "_call_s3", None) is not None and getattr(fs, "loop", None) is not None


class Budget:
    """One upload's share of the bound: every failed request of it spends what it waited, every backoff its sleep.
    Touched only on the event loop's thread (one coroutine at a time), so it needs no lock."""

    def __init__(self) -> None:
        self.bound = remote_errors.store_timeout_s()
        self.per_request = remote_errors.request_timeout_s(self.bound)
        self.spent = 0.0
        self.first_failure: Optional[float] = None
        self._until = -math.inf

    def spend(self, start: float, end: float) -> None:
        """Count the failed time ``[start, end]`` less what was counted already: the parts in flight of one upload
        fail through one outage together, and must spend the bound once, not once per part (as the reads'
        budget in ``remote_errors`` does)."""
        self.spent += max(0.0, end - max(start, self._until))
        self._until = max(self._until, end)


def _codes(err: BaseException) -> set[str]:
    from lightning_fsdp.checkpoint.io.conditional import _codes as codes

    return codes(err)


class S3Upload:
    """The requests of one object's upload to S3, each retried alone within the upload's :class:`Budget`."""

    def __init__(self, fs: Any, url: str, budget: Optional[Budget] = None) -> None:
        self.fs, self.url = fs, url
        self.bucket, self.key, _ = fs.split_path(url)
        self.budget = budget or Budget()
        self.upload_id: Optional[str] = None
        self.requests = 0  # sent, retries included (what a test counts)
        self.mark = uuid.uuid4().hex  # this upload's own, on the object it makes (see the module: a lost reply)
        self._sizes: dict[int, int] = {}  # part number -> bytes, for the size a completed object must have
        self.fast = puts_for(fs)  # obstore for the single PUTs, or None: s3fs for every request

    @property
    def loop(self) -> Any:
        return self.fs.loop

    async def _request(self, method: str, body: Any = None, *, size: Optional[int] = None, **kwargs: Any) -> Any:
        """One request, again after a transient failure (with backoff) while the budget allows, then the error that
        names the URL, what was being done, the attempts and the bound. ``body``: the bytes to send, each attempt
        reading them afresh through a :class:`PartBody` (never copied). ``size``: for a conditional request that
        makes the object, its size: a refusal is then an earlier attempt's success when the object there is ours
        (:meth:`_ours`)."""
        budget, attempt, first = self.budget, 0, time.monotonic()
        while True:
            attempt += 1
            started = time.monotonic()
            self.requests += 1
            if body is not None:
                kwargs["Body"] = PartBody(body)
            try:
                return await self._send(method, kwargs)
            except Exception as err:  # noqa: BLE001 - transient ones are retried, the rest said with the URL
                codes = _codes(err)
                exists = bool(codes & {"PreconditionFailed", "412"})  # If-None-Match on a key that exists
                # A complete sent again after it landed: the store may have forgotten the upload it completed.
                forgotten = method == "complete_multipart_upload" and bool(codes & {"NoSuchUpload", "404"})
                if size is not None and (exists or forgotten) and await self._ours(size):
                    return {}  # an earlier attempt of this request was applied; only its answer was lost
                if exists:
                    raise lost_write(self.url) from err  # not ours to replace
                now = time.monotonic()
                unanswered = min(now - started, budget.per_request)
                budget.spend(now - unanswered, now)
                if budget.first_failure is None:
                    budget.first_failure = now - unanswered
                left = min(budget.bound - budget.spent, budget.bound - (now - budget.first_failure)) \
                    - budget.per_request
                if transient(err) and left >= 0 and (remote_errors.ATTEMPTS is None
                                                     or attempt < remote_errors.ATTEMPTS):
                    wait = min(remote_errors.BACKOFF_S * 2 ** (attempt - 1), remote_errors.MAX_BACKOFF_S, left)
                    slept = time.monotonic()
                    await asyncio.sleep(wait)
                    budget.spend(slept, time.monotonic())
                    continue
                raise explain(err, self.url, "uploading to", attempts=attempt, seconds=time.monotonic() - first,
                              bound=budget.bound) from err

    async def _send(self, method: str, kwargs: dict[str, Any]) -> Any:
        """One attempt: a conditional single PUT through obstore where the filesystem translates to it
        (:mod:`.transport_put`), anything else (and a PUT whose answer obstore could not place) through s3fs."""
        fast = self.fast
        if fast is not None and fast.on and method == "put_object" and kwargs.get("IfNoneMatch") == "*":
            try:
                return await fast.put(self.bucket, self.key, kwargs["Body"].view, kwargs.get("Metadata"))
            except Unplaced:
                fast.on = False  # obstore could not place the answer: this filesystem's PUTs go to s3fs from now on
        return await self.fs._call_s3(method, Bucket=self.bucket, Key=self.key, **kwargs)

    async def _ours(self, size: int) -> bool:
        """Whether the object at the key now is the one this upload made: its mark and the size sent. A HEAD
        retried like any request; no object (removed meanwhile, or never made) is not ours."""
        try:
            head = await self._request("head_object")
        except FileNotFoundError:
            return False
        return (head.get("Metadata") or {}).get(MARK) == self.mark and head.get("ContentLength") == size

    async def put_whole(self, data: Any) -> None:
        """The whole object in one PUT, only if no object is at its key."""
        await self._request("put_object", body=data, size=memoryview(data).nbytes, IfNoneMatch="*",
                            Metadata={MARK: self.mark})

    async def create(self) -> None:
        answer = await self._request("create_multipart_upload", Metadata={MARK: self.mark})
        self.upload_id = answer["UploadId"]

    async def put_part(self, number: int, data: Any) -> dict[str, Any]:
        """Part ``number`` (from 1); ``data`` is kept by the caller until this returns, so a retry resends it."""
        self._sizes[number] = memoryview(data).nbytes
        answer = await self._request("upload_part", body=data, UploadId=self.upload_id, PartNumber=number)
        return {"PartNumber": number, "ETag": answer["ETag"]}

    async def complete(self, parts: list[dict[str, Any]]) -> None:
        size = sum(self._sizes[p["PartNumber"]] for p in parts)
        await self._request("complete_multipart_upload", size=size, UploadId=self.upload_id,
                            MultipartUpload={"Parts": sorted(parts, key=lambda p: p["PartNumber"])},
                            IfNoneMatch="*")

    async def abort(self) -> None:
        if self.upload_id is not None:
            await self.fs._call_s3("abort_multipart_upload", Bucket=self.bucket, Key=self.key,
                                   UploadId=self.upload_id)

    async def delete(self) -> None:
        """Remove the object this upload made (a shard of several objects whose later one failed: best effort, once;
        what is left under the save's token is swept like any uncommitted object)."""
        await self.fs._call_s3("delete_object", Bucket=self.bucket, Key=self.key)


class PartBody:
    """A part's bytes as the request body, read in views of the caller's buffer, never copied whole.

    Given a ``bytearray`` as ``Body``, the client copies the part about three times while it is in flight (measured
    with tracemalloc, ``tests/test_save_speed_parts.py``): aiohttp slices it to the Content-Length (a bytearray
    slice is a copy), joins it with the request headers (Python < 3.12.9), and asyncio's socket transport copies
    what the socket did not take at once into its own buffer, held until sent. Those copies, up to 3x part_size
    per part in flight, were most of a save's peak memory above its own buffers. Handed over in ``PIECE``
    views instead (aiohttp streams an async iterable with the Content-Length botocore set), each copy is at most a
    piece. botocore reads it as a file (``read``/``seek``/``tell``, ``len``) for the payload hash and the checksum,
    also by views."""

    def __init__(self, data: Any) -> None:
        self._view = memoryview(data).cast("B")
        self._position = 0

    def __len__(self) -> int:
        return len(self._view)

    @property
    def view(self) -> memoryview:
        """The whole body, uncopied (what obstore sends)."""
        return self._view

    def __bytes__(self) -> bytes:  # a copy, for whoever asks for one (a test's fake client)
        return self._view.tobytes()

    def read(self, size: int = -1) -> memoryview:
        end = len(self._view) if size is None or size < 0 else min(len(self._view), self._position + size)
        piece = self._view[self._position:end]
        self._position = max(self._position, end)
        return piece

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._position, 2: len(self._view)}[whence]
        self._position = max(0, base + offset)
        return self._position

    def tell(self) -> int:
        return self._position

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True

    async def __aiter__(self) -> Any:
        # The whole body from its start, whatever botocore's reads left the position at.
        for start in range(0, len(self._view), PIECE):
            yield self._view[start:start + PIECE]


class FileUpload:
    """Any other fsspec store: its own write-mode file, which uploads a block each time ``part_size`` bytes are
    buffered, and publishes the object only at ``close``. Sequential; an error discards what it began."""

    def __init__(self, fs: Any, url: str, part_size: int) -> None:
        self.fs, self.url = fs, url
        self.file = fs.open(url, "wb", block_size=part_size)

    def write(self, data: Any) -> None:
        try:
            self.file.write(data)
        except Exception as err:  # noqa: BLE001
            raise explain(err, self.url, "uploading to") from err

    def finish(self) -> None:
        try:
            self.file.close()
        except Exception as err:  # noqa: BLE001
            raise explain(err, self.url, "uploading to") from err
        self.fs.invalidate_cache(self.url)

    def abort(self) -> None:
        discard = getattr(self.file, "discard", None)
        if callable(discard):  # fsspec's buffered files: drops the buffer and aborts what the store began
            discard()
        # Never `close`: closing publishes the object. Some files (``memory://``) publish it at open, and their
        # `discard` does nothing: remove that key (a fresh one, under this save's own token prefix).
        try:
            self.fs.rm_file(self.url)
        except FileNotFoundError:
            pass
