"""Conditional writes on Google Cloud Storage (gcsfs): the object's generation with ``ifGenerationMatch``.

GCS gives every write of an object a new ``generation`` number, and an upload with ``ifGenerationMatch=G`` lands only
if the live object is still at generation ``G`` (``0``: only if there is no live object); otherwise the service
answers 412, which gcsfs raises as ``FileExistsError``. A replace-if-version whose object was removed meanwhile may be
answered 404 instead. Both are a lost race (:func:`put_if` raises :func:`~lightning_fsdp.checkpoint.io.remote_errors.lost_write`).

The upload is one media upload (``uploadType=media``) through gcsfs's own request call, so its credentials, endpoint
(``STORAGE_EMULATOR_HOST``, ``endpoint_url``) and session apply: gcsfs's ``pipe_file`` has no way to pass a
generation (only ``mode="create"``, i.e. ``ifGenerationMatch=0``). A COMMIT is a few kB, so one request holds it.

Untested here: the emulator the tests run (gcp-storage-emulator) ignores ``ifGenerationMatch``. The tests enforce it
in the emulator themselves (``tests/emulators.py``), so they hold what is sent and how a refusal is read, not that
GCS refuses; a save on GCS says so once (``conditional.warn_untested``).
"""

from __future__ import annotations

from typing import Any, Optional

from lightning_fsdp.checkpoint.io.remote_errors import lost_write
from lightning_fsdp.checkpoint.io.urls import fresh_info
from urllib.parse import quote

__all__ = ["version_of", "put_if"]


def version_of(fs: Any, url: str) -> Optional[str]:
    """The generation of the live object at ``url`` (a decimal string), or None when there is none."""
    info = fresh_info(fs, url)
    if info is None:
        return None
    generation = info.get("generation")
    if not generation:
        # Without a generation no condition can be written; saying so beats a silent unconditional write.
        raise RuntimeError(f"The store answered no generation for {url!r} (its listing: {sorted(info)}), so the"
                           " commit cannot be written on condition. HINT: use gcsfs>=2024.12.0 against GCS or an"
                           " emulator of its JSON API.")
    return str(generation)


def put_if(fs: Any, url: str, payload: bytes, version: Optional[str]) -> None:
    """Write ``payload`` at ``url`` only if the live object is still at generation ``version`` (None: only if there is
    none); a refusal raises :func:`~lightning_fsdp.checkpoint.io.remote_errors.lost_write`."""
    bucket, key, _ = fs.split_path(url)
    fs.invalidate_cache(url)
    try:
        fs.call("POST", f"{fs._location}/upload/storage/v1/b/{quote(bucket, safe='')}/o", uploadType="media",
                name=key, ifGenerationMatch=version if version is not None else "0", data=payload,
                headers={"Content-Type": "application/octet-stream"}, json_out=True)
    except FileExistsError as err:  # gcsfs's reading of 412 Precondition Failed
        raise lost_write(url) from err
    except FileNotFoundError as err:
        if version is None:
            raise  # a missing bucket, said by the caller
        raise lost_write(url) from err  # the generation this save began from is gone
    finally:
        fs.invalidate_cache(url)
