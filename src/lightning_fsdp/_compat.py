"""The torch names this package needs that torch does not export from a public module.

Keep every such import here, so a torch upgrade that moves one breaks exactly one file.
"""

from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (  # torch has no public alias for these
    CheckpointImpl,
    CheckpointWrapper,
    checkpoint_wrapper,
)

__all__ = ["CheckpointImpl", "CheckpointWrapper", "checkpoint_wrapper"]
