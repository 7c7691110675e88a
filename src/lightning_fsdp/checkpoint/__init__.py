"""Full and sharded checkpoints for FSDP2 models.

- :mod:`.layout` knows the on-disk formats and tells them apart.
- :mod:`.state` sorts a user's ``state`` dict into models, optimizers and metadata.
- :mod:`.save` and :mod:`.load` write and read them; :mod:`.full_writer` streams full files one tensor at a time.
- :mod:`.atomic` makes every save replace the previous checkpoint only once the new one is complete.
- :mod:`.agreement` makes a failure on one rank an error on every rank.
- :mod:`.convert` is the offline ``convert``/``inspect`` command's glue over :mod:`.readers` (open a checkpoint,
  read its tensors a batch at a time), :mod:`.writers` (full, sharded, safetensors output) and :mod:`.memory`.
"""

from lightning_fsdp.checkpoint.agreement import CheckpointError, Communicator
from lightning_fsdp.checkpoint.layout import METADATA_FILENAME, is_full_checkpoint, is_sharded_checkpoint
from lightning_fsdp.checkpoint.load import checkpoint_keys, load_checkpoint
from lightning_fsdp.checkpoint.save import AsyncSaves, save_checkpoint

__all__ = [
    "save_checkpoint",
    "load_checkpoint",
    "checkpoint_keys",
    "AsyncSaves",
    "CheckpointError",
    "Communicator",
    "is_sharded_checkpoint",
    "is_full_checkpoint",
    "METADATA_FILENAME",
]
