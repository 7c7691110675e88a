"""Verification as callers ask for it: a whole checkpoint of either kind (:func:`verify_checkpoint`, what
``lightning-fsdp inspect --verify`` runs), and the warning for a checkpoint that carries no checksums."""

from __future__ import annotations

from pathlib import Path
from typing import Union


from lightning_fsdp.checkpoint.integrity.sharded_read import verify_sharded
from lightning_fsdp.checkpoint.integrity.zipfiles import verify_zip

__all__ = ["verify_checkpoint"]

def verify_checkpoint(path: Union[str, Path]) -> bool:
    """Check a full or sharded checkpoint against its checksums; False when it carries none. Raises
    :class:`ChecksumError` naming the file and the tensor on the first mismatch."""
    from lightning_fsdp.checkpoint.formats.layout import is_sharded_checkpoint

    path = Path(path)
    return verify_sharded(path) if is_sharded_checkpoint(path) else verify_zip(path)
