"""LightningCLI and YAML: the configs in ``configs/`` build the strategy they describe, one of them trains end to end
through ``examples/cli_train.py`` on 2 processes, and a bad value in YAML fails with the message Python gives."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy

import forkserver
from launch import script_env

from lightning_fsdp.engine.config import ShardingStrategy
from lightning_fsdp.trainer import FSDPStrategy, FSDPTrainerPrecision

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "cli_train.py"
CONFIGS = ROOT / "configs"


def _example():
    spec = importlib.util.spec_from_file_location("cli_train", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _cli(*args: str):
    from lightning.pytorch.cli import LightningCLI

    example = _example()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sys, "argv", [str(EXAMPLE)])  # LightningCLI warns when pytest's own arguments are there too
        return LightningCLI(example.GPTModule, example.TokenData, run=False, args=list(args))


# What each config must turn into: the YAML forms (dotted names, strings, lists, bools) reach the strategy intact.
EXPECTED = {
    "fsdp_cpu.yaml": dict(sharding=ShardingStrategy.FULL_SHARD, state="sharded", mesh=None, offload=False, precision="32-true", checkpointing=False, model_checkpoint=True),
    "fsdp_cpu_offload_bf16.yaml": dict(sharding=ShardingStrategy.FULL_SHARD, state="full", mesh=None, offload=True, precision="bf16-mixed", checkpointing=True),
    "hsdp_cpu.yaml": dict(sharding=ShardingStrategy.HYBRID_SHARD, state="full", mesh=(2, 2), offload=False, precision="32-true", checkpointing=False, no_sync="reduce_scatter_only", accumulate=2),
    "fsdp_gpu.yaml": dict(sharding=ShardingStrategy.FULL_SHARD, state="sharded", mesh=None, offload=False, precision="bf16-mixed", checkpointing=True, async_save=True),
    "fsdp_tp_cpu.yaml": dict(sharding=ShardingStrategy.FULL_SHARD, state="sharded", mesh=None, offload=False, precision="32-true", checkpointing=False,
                             tensor_parallel=(2, {"blocks.*.linear1": "colwise", "blocks.*.linear2": "rowwise"})),
    "fsdp_cpu_controls.yaml": dict(sharding=ShardingStrategy.FULL_SHARD, state="sharded", mesh=None, offload=False, precision="32-true", checkpointing=True,
                                   prefetch=(1, 2), reshard=(("root", True), ("model.blocks.3", False)), every=2,
                                   save_ops=(torch.ops.aten.mm, torch.ops.aten.native_layer_norm)),
}


def test_every_config_is_checked():
    assert sorted(p.name for p in CONFIGS.glob("*.yaml")) == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_config_builds_the_strategy_it_describes(name):
    expected = EXPECTED[name]
    # The GPU config is built on CPU here: only the accelerator changes, everything about the strategy is as written.
    overrides = ["--trainer.accelerator=cpu", "--trainer.devices=1"] if "gpu" in name else []
    cli = _cli("--config", str(CONFIGS / name), *overrides)
    strategy = cli.trainer.strategy
    assert type(strategy) is FSDPStrategy
    config = strategy.config
    assert config.auto_wrap_policy.classes == (nn.TransformerEncoderLayer,)
    assert config.sharding_strategy is expected["sharding"]
    assert config.state_dict_type == expected["state"]
    assert config.device_mesh == expected["mesh"]
    assert isinstance(config.offload_policy, CPUOffloadPolicy) is expected["offload"]
    assert (config.activation_checkpointing_policy is not None) is expected["checkpointing"]
    if expected["checkpointing"]:
        assert config.activation_checkpointing_policy.classes == (nn.TransformerEncoderLayer,)
    assert isinstance(cli.trainer.precision_plugin, FSDPTrainerPrecision)
    assert cli.trainer.precision == expected["precision"]
    # The rest of what configs/README.md says of each config.
    assert config.hybrid_no_sync == expected.get("no_sync", "skip_all")
    # The speed and memory controls: YAML ints, mappings and op names reach the strategy as their Python forms.
    assert (config.forward_prefetch, config.backward_prefetch) == expected.get("prefetch", (0, 1))
    reshard = config.reshard_after_forward
    assert (reshard.entries if reshard is not None else None) == expected.get("reshard")
    if expected["checkpointing"]:
        policy = config.activation_checkpointing_policy
        assert getattr(policy, "every", 1) == expected.get("every", 1)
        assert all(op in (getattr(policy, "save_ops", None) or ()) for op in expected.get("save_ops", ()))
    assert config.async_save is expected.get("async_save", False)
    assert (config.tensor_parallel.size, config.tensor_parallel.plan) == expected.get("tensor_parallel", (1, None))
    assert cli.trainer.accumulate_grad_batches == expected.get("accumulate", 1)
    from lightning.pytorch.callbacks import ModelCheckpoint

    explicit = [c for c in cli.trainer.callbacks if type(c) is ModelCheckpoint and c.monitor == "val_loss"]
    assert bool(explicit) is expected.get("model_checkpoint", False), cli.trainer.callbacks


@pytest.mark.parametrize(
    ("override", "python_kwargs"),
    [
        ("--trainer.strategy.init_args.sharding_strategy=FULL_SHRAD", dict(sharding_strategy="FULL_SHRAD")),
        ("--trainer.strategy.init_args.auto_wrap_policy=[no_such_pkg_xyz.Block]",
         dict(auto_wrap_policy=["no_such_pkg_xyz.Block"])),
        ("--trainer.strategy.init_args.activation_checkpointing_policy=[math.pi]",
         dict(activation_checkpointing_policy=["math.pi"])),
        ("--trainer.strategy.init_args.device_mesh=[0, 2]", dict(sharding_strategy="HYBRID_SHARD", device_mesh=[0, 2])),
        ("--trainer.strategy.init_args.state_dict_type=local", dict(state_dict_type="local")),
        ("--trainer.strategy.init_args.backward_prefetch=0", dict(backward_prefetch=0)),
        ("--trainer.strategy.init_args.activation_checkpointing_policy={every: 2, save_ops: [aten.no_such_op]}",
         dict(activation_checkpointing_policy={"every": 2, "save_ops": ["aten.no_such_op"]})),
    ],
    ids=["sharding", "policy", "checkpointing-policy", "mesh", "state-dict-type", "backward-prefetch", "save-ops"],
)
def test_bad_yaml_value_fails_with_the_python_message(tmp_path, capsys, override, python_kwargs):
    with pytest.raises((ValueError, TypeError)) as python_error:
        FSDPStrategy(**python_kwargs)
    config = CONFIGS / ("hsdp_cpu.yaml" if "device_mesh" in override else "fsdp_cpu.yaml")
    # jsonargparse builds the strategy while it checks the config, and lists our error among its reasons: printed
    # before exiting when parsing, raised when instantiating.
    with pytest.raises((SystemExit, ValueError, TypeError)) as cli_error:
        _cli("--config", str(config), override)
    shown = str(cli_error.value) + capsys.readouterr().err
    assert str(python_error.value) in shown, shown


def test_cli_trains_from_a_config_on_two_processes(tmp_path):
    # Lightning's own launcher starts the second process by running the script again.
    command = [
        forkserver.python(), str(EXAMPLE), "fit", "--config", str(CONFIGS / "fsdp_cpu.yaml"), "--trainer.max_steps=6",
        "--trainer.val_check_interval=3", f"--trainer.default_root_dir={tmp_path}", "--trainer.enable_progress_bar=false",
    ]
    env = script_env()
    proc = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-6000:]
    assert "FSDP units: 4 x TransformerEncoderLayer + root (TinyGPT) on mesh (shard=2)" in log, log[-3000:]
    last = next(tmp_path.rglob("last.ckpt"))
    # A sharded checkpoint from both ranks, after the 6 steps asked for on the command line.
    assert sorted(p.name for p in last.iterdir()) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp", "checksums.json", "meta.pt"
    ]
    meta = torch.load(last / "meta.pt", weights_only=True)
    assert meta["global_step"] == 6 and meta["hyper_parameters"]["layers"] == 4


def test_fsdp1_keywords_from_yaml_go_through_dict_kwargs(tmp_path, capsys):
    # `**kwargs` has no types, so LightningCLI takes such keys under `dict_kwargs`, not `init_args`.
    extra = tmp_path / "fsdp1.yaml"
    extra.write_text(
        "trainer:\n  strategy:\n    class_path: lightning_fsdp.trainer.FSDPStrategy\n"
        "    dict_kwargs:\n      use_orig_params: true\n"
    )
    with pytest.warns(UserWarning, match=r"`use_orig_params=True` is an FSDP1 argument and is ignored"):
        cli = _cli("--config", str(CONFIGS / "fsdp_cpu.yaml"), "--config", str(extra))
    assert type(cli.trainer.strategy) is FSDPStrategy
    extra.write_text(extra.read_text().replace("use_orig_params", "use_orig_param"))
    with pytest.raises(TypeError) as python_error:
        FSDPStrategy(use_orig_param=True)
    with pytest.raises((SystemExit, ValueError, TypeError)) as cli_error:
        _cli("--config", str(CONFIGS / "fsdp_cpu.yaml"), "--config", str(extra))
    assert str(python_error.value) in str(cli_error.value) + capsys.readouterr().err
