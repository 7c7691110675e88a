"""The Trainer front without processes: the registry, the constructor (same arguments, same errors as the Fabric
front), the precision plugin Lightning's connector hands over, and what Lightning reads from the strategy."""

from __future__ import annotations

import re
import warnings

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision
from lightning.pytorch.strategies import StrategyRegistry
from torch.distributed.fsdp import CPUOffloadPolicy

from lightning_fsdp import fabric, trainer
from lightning_fsdp.engine.config import ShardingStrategy
from lightning_fsdp.engine.precision import FSDPPrecision
from lightning_fsdp.trainer import FSDPStrategy, FSDPTrainerPrecision
import lightning_fsdp  # noqa: F401 - importing registers the names
from test_errors import STRATEGY_CASES


NAME_CHECKS = {
    "fsdp": lambda s: s.config.sharding_strategy is ShardingStrategy.FULL_SHARD and not s.config.cpu_offload,
    "fsdp_cpu_offload": lambda s: (s.config.sharding_strategy is ShardingStrategy.FULL_SHARD
                                   and isinstance(s.config.offload_policy, CPUOffloadPolicy)),
    "hsdp": lambda s: s.config.sharding_strategy is ShardingStrategy.HYBRID_SHARD and not s.config.cpu_offload,
}


@pytest.mark.parametrize(("name", "check"), NAME_CHECKS.items(), ids=list(NAME_CHECKS))
def test_import_registers_the_trainer_class(name, check):
    assert StrategyRegistry[name]["strategy"] is FSDPStrategy
    strategy = StrategyRegistry.get(name)
    assert type(strategy) is FSDPStrategy and check(strategy)


def test_names_on_a_cpu_trainer():
    # Lightning's connector refuses its own FSDP names on CPU; with this package imported, ours go through, with
    # their arguments: the type alone passes when "hsdp" builds FULL_SHARD or "fsdp_cpu_offload" no offload.
    for name, check in NAME_CHECKS.items():
        strategy = Trainer(accelerator="cpu", devices=1, strategy=name, logger=False).strategy
        assert type(strategy) is FSDPStrategy and check(strategy), (name, strategy.config)
    assert type(Trainer(accelerator="cpu", devices=1, strategy=FSDPStrategy(), logger=False).strategy) is FSDPStrategy


def test_defaults_differ_from_the_fabric_front_only_in_the_state_dict_type():
    ours, theirs = FSDPStrategy().config, fabric.FSDPStrategy().config
    assert ours.state_dict_type == "full" and theirs.state_dict_type == "sharded"
    assert ours == type(ours)(**{**theirs.__dict__, "state_dict_type": "full"})


SHARED_CASES = [case for case in STRATEGY_CASES if "precision" not in case[1]]


@pytest.mark.parametrize(("kwargs", "exc"), [c[1:3] for c in SHARED_CASES], ids=[c[0] for c in SHARED_CASES])
def test_same_arguments_give_the_same_errors_as_the_fabric_front(kwargs, exc):
    errors = []
    for front in (fabric.FSDPStrategy, trainer.FSDPStrategy):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with pytest.raises(exc) as info:
                front(**kwargs)
        errors.append((type(info.value), str(info.value)))
    assert errors[0] == errors[1]


def test_fsdp1_keywords_warn_and_unknown_keywords_fail_alike():
    for front in (fabric.FSDPStrategy, trainer.FSDPStrategy):
        with pytest.warns(UserWarning, match=r"`use_orig_params=True` is an FSDP1 argument and is ignored"):
            front(use_orig_params=True)
        with pytest.raises(TypeError, match=re.escape("Invalid `use_orig_param=True`")):
            front(use_orig_param=True)


@pytest.mark.parametrize(
    ("flag", "expected"),
    [("32-true", "32-true"), ("bf16-mixed", "bf16-mixed"), ("bf16-true", "bf16-true"), ("16-true", "16-true")],
)
def test_trainer_precision_becomes_ours(flag, expected):
    t = Trainer(accelerator="cpu", devices=1, precision=flag, strategy=FSDPStrategy(), logger=False)
    plugin = t.strategy.precision_plugin
    assert type(plugin) is FSDPTrainerPrecision and plugin.precision == expected and t.precision == expected


def test_precision_plugins_are_translated():
    s = FSDPStrategy()
    for plugin, expected in ((Precision(), "32-true"), (MixedPrecision("bf16-mixed", "cpu"), "bf16-mixed"),
                             (HalfPrecision("16-true"), "16-true"), (FSDPPrecision("bf16-true"), "bf16-true")):
        s.precision_plugin = plugin
        assert type(s.precision_plugin) is FSDPTrainerPrecision and s.precision_plugin.precision == expected
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    s.precision_plugin = MixedPrecision("16-mixed", "cpu", scaler=scaler)
    assert s.precision_plugin.scaler is scaler  # the user's scaler settings are kept


def test_unsupported_precision_fails_like_the_fabric_front():
    with pytest.raises(ValueError, match=r"Invalid `precision=.*Allowed: '32-true', 'bf16-mixed'.*HINT: "):
        Trainer(accelerator="cpu", devices=1, precision="64-true", strategy=FSDPStrategy(), logger=False)


def test_precision_plugin_class_is_both_ours_and_lightnings():
    assert issubclass(FSDPTrainerPrecision, FSDPPrecision) and issubclass(FSDPTrainerPrecision, Precision)
    # Lightning's own FSDP precision refuses norm clipping; ours routes it to sharded clipping instead.
    assert FSDPTrainerPrecision.clip_grad_by_norm is not Precision.clip_grad_by_norm


def test_what_lightning_reads():
    t = Trainer(accelerator="cpu", devices=2, strategy=FSDPStrategy(), logger=False)
    s = t.strategy
    assert s.is_distributed and t._accelerator_connector.is_distributed  # `self.log(sync_dist=True)` syncs
    assert s.distributed_sampler_kwargs == {"num_replicas": 2, "rank": 0}
    assert s.restore_checkpoint_after_setup and not s.lightning_restore_optimizer
    assert s.num_processes == 2 and s.root_device == torch.device("cpu")


def test_storage_options_that_are_not_a_dict_are_refused_naming_the_argument(tmp_path):
    """`save_checkpoint(..., storage_options=...)` is accepted (they go to fsspec, issue 38); anything but a dict of
    options is refused before a byte is written."""
    with pytest.raises(TypeError, match="storage_options.*HINT"):
        FSDPStrategy().save_checkpoint({}, str(tmp_path / "x.ckpt"), storage_options="endpoint=http://x")
    assert not any(tmp_path.iterdir())


def test_checkpoint_io_is_refused_like_the_fabric_front():
    from lightning.fabric.plugins import TorchCheckpointIO

    with pytest.raises(NotImplementedError, match="does not accept a `CheckpointIO` plugin"):
        FSDPStrategy(checkpoint_io=TorchCheckpointIO())
    with pytest.raises(NotImplementedError, match="does not accept a `CheckpointIO` plugin"):
        Trainer(accelerator="cpu", devices=1, plugins=[TorchCheckpointIO()], strategy=FSDPStrategy(), logger=False)
    with pytest.raises(NotImplementedError, match="has no `CheckpointIO`"):
        _ = FSDPStrategy().checkpoint_io


def test_fsdp_options_are_keyword_only():
    with pytest.raises(TypeError, match="positional"):
        FSDPStrategy(None, None, None, None, None, "gloo")
