"""The ``fault_tolerance`` argument on the Fabric front, in this process: its forms (dataclass, dict, YAML, the
replica id from the environment) and the setup-time refusals the argument's parse cannot see (NO_SHARD on several
ranks, fp16 loss scaling, a second model, several optimizers; tensor parallelism inside a group is allowed, see
test_ft_tp.py). Each refusal fires before any sharding or process group, so no world is started."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from lightning.fabric.plugins.environments import LightningEnvironment
from torch import nn

from skips import require

from lightning_fsdp import FaultTolerance
from lightning_fsdp.fabric import FSDPStrategy

require("torchft")

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "fault_tolerance" / "fsdp_ft_cpu.yaml"
FT = {"replica_id": 1, "num_replica_groups": 2, "lighthouse": "http://head:29510"}


def _setup(strategy: FSDPStrategy, optimizers: int = 1, world_size: int = 1):
    env = LightningEnvironment()
    env.set_world_size(world_size)
    strategy.cluster_environment = env
    model = nn.Linear(2, 2)
    opts = [torch.optim.SGD(model.parameters(), lr=0.1) for _ in range(optimizers)]
    return strategy.setup_module_and_optimizers(model, opts)


@pytest.mark.single_process
def test_dataclass_and_dict_give_the_same_config():
    from_dict = FSDPStrategy(fault_tolerance=dict(FT, min_replicas=2, timeout=5)).config.fault_tolerance
    from_class = FSDPStrategy(fault_tolerance=FaultTolerance(**FT, min_replicas=2, timeout=5)).config.fault_tolerance
    assert from_dict == from_class == FaultTolerance(replica_id=1, num_replica_groups=2,
                                                     lighthouse="http://head:29510", min_replicas=2, timeout=5.0)
    assert FSDPStrategy().config.fault_tolerance is None


@pytest.mark.single_process
def test_replica_id_and_lighthouse_come_from_the_environment(monkeypatch):
    monkeypatch.setenv("REPLICA_GROUP_ID", "1")
    monkeypatch.setenv("NUM_REPLICA_GROUPS", "3")
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "http://env-head:29510")
    ft = FSDPStrategy(fault_tolerance={}).config.fault_tolerance
    assert (ft.replica_id, ft.num_replica_groups, ft.lighthouse) == (1, 3, "http://env-head:29510")
    # The argument wins over the environment.
    assert FSDPStrategy(fault_tolerance={"replica_id": 2}).config.fault_tolerance.replica_id == 2


@pytest.mark.single_process
def test_the_yaml_example_builds_its_fault_tolerance(monkeypatch):
    from lightning_fsdp.trainer import FSDPStrategy as TrainerStrategy

    monkeypatch.setenv("REPLICA_GROUP_ID", "1")
    init_args = yaml.safe_load(CONFIG.read_text())["trainer"]["strategy"]["init_args"]
    ft = TrainerStrategy(**init_args).config.fault_tolerance
    assert ft == FaultTolerance(replica_id=1, num_replica_groups=2, lighthouse="http://localhost:29510",
                                min_replicas=1, quorum_timeout=120.0, timeout=60.0)


@pytest.mark.single_process
def test_no_shard_on_several_ranks_is_refused_at_setup():
    with pytest.raises(ValueError, match=r"(?s)fault_tolerance.*NO_SHARD.*HINT: Use sharding_strategy='FULL_SHARD'"):
        _setup(FSDPStrategy(sharding_strategy="NO_SHARD", fault_tolerance=FT), world_size=2)


@pytest.mark.single_process
def test_fp16_mixed_precision_is_refused_at_setup():
    from lightning_fsdp.engine.precision import FSDPPrecision

    strategy = FSDPStrategy(fault_tolerance=FT, precision=FSDPPrecision("16-mixed"))
    refusal = r"(?s)fault_tolerance.*'16-mixed'.*GradScaler.*HINT: Use precision='bf16-mixed'"
    with pytest.raises(ValueError, match=refusal):
        _setup(strategy)


@pytest.mark.single_process
@pytest.mark.parametrize("optimizers", [0, 2])
def test_a_model_without_or_with_several_optimizers_is_refused(optimizers):
    with pytest.raises(ValueError, match=rf"(?s)fault_tolerance.*{optimizers} optimizers.*HINT: Set the model up"):
        _setup(FSDPStrategy(fault_tolerance=FT), optimizers=optimizers)


@pytest.mark.single_process
def test_a_second_model_or_a_later_optimizer_is_refused():
    strategy = FSDPStrategy(fault_tolerance=FT)
    strategy._replica_group = object()  # as after a first `fabric.setup(model, optimizer)`
    with pytest.raises(ValueError, match=r"(?s)fault_tolerance.*second model.*HINT: Put every trained module"):
        _setup(strategy)
    with pytest.raises(ValueError, match=r"(?s)fault_tolerance.*second model"):
        FSDPStrategy(fault_tolerance=FT).setup_optimizer(torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=0.1))
