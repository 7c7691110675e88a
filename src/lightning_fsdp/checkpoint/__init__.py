"""Full and sharded checkpoints for FSDP2 models: the operations users call, over three sub-packages.

- operations: :mod:`.save` and :mod:`.load` (both fronts' ``save``/``load``), :mod:`.convert` (the ``convert`` and
  ``inspect`` commands), :mod:`.latest` (the newest good checkpoint), :mod:`.retention` (keep the newest N),
  :mod:`.state` (a user's ``state`` dict sorted into models, optimizers and the rest), :mod:`.fit` (loaded values
  into live objects), :mod:`.hf` (Hugging Face safetensors into the shards);
- :mod:`.io`: moving bytes (readers, writers, atomic commit, staging, background saves);
- :mod:`.integrity`: the bytes read are the bytes saved (checksums, the allow-list unpickler, bounded walks), and a
  failure on one rank is an error on every rank;
- :mod:`.formats`: what checkpoints look like on disk (DCP, Lightning's layouts, safetensors, torch versions).

May import: the engine (a checkpoint reads and writes the engine's sharded models: it reshards them at rest and
loads full state dicts into their shards) and ``lightning_fsdp._base``. Never the features or the fronts. Inside,
the operations may import every sub-package, ``io`` may import ``integrity`` and ``formats``, ``integrity`` only
``formats``, and ``formats`` none of them.
"""

from lightning_fsdp.checkpoint.formats.layout import METADATA_FILENAME, is_full_checkpoint, is_sharded_checkpoint
from lightning_fsdp.checkpoint.integrity.agreement import CheckpointError, Communicator
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
