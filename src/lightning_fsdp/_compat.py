"""The names this package needs that torch and Lightning do not export publicly.

Keep every such import here, so an upgrade that moves one breaks exactly one file.
"""

from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (  # torch has no public alias for these
    CheckpointImpl,
    CheckpointWrapper,
    checkpoint_wrapper,
)

# Lightning's helpers for precision plugins: casting floating-point tensors and setting the default dtype.
from lightning.fabric.plugins.precision.utils import _convert_fp_tensor as convert_fp_tensor
from lightning.fabric.plugins.precision.utils import _DtypeContextManager as DtypeContextManager

# torch's zip-archive writer and its dtype -> storage-class table, used to write torch.save files one tensor at a time.
from torch.serialization import _open_zipfile_writer as open_zipfile_writer
from torch.storage import _dtype_to_storage_type_map

# DCP's record of where one item lives in a shard file (file, offset, length): its `.metadata` pickles it, so the
# allow-list unpickler must name it, and the checksum reader verifies one such slice at a time.
from torch.distributed.checkpoint.filesystem import _StorageInfo as DCPStorageInfo


def storage_type_for(dtype):
    """The legacy storage class (e.g. ``torch.FloatStorage``) that torch.save names in its pickled references."""
    import torch

    return getattr(torch, _dtype_to_storage_type_map()[dtype])


__all__ = [
    "CheckpointImpl",
    "CheckpointWrapper",
    "checkpoint_wrapper",
    "convert_fp_tensor",
    "DtypeContextManager",
    "open_zipfile_writer",
    "DCPStorageInfo",
    "storage_type_for",
]
