"""lightning-fsdp: an FSDP2 strategy for Lightning Fabric and the Lightning Trainer.

Importing the package registers ``"fsdp"``, ``"fsdp_cpu_offload"`` and ``"hsdp"`` in Fabric's and in the Trainer's
strategy registries, usable on CPU as on GPU (see :mod:`lightning_fsdp._fronts.registry`), and makes both fronts' strategies
virtual subclasses of Lightning's ``FSDPStrategy``, so Lightning's and litgpt's ``isinstance`` checks take their FSDP
branch (see :mod:`lightning_fsdp._fronts.dropin`).
"""

from lightning_fsdp._fronts.fabric_load import fabric_load
from lightning_fsdp.engine.config import FSDPConfig, ShardingStrategy
from lightning_fsdp.engine.fault_tolerance.config import FaultTolerance, FaultToleranceError
from lightning_fsdp.engine.precision import FSDPPrecision
from lightning_fsdp.pretrained import LoadReport, load_pretrained

__version__ = "0.1.0"

__all__ = ["FSDPConfig", "ShardingStrategy", "FaultTolerance", "FaultToleranceError", "FSDPPrecision", "load_pretrained", "LoadReport", "fabric_load", "__version__"]


def _register() -> None:
    from lightning.fabric.strategies import STRATEGY_REGISTRY
    from lightning.pytorch.strategies import StrategyRegistry

    from lightning_fsdp import fabric, trainer

    from lightning_fsdp._fronts import callback_filesystem, dropin, last_checkpoint
    from lightning_fsdp._base.compat import FabricConnector, TrainerConnector
    from lightning_fsdp._fronts.registry import accept_names_on_every_accelerator

    fabric.FSDPStrategy.register_strategies(STRATEGY_REGISTRY)
    trainer.FSDPStrategy.register_strategies(StrategyRegistry)
    accept_names_on_every_accelerator(FabricConnector, STRATEGY_REGISTRY)
    accept_names_on_every_accelerator(TrainerConnector, StrategyRegistry)
    dropin.register()
    last_checkpoint.register()
    callback_filesystem.register()


_register()
