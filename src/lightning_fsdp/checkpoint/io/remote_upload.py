"""The upload side of a save to object storage: this rank's staged files, put under the save's token prefix.

What each returns is the rank's part of the COMMIT record: ``{name: [size, digest or None]}`` (digests only for
objects under :data:`DIGEST_BELOW`, see :mod:`.remote`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import xxhash

from lightning_fsdp.checkpoint.io.urls import join

__all__ = ["upload", "DIGEST_BELOW"]

DIGEST_BELOW = 4 * 2**20  # objects this small get a digest in COMMIT (.metadata, meta.pt, checksums.json)
_DIGEST_BELOW = DIGEST_BELOW


def upload(fs: Any, staged: Path, target: str, token: str) -> dict[str, list]:
    if not staged.exists():
        return {}  # a full save: only rank 0 has the file
    files = sorted(p for p in staged.rglob("*") if p.is_file()) if staged.is_dir() else [staged]
    names = [p.relative_to(staged).as_posix() if staged.is_dir() else staged.name for p in files]
    objects = {}
    for file, name in zip(files, names):
        size = file.stat().st_size
        digest = xxhash.xxh3_64_intdigest(file.read_bytes()) if size < _DIGEST_BELOW else None
        objects[name] = [size, digest]
    if files:
        # One call for all: the filesystem keeps several uploads in flight (s3fs: a batch at a time, each large
        # file in concurrent multipart chunks).
        fs.put([str(f) for f in files], [join(target, "." + token, n) for n in names])
    return objects
