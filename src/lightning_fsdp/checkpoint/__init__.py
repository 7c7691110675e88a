"""Full and sharded checkpoints for FSDP2 models.

- :mod:`.layout` knows the on-disk formats and tells them apart.
- :mod:`.atomic` makes every save replace the previous checkpoint only once the new one is complete.
- :mod:`.io` turns ``state`` dicts of models, optimizers and plain objects into checkpoints and back.
"""

from lightning_fsdp.checkpoint.io import load_checkpoint, save_checkpoint
from lightning_fsdp.checkpoint.layout import METADATA_FILENAME, is_full_checkpoint, is_sharded_checkpoint

__all__ = [
    "save_checkpoint",
    "load_checkpoint",
    "is_sharded_checkpoint",
    "is_full_checkpoint",
    "METADATA_FILENAME",
]
