"""The single PUTs of a save's objects to S3 through obstore (Rust, outside the GIL) instead of s3fs, when the
user's s3fs filesystem translates to obstore exactly as a load's ranged GETs do (issue 43 item 6).

Why: a sharded save of a few parts is one conditional PUT per object (:mod:`.sink`). Through s3fs each PUT costs
the rank's Python time: botocore computes a CRC-32 of the body and, over plain HTTP, its SHA-256 for the signature,
and aiohttp and asyncio hand the body to the socket in pieces on the one event-loop thread, holding the GIL the
writer needs for ``torch.save`` and the hashes. Measured against moto on this machine (10 PUTs of 8 MiB, 2026-11-29):
s3fs 1.7-1.9 CPU seconds per GB in the sending process, obstore 0.9 (the SHA-256 of the signature, in Rust).

What is translated, and when s3fs is kept: exactly :func:`.transport_download.client_for`'s rules (the endpoint,
region, addressing style and credentials that the filesystem's botocore client resolved; anything else keeps s3fs;
``LFSDP_S3_CLIENT=s3fs`` turns both off). The payload is signed when botocore would sign it: over plain HTTP, or when
the filesystem asks for it (``payload_signing_enabled``); over HTTPS botocore sends it unsigned, TLS guarding it, and
so does this module.

What stays as it is (:class:`.transport_upload.S3Upload` drives both clients alike):

- the condition: ``mode="create"`` is ``If-None-Match: *``, and the store's refusal (412) is said as s3fs's is, so
  that the caller checks with a HEAD whether the object there is its own (the ``lfsdp-upload`` mark, sent as the
  same user metadata) before it says that another writer got there first;
- one retry bound: obstore retries nothing (``max_retries=0``), each PUT is one attempt of the caller's budget;
- errors as s3fs's (a refusal ``PermissionError``, a missing bucket ``FileNotFoundError``, a 5xx or a broken
  connection ``ConnectionError``), with what an S3 error body echoes of the signature masked, and obstore's own
  exception not chained (its text holds that body);
- an answer obstore cannot place turns the fast path off for that filesystem, and the PUT goes to s3fs (the same
  mark: if the first attempt landed after all, the refusal is recognised as ours).

Multipart uploads (an object over one part) stay with s3fs: their parts, complete and abort share one upload id,
which obstore's multipart writer keeps to itself.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Optional

from lightning_fsdp.checkpoint.io import transport_download
from lightning_fsdp.checkpoint.io.transport_download import said_as_s3fs

__all__ = ["puts_for", "FastPuts", "Refused"]

_PUTS: "weakref.WeakKeyDictionary[Any, FastPuts]" = weakref.WeakKeyDictionary()  # by the loads' reader
_LOCK = threading.Lock()


class Refused(OSError):
    """The store refused a conditional PUT (412: an object is at the key), said with the code and status where
    s3fs's error carries them (``response``), so that the caller's checks read both clients' errors alike."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.response = {"Error": {"Code": "PreconditionFailed"}, "ResponseMetadata": {"HTTPStatusCode": 412}}


def puts_for(fs: Any) -> Optional["FastPuts"]:
    """The obstore PUTs for the s3fs filesystem ``fs``, made once per filesystem; None: keep s3fs. Asked each time,
    as the loads' reader is (``LFSDP_S3_CLIENT`` is read then, also for a filesystem s3fs took from its cache)."""
    ranges = transport_download.client_for(fs)  # the translation, and the decision to keep s3fs, are the loads'
    if ranges is None:
        return None
    with _LOCK:
        made = _PUTS.get(ranges)
        if made is None:
            made = _PUTS[ranges] = FastPuts(fs, ranges)
        return made


def _signs_payload(fs: Any, kwargs: dict[str, Any]) -> bool:
    """Whether botocore would put the body's SHA-256 in the signature: over plain HTTP always, over HTTPS only when
    the filesystem's ``config_kwargs={"s3": {"payload_signing_enabled": True}}`` asks for it."""
    if (kwargs.get("client_options") or {}).get("allow_http"):
        return True
    s3 = (getattr(fs, "config_kwargs", None) or {}).get("s3") or {}
    return bool(s3.get("payload_signing_enabled"))


class FastPuts:
    """Conditional single PUTs of one s3fs filesystem's objects through obstore, one ``S3Store`` per bucket, with
    the settings of the loads' reader (:class:`.transport_download.FastRanges`) for the same filesystem."""

    def __init__(self, fs: Any, ranges: Any) -> None:
        self.fs = fs
        self.on = True  # off once an answer could not be placed: the rest goes to s3fs
        self._kwargs = dict(ranges._kwargs)
        if not _signs_payload(fs, self._kwargs):
            self._kwargs["unsigned_payload"] = True
        self._stores: dict[str, Any] = {}
        self._lock = threading.Lock()

    def _store(self, bucket: str) -> Any:
        with self._lock:
            if bucket not in self._stores:
                from obstore.store import S3Store

                kwargs = dict(self._kwargs)
                if "." in bucket and "endpoint" not in kwargs:
                    kwargs["virtual_hosted_style_request"] = False  # as the reader does: AWS's TLS certificate
                self._stores[bucket] = S3Store(bucket, **kwargs)
            return self._stores[bucket]

    async def put(self, bucket: str, key: str, body: Any, metadata: Optional[dict[str, str]] = None) -> dict:
        """One attempt of ``PUT bucket/key`` with ``If-None-Match: *``, the body read from ``body`` (a buffer, not
        copied: the caller keeps it until this returns) and ``metadata`` as user metadata. Raises as s3fs would
        (:class:`Refused` for the 412), or :class:`~.transport_download.Unplaced`."""
        import obstore
        from obstore.exceptions import AlreadyExistsError, PreconditionError

        try:
            answer = await obstore.put_async(self._store(bucket), key, body, mode="create",
                                             attributes=dict(metadata or {}), use_multipart=False)
        except (AlreadyExistsError, PreconditionError) as err:
            text = transport_download.masked_body(str(err))
            first = text.strip().splitlines()[0][:300] if text.strip() else ""
            raise Refused(f"PreconditionFailed: {first}. HINT: another writer holds this key; the save's own"
                          " recovery checks whether it is this save's") from None
        except Exception as err:  # noqa: BLE001
            raise said_as_s3fs(err) from None  # obstore's text holds the body unmasked
        return {"ETag": answer.get("e_tag")}
