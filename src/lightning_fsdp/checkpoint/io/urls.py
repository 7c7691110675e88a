"""Checkpoint paths that are URLs: which filesystem serves one, and the one error for a missing package.

A path with a scheme (``s3://bucket/run/step-2``, ``gs://``, ``gcs://``, ``az://``, ``abfs://``, ``memory://``, any
protocol fsspec knows) is stored on that filesystem through fsspec; a local path or a ``file://`` URL is a local path
and keeps the local format byte for byte (:mod:`~lightning_fsdp.checkpoint.io.store`). Endpoint and credentials come
from the environment as each filesystem reads them (for S3: ``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ...), and
``storage_options`` (the strategy argument, or ``save_checkpoint(..., storage_options=...)``) is passed to fsspec.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Optional, Union

from lightning_fsdp._base.secrets import shown

__all__ = [
    "is_url", "split_url", "normalize", "join", "basename", "parent", "filesystem", "check_storage_options", "EXTRAS",
    "fresh_info",
]

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*)://")

# The protocol, the package that implements it, and the extra of this project that installs it.
EXTRAS = {
    "s3": ("s3fs", "s3"), "s3a": ("s3fs", "s3"),
    "gs": ("gcsfs", "gcs"), "gcs": ("gcsfs", "gcs"),
    "az": ("adlfs", "azure"), "abfs": ("adlfs", "azure"), "abfss": ("adlfs", "azure"), "adl": ("adlfs", "azure"),
}


def is_url(path: Union[str, Path, Any]) -> bool:
    """True for a path with a scheme other than ``file://``: it is stored through fsspec."""
    if not isinstance(path, str):
        return False
    match = _SCHEME.match(path)
    return bool(match) and match.group(1).lower() != "file"


def local_path(path: Union[str, Path]) -> Path:
    """A local path, ``file://`` removed."""
    text = str(path)
    return Path(text[len("file://"):]) if text.lower().startswith("file://") else Path(text)


def split_url(url: str) -> tuple[str, str]:
    """``("s3", "bucket/run/step-2")``: the protocol and the path below it, without a trailing slash."""
    match = _SCHEME.match(url)
    assert match is not None
    return match.group(1).lower(), url[match.end():].rstrip("/")


def normalize(url: str) -> str:
    """``url`` with its scheme in lower case (``S3://Bucket/x`` is ``s3://Bucket/x``), the rest as given: fsspec
    strips only a lower-case protocol, and would read ``S3:`` as the bucket."""
    match = _SCHEME.match(url)
    return url if match is None else match.group(1).lower() + url[len(match.group(1)):]


def join(url: str, *names: str) -> str:
    return "/".join([url.rstrip("/"), *names])


def basename(url: str) -> str:
    return split_url(url)[1].rsplit("/", 1)[-1]


def parent(url: str) -> str:
    protocol, rest = split_url(url)
    return f"{protocol}://{rest.rsplit('/', 1)[0]}" if "/" in rest else f"{protocol}://{rest}"


def check_storage_options(value: Any, where: str = "storage_options") -> Optional[dict[str, Any]]:
    """``None`` or a dict with string keys, passed to fsspec as keyword arguments."""
    if value is None:
        return None
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise TypeError(
            f"`{where}={shown(value)}` must be a dict of keyword arguments for the fsspec filesystem (or None). HINT: for"
            " an S3-compatible endpoint: `storage_options={'endpoint_url': 'http://host:9000'}`; credentials can also"
            " come from the environment (AWS_ACCESS_KEY_ID, ...)."
        )
    return dict(value)


def filesystem(url: str, storage_options: Optional[dict[str, Any]] = None) -> Any:
    """The fsspec filesystem for ``url``, with ``storage_options``; one clear error when its package is missing."""
    protocol, _ = split_url(url)
    try:
        import fsspec
    except ImportError as err:  # pragma: no cover - Lightning depends on fsspec
        raise ImportError(f"Saving to {url!r} needs fsspec. HINT: `pip install fsspec`.") from err
    package, extra = EXTRAS.get(protocol, (None, None))
    try:
        cls = fsspec.get_filesystem_class(protocol)
    except (ImportError, ValueError) as err:
        if package is None:
            raise ValueError(
                f"The checkpoint path {url!r} has the protocol {protocol!r}, which fsspec does not know ({err})."
                " HINT: use s3://, gs://, az:// or a local path, or install the fsspec package for that protocol."
            ) from err
        raise ImportError(
            f"The checkpoint path {url!r} is on {protocol}://, which needs the package {package!r}. HINT:"
            f' `pip install "lightning-fsdp[{extra}]"`.'
        ) from err
    from lightning_fsdp.checkpoint.io.remote_errors import bounded_filesystem  # a fresh instance, within the bound

    return bounded_filesystem(cls, protocol, storage_options)


def fresh_info(fs: Any, url: str) -> Optional[dict[str, Any]]:
    """What the store says of the object at ``url`` now (not a cached listing), or None when there is none."""
    fs.invalidate_cache(url)
    try:
        return fs.info(url)
    except FileNotFoundError:
        return None
