"""Conditional writes of the one object that commits a checkpoint: each store's own precondition, said once.

A ``COMMIT`` is written "only if absent" over a new path and "only if it is still the version this save saw when it
began" over an existing checkpoint, so that of two writers racing for one path exactly one wins and the other is
told. Each store spells the version and the precondition in its own way (S3: the ETag with ``If-Match`` /
``If-None-Match: *``).

- :func:`version_of`: the version of the object at ``url`` now (None when there is none);
- :func:`put_if`: write ``payload`` at ``url`` only if its version is still ``version`` (None: only if absent);
  a lost race is ``FileExistsError`` naming the path. A refusal whose object holds exactly ``payload`` is no lost
  race but this write itself, applied by an earlier attempt whose answer was lost (a retry of ours, or the client's
  own: gcsfs and the Azure SDK retry a request whose connection was cut); ``payload`` names its save's token and
  time, so no other save writes the same bytes. So a caller may send it again after a failure it could not read.

GCS (the generation with ``ifGenerationMatch``, :mod:`.conditional_gcs`) and Azure (the ETag with ``If-Match`` /
``If-None-Match: *``, :mod:`.conditional_azure`) have branches of their own. A store without conditional writes here
(``memory://`` and other fsspec filesystems) compares the version just before its one PUT: a narrow window instead
of none.
"""

from __future__ import annotations

import errno
import time
from typing import Any, Optional

from lightning_fsdp.checkpoint.io import conditional_azure, conditional_gcs
from lightning_fsdp.checkpoint.io.remote_errors import lost_write, transient
from lightning_fsdp.checkpoint.io.urls import fresh_info

__all__ = ["version_of", "put_if", "supports_conditions", "lost_race", "store_of", "UNTESTED"]

# GCS and Azure: each store's own condition (``conditional_gcs``, ``conditional_azure``), chosen by fsspec protocol.
_STORES = {"gs": conditional_gcs, "gcs": conditional_gcs, "abfs": conditional_azure, "az": conditional_azure,
           "abfss": conditional_azure}
# The stores whose refusal of a lost race no test here has seen (their emulator ignores the condition): a save there
# says so once per process (:func:`warn_untested`).
UNTESTED = {conditional_gcs: ("GCS", "gcp-storage-emulator, which the tests run, ignores ifGenerationMatch: they hold"
                                     " the condition sent and how a refusal is read, not that GCS refuses")}
_WARNED: set[Any] = set()


def store_of(fs: Any) -> Any:
    """The module of the store-specific condition for ``fs`` (None: S3, or a store without one)."""
    if getattr(fs, "call_s3", None) is not None:
        return None
    protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    return next((_STORES[p] for p in protocols if p in _STORES), None)


def warn_untested(store: Any) -> None:
    """Warn once per process that ``store``'s conditional commit is untested here (see :data:`UNTESTED`)."""
    if store in UNTESTED and store not in _WARNED:
        _WARNED.add(store)
        import warnings

        name, why = UNTESTED[store]
        warnings.warn(f"Saving a checkpoint to {name}: its conditional commit (of two saves racing for one checkpoint"
                      f" path, one commits and the other fails) is untested in lightning-fsdp ({why}). HINT: give each"
                      " job its own checkpoint path.", UserWarning, stacklevel=3)


def supports_conditions(fs: Any) -> bool:
    """Whether this filesystem's writes of a COMMIT are conditional here."""
    return getattr(fs, "call_s3", None) is not None or store_of(fs) is not None


def version_of(fs: Any, url: str) -> Optional[str]:
    """The version token of the object at ``url`` (S3 and Azure: its ETag; GCS: its generation), or None when there
    is no object."""
    store = store_of(fs)
    if store is not None:
        return store.version_of(fs, url)
    info = fresh_info(fs, url)
    if info is None:
        return None
    tag = info.get("ETag") or info.get("etag") or info.get("generation")
    if tag:
        return str(tag)
    # No version field (memory://): when and how large; a replaced COMMIT differs in one (it records its own time).
    return repr((info.get("created") or info.get("mtime") or info.get("last_modified"), info.get("size")))


def put_if(fs: Any, url: str, payload: bytes, version: Optional[str]) -> None:
    """Write ``payload`` at ``url`` only if the object there is still at ``version`` (None: only if there is none).
    Sent again after an attempt whose answer was lost, it succeeds when that attempt was applied (see the module)."""
    try:
        _put_if(fs, url, payload, version)
    except FileExistsError:
        if _holds(fs, url, payload):
            return
        raise


def _holds(fs: Any, url: str, payload: bytes) -> bool:
    """Whether the object at ``url`` is exactly ``payload`` (a COMMIT: a few kB, read only after a refusal)."""
    fs.invalidate_cache(url)
    try:
        return fs.cat_file(url) == payload
    except FileNotFoundError:
        return False
    except Exception as err:  # noqa: BLE001
        if transient(err):
            raise  # cannot tell yet: the caller's retry sends it again, and asks again
        return False  # unreadable here: the refusal stands, as before


def _put_if(fs: Any, url: str, payload: bytes, version: Optional[str]) -> None:
    store = store_of(fs)
    if store is not None:
        warn_untested(store)
        store.put_if(fs, url, payload, version)
        return
    fs.invalidate_cache(url)
    if not supports_conditions(fs):  # a store without conditional writes here: compare, then one atomic PUT
        if version_of(fs, url) != version:
            raise lost_write(url)
        fs.pipe_file(url, payload)
        fs.invalidate_cache(url)
        return
    bucket, key, _ = fs.split_path(url)
    condition = {"IfMatch": version} if version else {"IfNoneMatch": "*"}
    try:
        fs.call_s3("put_object", Bucket=bucket, Key=key, Body=payload, **condition)
    except Exception as err:  # noqa: BLE001 - a lost race is said as such; anything else goes on
        codes = _codes(err)
        # If-Match on an object removed meanwhile: some stores answer 404 (NoSuchKey), not 412. Either way the
        # version this save began from is gone. 409: another conditional write to it is in flight.
        if codes & {"PreconditionFailed", "412", "ConditionalRequestConflict", "409"} or (
                version and codes & {"NoSuchKey", "404"}):
            raise lost_write(url) from err
        raise
    fs.invalidate_cache(url)


def _codes(err: BaseException) -> set[str]:
    """The S3 error codes and HTTP statuses in ``err`` and its causes. s3fs turns a 412 into an ``OSError`` whose
    text is the server's message alone ("At least one of the pre-conditions you specified did not hold"), keeping
    botocore's error, with the code, as its cause."""
    codes, seen = set(), 0
    while err is not None and seen < 8:
        response = getattr(err, "response", None)
        if isinstance(response, dict):
            codes.add(str(response.get("Error", {}).get("Code", "")))
            codes.add(str(response.get("ResponseMetadata", {}).get("HTTPStatusCode", "")))
        if "pre-conditions you specified did not hold" in str(err):
            codes.add("PreconditionFailed")
        err, seen = err.__cause__ or err.__context__, seen + 1
    return codes


def lost_race(target: str, current: Optional[dict[str, Any]]) -> FileExistsError:
    """The error of a save whose COMMIT lost its condition, naming the URL and what is there now (``current``: the
    COMMIT record there, None when there is none)."""
    if current is None:
        other = "it was removed (retention, or another process)"
    else:
        when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(current.get("time", 0)))
        other = f"another save committed there (token {current['token']}, at {when})"
    return FileExistsError(errno.EEXIST, f"The checkpoint {target!r} changed after this save began: {other}. So"
                           " this save was not committed, and what is there now stands. HINT: give each job its own"
                           " checkpoint path (two jobs saving to one URL replace each other's checkpoints), or save"
                           " again to replace it.")
