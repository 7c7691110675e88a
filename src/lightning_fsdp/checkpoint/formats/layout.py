"""The two on-disk formats.

- **Sharded**: a directory with DCP's ``.metadata`` and ``__<rank>_0.distcp`` files, plus ``meta.pt`` holding every
  entry of ``state`` that is not a model or an optimizer. This is the layout Lightning's FSDP and
  ModelParallel strategies write, so checkpoints move between them.
- **Full**: one ``torch.save`` file written by rank 0, with plain CPU tensors under clean parameter names.
"""

from __future__ import annotations

import zipfile
from pathlib import Path

METADATA_FILENAME = "meta.pt"
DCP_METADATA_FILENAME = ".metadata"
CHECKSUMS_FILENAME = "checksums.json"  # per-item checksums of a sharded checkpoint (see lightning_fsdp.checkpoint.integrity)


def is_sharded_checkpoint(path: Path) -> bool:
    return path.is_dir() and (path / DCP_METADATA_FILENAME).is_file()


def is_full_checkpoint(path: Path) -> bool:
    """A file that ``torch.save`` wrote: a zip archive with a pickled ``data.pkl`` record."""
    if not path.is_file() or not zipfile.is_zipfile(path):
        return False
    try:
        with zipfile.ZipFile(path) as archive:
            return any(name.endswith("/data.pkl") or name == "data.pkl" for name in archive.namelist())
    except (zipfile.BadZipFile, ValueError, EOFError, NotImplementedError):  # a damaged archive is not one
        return False


def foreign_entries(path: Path) -> list[str]:
    """Names inside a sharded checkpoint directory that no checkpoint writer put there (a user's files)."""
    return sorted(
        entry.name for entry in path.iterdir()
        if entry.name not in (DCP_METADATA_FILENAME, METADATA_FILENAME, CHECKSUMS_FILENAME) and not entry.name.endswith(".distcp")
    )
