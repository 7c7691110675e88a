"""Conditional writes on Azure Blob Storage (adlfs), and the uploads a killed save leaves unfinished there.

The version is the blob's ETag. Create-if-absent is ``If-None-Match: *`` (the SDK's ``upload_blob(overwrite=False)``,
answered 409 ``BlobAlreadyExists``, which adlfs raises as ``FileExistsError``); replace-if-version is ``If-Match:
<etag>`` (``etag=..., match_condition=IfNotModified``, answered 412 ``ConditionNotMet``, the SDK's
``ResourceModifiedError``, also when the blob is gone). Both go through adlfs's ``pipe_file``, which passes them to
``BlobClient.upload_blob``: its credentials and endpoint apply. Azurite enforces both (``tests/test_conditional_stores``).

Unfinished uploads: adlfs uploads a large file as staged blocks, then one ``Put Block List``. A save killed in between
leaves uncommitted blocks under the blob's name: no listing of blobs shows them, Azure drops them after a week, and
until then they count against the account. :func:`uncommitted_blobs` lists them (``include=uncommittedblobs``) and
:func:`discard_uncommitted` removes them.
"""

from __future__ import annotations

import contextlib
from typing import Any, Optional

from lightning_fsdp.checkpoint.io.remote_errors import lost_write
from lightning_fsdp.checkpoint.io.urls import fresh_info

__all__ = ["version_of", "put_if", "uncommitted_blobs", "discard_uncommitted"]


def version_of(fs: Any, url: str) -> Optional[str]:
    """The ETag of the blob at ``url``, or None when there is none."""
    info = fresh_info(fs, url)
    if info is None:
        return None
    if info.get("type") == "directory" or not info.get("etag"):
        # A folder (blobs under that name as a prefix) has no ETag: no condition could be written over it.
        raise RuntimeError(f"{url!r} is a folder or answered no ETag (its listing: {sorted(info)}), so the commit"
                           " cannot be written on condition. HINT: remove what is at that name, or choose another"
                           " checkpoint path.")
    return str(info["etag"])


def put_if(fs: Any, url: str, payload: bytes, version: Optional[str]) -> None:
    """Write ``payload`` at ``url`` only if the blob is still at ETag ``version`` (None: only if there is none); a
    refusal raises :func:`~lightning_fsdp.checkpoint.io.remote_errors.lost_write`."""
    from azure.core import MatchConditions
    from azure.core.exceptions import ResourceExistsError, ResourceModifiedError, ResourceNotFoundError

    condition: dict[str, Any] = {"overwrite": False} if version is None else {
        "overwrite": True, "etag": version, "match_condition": MatchConditions.IfNotModified}
    fs.invalidate_cache(url)
    try:
        fs.pipe_file(url, payload, **condition)
    except (FileExistsError, ResourceExistsError, ResourceModifiedError) as err:
        raise lost_write(url) from err
    except ResourceNotFoundError as err:
        if version is None:
            raise FileNotFoundError(f"{url!r}: {err}. HINT: create the container, or fix the checkpoint URL.") from err  # a missing container
        raise lost_write(url) from err
    finally:
        fs.invalidate_cache(url)


def _container_client(fs: Any, url: str) -> tuple[Any, str]:
    container, prefix, _ = fs.split_path(url)
    return fs.service_client.get_container_client(container), prefix


def uncommitted_blobs(fs: Any, prefix_url: str) -> list[str]:
    """The URLs under ``prefix_url`` whose blob has uncommitted blocks and no committed content (a killed upload)."""
    import fsspec.asyn

    protocol = prefix_url.split("://", 1)[0]

    async def listed() -> list[str]:
        client, prefix = _container_client(fs, prefix_url)
        names = []
        async for blob in client.list_blobs(name_starts_with=prefix.rstrip("/") + "/", include=["uncommittedblobs"]):
            # An uncommitted blob is listed with size 0 and no content type of a committed one; a committed blob is
            # listed the same with or without the include, so only the names missing from a plain listing count.
            names.append(blob.name)
        committed = set()
        async for blob in client.list_blobs(name_starts_with=prefix.rstrip("/") + "/"):
            committed.add(blob.name)
        return [f"{protocol}://{client.container_name}/{n}" for n in names if n not in committed]
    return fsspec.asyn.sync(fs.loop, listed)


def discard_uncommitted(fs: Any, urls: list[str]) -> list[str]:
    """Remove the uncommitted blocks of each blob in ``urls`` (from :func:`uncommitted_blobs`): delete the blob, and
    where the service refuses that for a blob that has no committed content, commit an empty block list first, only
    if no committed blob appeared there meanwhile (``If-None-Match: *``), then delete it. Returns what was removed."""
    import fsspec.asyn
    from azure.core import MatchConditions
    from azure.core.exceptions import ResourceExistsError, ResourceModifiedError, ResourceNotFoundError

    async def discard(url: str) -> bool:
        client, name = _container_client(fs, url)
        blob = client.get_blob_client(name)
        try:
            await blob.delete_blob()
            return True
        except ResourceNotFoundError:
            pass
        try:
            await blob.commit_block_list([], etag="*", match_condition=MatchConditions.IfMissing)
        except (ResourceExistsError, ResourceModifiedError):
            return False  # a committed blob is there now: not ours to remove
        with contextlib.suppress(ResourceNotFoundError):
            await blob.delete_blob()
        return True

    removed = [url for url in urls if fsspec.asyn.sync(fs.loop, discard, url)]
    fs.invalidate_cache()
    return removed
