"""Conditional writes of the one object that commits a checkpoint: each store's own precondition, said once.

A ``COMMIT`` is written "only if absent" over a new path and "only if it is still the version this save saw" over an
existing checkpoint, so that of two writers racing for one path exactly one wins and the other is told. Each store
spells the version and the precondition in its own way (S3: the ETag with ``If-Match`` / ``If-None-Match: *``).

- :func:`version_of`: the version of the object at ``url`` now (None when there is none);
- :func:`put_if`: write ``payload`` at ``url`` only if its version is still ``version`` (None: only if absent);
  a lost race is ``FileExistsError`` naming the path.

GCS (the generation with ``ifGenerationMatch``, :mod:`.conditional_gcs`) and Azure (the ETag with ``If-Match`` /
``If-None-Match: *``, :mod:`.conditional_azure`) have branches of their own.
"""

from __future__ import annotations

import errno
from typing import Any, Optional

from lightning_fsdp.checkpoint.io import conditional_azure, conditional_gcs

__all__ = ["version_of", "put_if", "supports_conditions", "UNTESTED"]

# GCS and Azure: each store's own condition (``conditional_gcs``, ``conditional_azure``), chosen by fsspec protocol.
_STORES = {"gs": conditional_gcs, "gcs": conditional_gcs, "abfs": conditional_azure, "az": conditional_azure,
           "abfss": conditional_azure}
# The stores whose refusal of a lost race no test here has seen (their emulator ignores the condition): a save there
# says so once per process (:func:`warn_untested`).
UNTESTED = {conditional_gcs: ("GCS", "gcp-storage-emulator, which the tests run, ignores ifGenerationMatch: they hold"
                                     " the condition sent and how a refusal is read, not that GCS refuses")}
_WARNED: set[Any] = set()


def _store_of(fs: Any) -> Any:
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
    return getattr(fs, "call_s3", None) is not None or _store_of(fs) is not None


def version_of(fs: Any, url: str) -> Optional[str]:
    """The version token of the object at ``url`` (S3 and Azure: its ETag; GCS: its generation), or None when there
    is no object."""
    store = _store_of(fs)
    if store is not None:
        return store.version_of(fs, url)
    fs.invalidate_cache(url)
    try:
        info = fs.info(url)
    except FileNotFoundError:
        return None
    return info.get("ETag") or info.get("etag") or ""


def put_if(fs: Any, url: str, payload: bytes, version: Optional[str]) -> None:
    """Write ``payload`` at ``url`` only if the object there is still at ``version`` (None: only if there is none)."""
    store = _store_of(fs)
    if store is not None:
        warn_untested(store)
        store.put_if(fs, url, payload, version, _lost)
        return
    fs.invalidate_cache(url)
    if not supports_conditions(fs):  # a store without conditional writes here: one PUT, still atomic for readers
        fs.pipe_file(url, payload)
        return
    bucket, key, _ = fs.split_path(url)
    condition = {"IfMatch": version} if version else {"IfNoneMatch": "*"}
    try:
        fs.call_s3("put_object", Bucket=bucket, Key=key, Body=payload, **condition)
    except Exception as err:  # noqa: BLE001 - a lost race is said as such; anything else goes on
        if "PreconditionFailed" in repr(err) or "412" in str(err):
            raise FileExistsError(errno.EEXIST, f"Another save committed {url.rsplit('/', 1)[0]!r} while this"
                                  " one was uploading, so this one was not committed (the other one stands)."
                                  " HINT: give each writer its own checkpoint path.") from err
        raise
    fs.invalidate_cache(url)


def _lost(url: str) -> FileExistsError:
    return FileExistsError(errno.EEXIST, f"Another save committed {url.rsplit('/', 1)[0]!r} while this one was"
                           " uploading, so this one was not committed (the other one stands). HINT: give each writer"
                           " its own checkpoint path.")
