"""lightning-fsdp: an FSDP2 strategy for Lightning Fabric (and soon the Trainer).

Importing the package registers ``"fsdp"``, ``"fsdp_cpu_offload"`` and ``"hsdp"`` in Fabric's strategy registry.
"""

import logging as _logging

from lightning_fsdp.config import FSDPConfig, ShardingStrategy
from lightning_fsdp.precision import FSDPPrecision

__version__ = "0.1.0"

__all__ = ["FSDPConfig", "ShardingStrategy", "FSDPPrecision", "__version__"]

# Rank 0's one-line summaries (which units were wrapped) go to stderr, like Lightning's own info lines.
_logger = _logging.getLogger(__name__)
if not _logger.handlers:
    _logger.addHandler(_logging.StreamHandler())
    _logger.setLevel(_logging.INFO)
    _logger.propagate = False


def _register_fabric() -> None:
    from lightning.fabric.strategies import STRATEGY_REGISTRY

    from lightning_fsdp.fabric import FSDPStrategy

    FSDPStrategy.register_strategies(STRATEGY_REGISTRY)


_register_fabric()
