"""lightning-fsdp: an FSDP2 strategy for Lightning Fabric (and soon the Trainer).

Importing the package registers ``"fsdp"``, ``"fsdp_cpu_offload"`` and ``"hsdp"`` in Fabric's strategy registry.
"""

from lightning_fsdp.config import FSDPConfig, ShardingStrategy
from lightning_fsdp.precision import FSDPPrecision

__version__ = "0.1.0"

__all__ = ["FSDPConfig", "ShardingStrategy", "FSDPPrecision", "__version__"]


def _register_fabric() -> None:
    from lightning.fabric.strategies import STRATEGY_REGISTRY

    from lightning_fsdp.fabric import FSDPStrategy

    FSDPStrategy.register_strategies(STRATEGY_REGISTRY)


_register_fabric()
