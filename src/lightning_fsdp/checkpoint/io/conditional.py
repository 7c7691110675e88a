"""Conditional writes of the one object that commits a checkpoint: each store's own precondition, said once.

A ``COMMIT`` is written "only if absent" over a new path and "only if it is still the version this save saw" over an
existing checkpoint, so that of two writers racing for one path exactly one wins and the other is told. Each store
spells the version and the precondition in its own way (S3: the ETag with ``If-Match`` / ``If-None-Match: *``).

- :func:`version_of`: the version of the object at ``url`` now (None when there is none);
- :func:`put_if`: write ``payload`` at ``url`` only if its version is still ``version`` (None: only if absent);
  a lost race is ``FileExistsError`` naming the path.
"""

from __future__ import annotations

import errno
from typing import Any, Optional

__all__ = ["version_of", "put_if", "supports_conditions"]


def supports_conditions(fs: Any) -> bool:
    """Whether this filesystem's writes of a COMMIT are conditional here."""
    return getattr(fs, "call_s3", None) is not None


def version_of(fs: Any, url: str) -> Optional[str]:
    """The version token of the object at ``url`` (S3: its ETag), or None when there is no object."""
    fs.invalidate_cache(url)
    try:
        info = fs.info(url)
    except FileNotFoundError:
        return None
    return info.get("ETag") or info.get("etag") or ""


def put_if(fs: Any, url: str, payload: bytes, version: Optional[str]) -> None:
    """Write ``payload`` at ``url`` only if the object there is still at ``version`` (None: only if there is none)."""
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
