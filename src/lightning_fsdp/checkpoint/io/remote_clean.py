"""Removing what saves to object storage left behind: the objects of saves that never committed, and their incomplete
multipart uploads (:func:`clean_target`, after every commit), and ``lightning-fsdp clean URL`` (:func:`clean`).
"""

from __future__ import annotations

from typing import Any, Optional

from lightning_fsdp.checkpoint.io.urls import join, split_url

__all__ = ["clean_target"]

def clean_target(fs: Any, target: str, keep: Optional[str]) -> list[str]:
    """Remove the objects of saves that never committed at ``target`` (every token prefix but ``keep``) and abort
    incomplete multipart uploads under it. Returns what was removed."""
    fs.invalidate_cache()
    removed = []
    try:
        names = [_leaf(n) for n in fs.ls(target, detail=False)]
    except FileNotFoundError:
        names = []
    for name in names:
        if name.startswith(".") and name != f".{keep}":
            fs.rm(join(target, name), recursive=True)
            removed.append(join(target, name))
    if hasattr(fs, "list_multipart_uploads"):
        bucket, key, _ = fs.split_path(target)
        for upload in fs.list_multipart_uploads(bucket):
            under = upload.get("Key", "")
            if under.startswith(key + "/.") and not (keep and under.startswith(f"{key}/.{keep}/")):
                fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=under, UploadId=upload["UploadId"])
                removed.append(f"{split_url(target)[0]}://{bucket}/{under} (multipart upload)")
    fs.invalidate_cache()
    return removed


def _leaf(listed: str) -> str:
    """The last name of a path a listing gave (with or without the protocol)."""
    return listed.rstrip("/").rsplit("/", 1)[-1]
