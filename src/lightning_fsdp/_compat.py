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

__all__ = ["CheckpointImpl", "CheckpointWrapper", "checkpoint_wrapper", "convert_fp_tensor", "DtypeContextManager"]
