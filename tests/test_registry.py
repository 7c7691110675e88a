"""Registration into Fabric's strategy registry, and what the names build."""

import pytest
import torch
from lightning.fabric import Fabric
from lightning.fabric.strategies import STRATEGY_REGISTRY, _StrategyRegistry
from torch.distributed.fsdp import CPUOffloadPolicy

import lightning_fsdp  # noqa: F401 - importing registers the names
from lightning_fsdp.config import ShardingStrategy
from lightning_fsdp.fabric import FSDPStrategy


@pytest.mark.parametrize(
    ("name", "check"),
    [
        ("fsdp", lambda s: s.config.sharding_strategy is ShardingStrategy.FULL_SHARD and not s.config.cpu_offload),
        ("fsdp_cpu_offload", lambda s: isinstance(s.config.offload_policy, CPUOffloadPolicy)),
        ("hsdp", lambda s: s.config.sharding_strategy is ShardingStrategy.HYBRID_SHARD and s.config.device_mesh is None),
    ],
)
def test_import_registers_our_class(name, check):
    entry = STRATEGY_REGISTRY[name]
    assert entry["strategy"] is FSDPStrategy
    strategy = STRATEGY_REGISTRY.get(name)
    assert isinstance(strategy, FSDPStrategy) and check(strategy)


def test_register_strategies_classmethod_fills_a_fresh_registry():
    registry = _StrategyRegistry()
    FSDPStrategy.register_strategies(registry)
    assert sorted(registry.available_strategies()) == ["fsdp", "fsdp_cpu_offload", "hsdp"]


def test_string_on_cpu_is_refused_by_lightning_but_an_instance_works():
    # Lightning's connector rejects the *string* "fsdp" with a CPU accelerator before it consults the registry.
    with pytest.raises(ValueError, match="(?i)fsdp"):
        Fabric(accelerator="cpu", devices=1, strategy="fsdp")
    fabric = Fabric(accelerator="cpu", devices=1, strategy=FSDPStrategy())
    assert isinstance(fabric.strategy, FSDPStrategy)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: Lightning only accepts the string on CUDA")
def test_string_builds_ours_on_gpu():
    fabric = Fabric(accelerator="cuda", devices=1, strategy="fsdp")
    assert isinstance(fabric.strategy, FSDPStrategy)


def test_checkpoint_io_is_not_supported():
    strategy = FSDPStrategy()
    with pytest.raises(NotImplementedError):
        _ = strategy.checkpoint_io
    with pytest.raises(NotImplementedError):
        strategy.checkpoint_io = None


def test_strategy_precision_and_fabric_precision():
    fabric = Fabric(accelerator="cpu", devices=1, strategy=FSDPStrategy(precision="bf16-true"))
    assert fabric.strategy.precision.precision == "bf16-true"
    fabric = Fabric(accelerator="cpu", devices=1, precision="bf16-mixed", strategy=FSDPStrategy())
    assert fabric.strategy.precision.precision == "bf16-mixed"
    fabric = Fabric(accelerator="cpu", devices=1, precision="16-true", strategy=FSDPStrategy())
    assert fabric.strategy.precision.precision == "16-true"
