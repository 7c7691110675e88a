"""Registration into Fabric's and the Trainer's strategy registries, and what the names build on CPU."""

import pytest
from lightning.fabric import Fabric
from lightning.fabric.strategies import STRATEGY_REGISTRY, _StrategyRegistry
from torch.distributed.fsdp import CPUOffloadPolicy

from lightning_fsdp.engine.config import ShardingStrategy
from lightning_fsdp.fabric import FSDPStrategy
import forkserver
import lightning_fsdp  # noqa: F401 - importing registers the names
from launch import script_env

# Every test here keeps one core busy (this process, or one subprocess at a time): they run first, beside the
# background pools (tests/conftest.py).
pytestmark = pytest.mark.single_process


# What each name must build, whichever front and whichever path (the registry, or a string given to a connector).
NAME_CHECKS = {
    "fsdp": lambda s: s.config.sharding_strategy is ShardingStrategy.FULL_SHARD and not s.config.cpu_offload,
    "fsdp_cpu_offload": lambda s: (s.config.sharding_strategy is ShardingStrategy.FULL_SHARD
                                   and isinstance(s.config.offload_policy, CPUOffloadPolicy)),
    "hsdp": lambda s: (s.config.sharding_strategy is ShardingStrategy.HYBRID_SHARD and s.config.device_mesh is None
                       and not s.config.cpu_offload),
}


@pytest.mark.parametrize(("name", "check"), NAME_CHECKS.items(), ids=list(NAME_CHECKS))
def test_import_registers_our_class(name, check):
    entry = STRATEGY_REGISTRY[name]
    assert entry["strategy"] is FSDPStrategy
    strategy = STRATEGY_REGISTRY.get(name)
    assert isinstance(strategy, FSDPStrategy) and check(strategy)


def test_register_strategies_classmethod_fills_a_fresh_registry():
    registry = _StrategyRegistry()
    FSDPStrategy.register_strategies(registry)
    assert sorted(registry.available_strategies()) == ["fsdp", "fsdp_cpu_offload", "hsdp"]


@pytest.mark.parametrize("name", ["fsdp", "fsdp_cpu_offload", "hsdp"])
@pytest.mark.parametrize("accelerator", ["cpu", "auto"])
def test_strings_build_ours_on_cpu_from_both_fronts(name, accelerator):
    from lightning.pytorch import Trainer

    from lightning_fsdp.trainer import FSDPStrategy as TrainerFSDPStrategy

    from lightning.pytorch.strategies import StrategyRegistry as TrainerStrategyRegistry

    fabric = Fabric(accelerator=accelerator, devices=1, strategy=name)
    assert type(fabric.strategy) is FSDPStrategy
    assert fabric.strategy.config == STRATEGY_REGISTRY.get(name).config  # the registry's arguments were applied
    trainer = Trainer(accelerator=accelerator, devices=1, strategy=name, logger=False, enable_progress_bar=False)
    assert type(trainer.strategy) is TrainerFSDPStrategy
    assert trainer.strategy.config == TrainerStrategyRegistry.get(name).config
    # The type alone passes when a name drops its arguments ("hsdp" building FULL_SHARD): check what each one means.
    assert NAME_CHECKS[name](fabric.strategy), fabric.strategy.config
    assert NAME_CHECKS[name](trainer.strategy), trainer.strategy.config


def test_the_connector_patch_is_in_place_and_wraps_lightnings_own_check():
    # The only Lightning internals the strings rely on. If a release renames the method or the flag, this fails
    # instead of the strings silently falling back to Lightning's refusal.
    import inspect

    from lightning_fsdp._base.compat import FabricConnector, TrainerConnector

    for connector in (FabricConnector, TrainerConnector):
        check = connector._check_strategy_and_fallback
        assert getattr(check, "_lightning_fsdp_wrapper", False), f"{connector.__name__} is not patched"
        original = inspect.getsource(check.__wrapped__)
        assert "self._strategy_flag" in original and "FSDP" in original, (
            f"Lightning's {connector.__name__}._check_strategy_and_fallback changed; review _fronts/registry.py"
        )


_LIGHTNING_ALONE = """
import sys
from lightning.fabric import Fabric
from lightning.pytorch import Trainer
for build in (lambda: Fabric(accelerator='cpu', devices=1, strategy='fsdp'),
              lambda: Trainer(accelerator='cpu', devices=1, strategy='fsdp', logger=False)):
    try:
        build()
    except ValueError as err:
        assert 'GPU' in str(err), err
    else:
        raise SystemExit('Lightning accepted fsdp on CPU')
assert 'lightning_fsdp' not in sys.modules
print('refused')
"""


def test_lightnings_own_fsdp_is_unchanged():
    # Without this package imported, Lightning refuses its FSDP names on CPU as before; and an instance of
    # Lightning's own strategy is refused even with it imported.
    import subprocess

    from lightning.fabric.strategies import FSDPStrategy as LightningFSDPStrategy

    # Forked from a warm server, which imports Lightning but never this package: what a fresh interpreter has.
    proc = subprocess.run([forkserver.python(), "-c", _LIGHTNING_ALONE], env=script_env(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0 and "refused" in proc.stdout, proc.stdout + proc.stderr
    with pytest.raises(ValueError, match="only available on GPU") as refused:
        Fabric(accelerator="cpu", devices=1, strategy=LightningFSDPStrategy())
    # The refusal is raised in Lightning's code, not torch's: torch's FSDP1 itself trains on CPU with gloo
    # (`tests/test_interop.py::test_case[torchs_fsdp1_trains_on_cpu_gloo]`).
    raised_in = str(refused.traceback[-1].path).replace("\\", "/")
    assert "/lightning/" in raised_in and "/torch/" not in raised_in, raised_in


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
