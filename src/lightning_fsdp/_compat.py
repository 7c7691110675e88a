"""The names this package needs that torch and Lightning do not export publicly.

Keep every such import here, so an upgrade that moves one breaks exactly one file.
"""

from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (  # torch has no public alias for these
    CheckpointImpl,
    CheckpointWrapper,
    checkpoint_wrapper,
)

# The classes of torch op objects (`torch.ops.aten.mm`, `torch.ops.aten.mm.default`): selective activation
# checkpointing takes ops from the user, by object or by name.
from torch._ops import OpOverload, OpOverloadPacket

# Lightning's helpers for precision plugins: casting floating-point tensors and setting the default dtype.
from lightning.fabric.plugins.precision.utils import _convert_fp_tensor as convert_fp_tensor
from lightning.fabric.plugins.precision.utils import _DtypeContextManager as DtypeContextManager

# Lightning's two accelerator connectors. Each refuses the FSDP strategy names unless the accelerator is CUDA, in
# `_check_strategy_and_fallback`, before it looks the name up in the registry (see `registry.py`).
from lightning.fabric.connector import _Connector as FabricConnector
from lightning.pytorch.trainer.connectors.accelerator_connector import _AcceleratorConnector as TrainerConnector

# torch's zip-archive writer, the functions its pickles name to rebuild a tensor, and its dtype -> storage-class
# table: used to write torch.save files one tensor at a time, in exactly the form torch.save gives them.
from torch._utils import _rebuild_tensor_v2 as rebuild_tensor
from torch._utils import _rebuild_tensor_v3 as rebuild_tensor_with_dtype
from torch.serialization import _open_zipfile_writer as open_zipfile_writer
from torch.storage import _dtype_to_storage_type_map, _new_dtypes

# DCP's record of where one item lives in a shard file (file, offset, length): its `.metadata` pickles it, so the
# allow-list unpickler must name it, and the checksum reader verifies one such slice at a time.
from torch.distributed.checkpoint.filesystem import _StorageInfo as DCPStorageInfo

# Where a DTensor's local shard starts in the global tensor: used to redo the one index write that init code does
# (zeroing an embedding's padding row), which DTensor indexing cannot carry through to the shard.
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset


def legacy_storage_type(dtype):
    """The legacy storage class (e.g. ``torch.FloatStorage``) that torch.save names in its pickled references to a
    tensor of ``dtype``, or None for the dtypes it writes as an untyped storage plus the dtype instead (the float8
    types, uint16/32/64, complex32: torch added no legacy class for them). KeyError for a dtype torch.save cannot
    write either (e.g. uint4)."""
    import torch

    if dtype in _new_dtypes():
        return None
    return getattr(torch, _dtype_to_storage_type_map()[dtype])


def planner_tools():
    """torch's fake process group store (importing its module registers the ``"fake"`` backend), fake tensors, FSDP2
    memory tracker, and the tracker's two peak states (forward, backward): what :mod:`lightning_fsdp.planner` plans
    with. Imported on first use, so ``import lightning_fsdp`` does not pay for them."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker, _FSDPModState
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore, FakeTensorMode, FSDPMemTracker, (_FSDPModState.PEAK_FW, _FSDPModState.PEAK_BW)


__all__ = [
    "planner_tools",
    "CheckpointImpl",
    "CheckpointWrapper",
    "checkpoint_wrapper",
    "OpOverload",
    "OpOverloadPacket",
    "convert_fp_tensor",
    "DtypeContextManager",
    "FabricConnector",
    "TrainerConnector",
    "legacy_storage_type",
    "open_zipfile_writer",
    "rebuild_tensor",
    "rebuild_tensor_with_dtype",
    "DCPStorageInfo",
    "compute_local_shape_and_global_offset",
]
