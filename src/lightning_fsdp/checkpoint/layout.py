"""The two on-disk formats.

- **Sharded**: a directory with DCP's ``.metadata`` and ``__<rank>_0.distcp`` files, plus ``meta.pt`` holding every
  entry of ``state`` that is not a model or an optimizer. This is the layout Lightning's FSDP and
  ModelParallel strategies write, so checkpoints move between them.
- **Full**: one ``torch.save`` file written by rank 0, with plain CPU tensors under clean parameter names.
"""

from __future__ import annotations

from pathlib import Path

METADATA_FILENAME = "meta.pt"
DCP_METADATA_FILENAME = ".metadata"


def is_sharded_checkpoint(path: Path) -> bool:
    return path.is_dir() and (path / DCP_METADATA_FILENAME).is_file()


def is_full_checkpoint(path: Path) -> bool:
    return path.is_file()
