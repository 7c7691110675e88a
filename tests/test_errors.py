"""The bad-input catalogue: every user-facing argument error, checked for its type and its full message.

Each message must name the argument, show the value received, list what is allowed ("Allowed:") and end with a
fix ("HINT:"). Everything here runs in one process without a process group.
"""

from __future__ import annotations

import re
import warnings

import pytest
import torch
from lightning.fabric.plugins.precision import DoublePrecision
from torch import nn
from torch.distributed.fsdp import CPUOffload, CPUOffloadPolicy, MixedPrecision, MixedPrecisionPolicy, OffloadPolicy
from torch.distributed.fsdp import ShardingStrategy as TorchShardingStrategy

from lightning_fsdp.engine.config import FSDPConfig, ShardingStrategy
from lightning_fsdp.engine.mesh import build_mesh
from lightning_fsdp.engine.policy import Policy
from lightning_fsdp.engine.precision import FSDPPrecision, as_fsdp_precision
from lightning_fsdp.fabric import FSDPStrategy


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(2, 2)


def check_message(err: BaseException, argument: str, shown: str, allowed: str, hint: str) -> None:
    """The four parts of a good message, in order: argument=value, Allowed:, HINT:."""
    msg = str(err)
    head = f"Invalid `{argument}="
    assert msg.startswith(head), msg
    assert shown in msg, f"the bad value {shown!r} is not shown in: {msg}"
    assert "Allowed: " in msg, msg
    assert "HINT: " in msg, msg
    assert msg.index(head) < msg.index("Allowed: ") < msg.index("HINT: "), msg
    allowed_part = msg[msg.index("Allowed: ") : msg.index("HINT: ")]
    assert allowed in allowed_part, f"{allowed!r} not among the allowed values in: {msg}"
    hint_part = msg[msg.index("HINT: ") + len("HINT: ") :]
    assert hint in hint_part, f"{hint!r} not in the fix: {hint_part}"


# (id, FSDPStrategy kwargs, exception type, argument named, value shown, part of "Allowed:", part of "HINT:")
STRATEGY_CASES = [
    ("sync-module-states-str", dict(sync_module_states="yes"), TypeError,
     "sync_module_states", "'yes'", "True, False or None", "rank 0's parameters and buffers"),
    ("sharding-unknown", dict(sharding_strategy="FULL"), ValueError,
     "sharding_strategy", "'FULL'", "'HYBRID_SHARD'", "sharding_strategy='FULL_SHARD'"),
    ("sharding-typo", dict(sharding_strategy="hybrid-shard"), ValueError,
     "sharding_strategy", "'hybrid-shard'", "'SHARD_GRAD_OP'", "sharding_strategy="),
    ("sharding-int", dict(sharding_strategy=3), TypeError,
     "sharding_strategy", "=3`", "'FULL_SHARD'", "sharding_strategy='HYBRID_SHARD'"),
    ("sharding-none", dict(sharding_strategy=None), TypeError,
     "sharding_strategy", "=None`", "'NO_SHARD'", "sharding_strategy="),
    ("policy-module-missing", dict(auto_wrap_policy="no_such_pkg_xyz.model.Block"), ValueError,
     "auto_wrap_policy", "'no_such_pkg_xyz.model.Block'", "'auto'", "importable"),
    ("policy-attr-missing", dict(auto_wrap_policy="torch.nn.NoSuchBlock"), ValueError,
     "auto_wrap_policy", "'torch.nn.NoSuchBlock'", "dotted class names", "class name"),
    ("policy-not-module-math-pi", dict(auto_wrap_policy="math.pi"), TypeError,
     "auto_wrap_policy", "'math.pi'", "nn.Module classes", "torch.nn.Module"),
    ("policy-not-module-ordereddict", dict(auto_wrap_policy="collections.OrderedDict"), TypeError,
     "auto_wrap_policy", "'collections.OrderedDict'", "nn.Module classes", "torch.nn.Module"),
    ("policy-no-dot", dict(auto_wrap_policy="Block"), ValueError,
     "auto_wrap_policy", "'Block'", "'auto'", "full import path"),
    ("policy-float", dict(auto_wrap_policy=3.5), TypeError,
     "auto_wrap_policy", "=3.5`", "'auto'", "auto_wrap_policy={Block}"),
    ("policy-dict", dict(auto_wrap_policy={"Block": True}), TypeError,
     "auto_wrap_policy", "{'Block': True}", "callable", "auto_wrap_policy='auto'"),
    ("policy-collection-non-class", dict(auto_wrap_policy=[Block, 3]), TypeError,
     "auto_wrap_policy", ", 3]", "nn.Module classes", "only module classes"),
    ("policy-collection-non-module-class", dict(auto_wrap_policy={int}), TypeError,
     "auto_wrap_policy", "{<class 'int'>}", "nn.Module classes", "torch.nn.Module"),
    ("policy-collection-bad-name", dict(auto_wrap_policy=["torch.nn.Linear", "no_such_pkg_xyz.Block"]), ValueError,
     "auto_wrap_policy", "'no_such_pkg_xyz.Block'", "'auto'", "importable"),
    ("policy-empty-set", dict(auto_wrap_policy=set()), ValueError,
     "auto_wrap_policy", "=set()`", "'auto'", "at least one block class"),
    ("policy-empty-list", dict(auto_wrap_policy=[]), ValueError,
     "auto_wrap_policy", "=[]`", "'auto'", "at least one block class"),
    ("ac-module-missing", dict(activation_checkpointing_policy="no_such_pkg_xyz.Block"), ValueError,
     "activation_checkpointing_policy", "'no_such_pkg_xyz.Block'", "'auto'", "importable"),
    ("ac-attr-missing", dict(activation_checkpointing_policy="torch.nn.NoSuchBlock"), ValueError,
     "activation_checkpointing_policy", "'torch.nn.NoSuchBlock'", "'auto'", "class name"),
    ("ac-not-module", dict(activation_checkpointing_policy="math.pi"), TypeError,
     "activation_checkpointing_policy", "'math.pi'", "'auto'", "torch.nn.Module"),
    ("ac-no-dot", dict(activation_checkpointing_policy="Block"), ValueError,
     "activation_checkpointing_policy", "'Block'", "'auto'", "full import path"),
    ("ac-float", dict(activation_checkpointing_policy=3.5), TypeError,
     "activation_checkpointing_policy", "=3.5`", "'auto'", "activation_checkpointing_policy={Block}"),
    ("ac-dict", dict(activation_checkpointing_policy={"a": 1}), TypeError,
     "activation_checkpointing_policy", "{'a': 1}", "'auto'", "activation_checkpointing_policy="),
    ("ac-collection-non-class", dict(activation_checkpointing_policy=(Block, 7)), TypeError,
     "activation_checkpointing_policy", ", 7)", "'auto'", "only module classes"),
    ("ac-empty", dict(activation_checkpointing_policy=()), ValueError,
     "activation_checkpointing_policy", "=()`", "'auto'", "at least one block class"),
    ("ac-legacy-bad", dict(activation_checkpointing=3.5), TypeError,
     "activation_checkpointing", "=3.5`", "'auto'", "activation_checkpointing={Block}"),
    ("ac-both", dict(activation_checkpointing={Block}, activation_checkpointing_policy={Block}), ValueError,
     "activation_checkpointing", "Block'>}", "only one of", "Drop `activation_checkpointing`"),
    ("precision-unknown", dict(precision="64-true"), ValueError,
     "precision", "'64-true'", "'bf16-mixed'", "precision='bf16-mixed'"),
    ("precision-int", dict(precision=64), ValueError,
     "precision", "=64`", "'16-mixed'", "precision="),
    ("cpu-offload-str", dict(cpu_offload="yes"), TypeError,
     "cpu_offload", "'yes'", "CPUOffloadPolicy", "cpu_offload=True"),
    ("cpu-offload-int", dict(cpu_offload=1), TypeError,
     "cpu_offload", "=1`", "True, False", "cpu_offload=True"),
    ("mixed-precision-fsdp1", dict(mixed_precision=MixedPrecision()), TypeError,
     "mixed_precision", "MixedPrecision(param_dtype=None", "MixedPrecisionPolicy", "precision='bf16-mixed'"),
    ("mixed-precision-dtype", dict(mixed_precision=torch.bfloat16), TypeError,
     "mixed_precision", "torch.bfloat16", "MixedPrecisionPolicy", "MixedPrecisionPolicy(param_dtype"),
    ("state-dict-type-unknown", dict(state_dict_type="local"), ValueError,
     "state_dict_type", "'local'", "'sharded', 'full'", "state_dict_type='sharded'"),
    ("state-dict-type-int", dict(state_dict_type=1), ValueError,
     "state_dict_type", "=1`", "'full'", "state_dict_type="),
    ("mesh-zero", dict(sharding_strategy="HYBRID_SHARD", device_mesh=(0, 2)), ValueError,
     "device_mesh", "(0, 2)", "two positive ints", "positive sizes"),
    ("mesh-negative", dict(sharding_strategy="HYBRID_SHARD", device_mesh=(2, -4)), ValueError,
     "device_mesh", "(2, -4)", "two positive ints", "positive sizes"),
    ("mesh-negative-list", dict(sharding_strategy="HYBRID_SHARD", device_mesh=[-1, -1]), ValueError,
     "device_mesh", "[-1, -1]", "two positive ints", "positive sizes"),
    ("mesh-one-dim", dict(sharding_strategy="HYBRID_SHARD", device_mesh=(4,)), TypeError,
     "device_mesh", "(4,)", "two positive ints", "device_mesh=(2, 8)"),
    ("mesh-three-dims", dict(sharding_strategy="HYBRID_SHARD", device_mesh=(1, 2, 2)), TypeError,
     "device_mesh", "(1, 2, 2)", "two positive ints", "device_mesh=(2, 8)"),
    ("mesh-string", dict(sharding_strategy="HYBRID_SHARD", device_mesh="2x4"), TypeError,
     "device_mesh", "'2x4'", "DeviceMesh", "device_mesh=(2, 8)"),
    ("mesh-float-sizes", dict(sharding_strategy="HYBRID_SHARD", device_mesh=(2.0, 4.0)), TypeError,
     "device_mesh", "(2.0, 4.0)", "two positive ints", "device_mesh="),
    ("mesh-without-hybrid", dict(device_mesh=(2, 4)), ValueError,
     "device_mesh", "(2, 4)", "only together with hybrid sharding", "sharding_strategy='HYBRID_SHARD'"),
    ("mesh-with-shard-grad-op", dict(sharding_strategy="SHARD_GRAD_OP", device_mesh=[1, 2]), ValueError,
     "device_mesh", "[1, 2]", "hybrid sharding", "sharding_strategy='HYBRID_SHARD'"),
    ("reshard-zero", dict(reshard_after_forward=0), ValueError,
     "reshard_after_forward", "=0`", "an int > 1", "reshard_after_forward=True"),
    ("reshard-one", dict(reshard_after_forward=1), ValueError,
     "reshard_after_forward", "=1`", "an int > 1", "reshard_after_forward=True"),
    ("reshard-negative", dict(reshard_after_forward=-2), ValueError,
     "reshard_after_forward", "=-2`", "an int > 1", "reshard_after_forward=True"),
    ("reshard-string", dict(reshard_after_forward="yes"), ValueError,
     "reshard_after_forward", "'yes'", "True, False", "reshard_after_forward=True"),
    ("hybrid-no-sync-unknown", dict(sharding_strategy="HYBRID_SHARD", hybrid_no_sync="skip_none"), ValueError,
     "hybrid_no_sync", "'skip_none'", "'skip_all', 'reduce_scatter_only'", "hybrid_no_sync='skip_all'"),
    ("hybrid-no-sync-bool", dict(hybrid_no_sync=True), ValueError,
     "hybrid_no_sync", "=True`", "'reduce_scatter_only'", "hybrid_no_sync="),
]


@pytest.mark.parametrize(
    ("kwargs", "exc", "argument", "shown", "allowed", "hint"),
    [case[1:] for case in STRATEGY_CASES],
    ids=[case[0] for case in STRATEGY_CASES],
)
def test_strategy_rejects_bad_argument(kwargs, exc, argument, shown, allowed, hint):
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        with pytest.raises(exc, match=re.escape(f"Invalid `{argument}=")) as info:
            FSDPStrategy(**kwargs)
    # Only the deprecated spelling, given alone, warns on its way to the error.
    deprecated_alone = kwargs.keys() == {"activation_checkpointing"}
    assert [w.category for w in record] == ([DeprecationWarning] if deprecated_alone else [])
    # Exactly the type asked for: a ValueError must not be a TypeError in disguise and vice versa.
    assert type(info.value) is exc
    check_message(info.value, argument, shown, allowed, hint)


def test_catalogue_is_large_and_distinct():
    ids = [case[0] for case in STRATEGY_CASES]
    assert len(ids) == len(set(ids))
    assert len(ids) >= 20
    arguments = {case[3] for case in STRATEGY_CASES}
    assert arguments == {
        "sharding_strategy", "auto_wrap_policy", "activation_checkpointing_policy", "activation_checkpointing",
        "precision", "cpu_offload", "mixed_precision", "state_dict_type", "device_mesh", "reshard_after_forward",
        "hybrid_no_sync", "sync_module_states",
    }


def test_dotted_name_problem_is_explained():
    with pytest.raises(ValueError, match=r"The module 'no_such_pkg_xyz\.model' of 'no_such_pkg_xyz\.model\.Block'"):
        FSDPStrategy(auto_wrap_policy="no_such_pkg_xyz.model.Block")
    with pytest.raises(ValueError, match=r"The module 'torch\.nn' has no attribute 'NoSuchBlock'"):
        FSDPStrategy(auto_wrap_policy="torch.nn.NoSuchBlock")
    with pytest.raises(TypeError, match=r"math\.pi is 3\.14159\d*, not an nn\.Module class"):
        FSDPStrategy(auto_wrap_policy="math.pi")
    with pytest.raises(ValueError, match=r"'Block' is not a dotted name \(module\.Class\)"):
        FSDPStrategy(auto_wrap_policy="Block")
    with pytest.raises(TypeError, match=r"The collection holds 3 of type int"):
        FSDPStrategy(auto_wrap_policy=[Block, 3])
    with pytest.raises(TypeError, match=r"A value of type float is not a policy"):
        FSDPStrategy(auto_wrap_policy=3.5)
    with pytest.raises(ValueError, match=r"An empty collection selects nothing"):
        FSDPStrategy(auto_wrap_policy=frozenset())
    with pytest.raises(TypeError, match=r"FSDP1's `MixedPrecision` does not apply to FSDP2"):
        FSDPStrategy(mixed_precision=MixedPrecision(param_dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"Both `activation_checkpointing` and `activation_checkpointing_policy`"):
        FSDPStrategy(activation_checkpointing=[Block], activation_checkpointing_policy="auto")


def test_precision_plugin_rejects_unknown_name():
    with pytest.raises(ValueError, match=r"Invalid `precision='fp8'`") as info:
        FSDPPrecision("fp8")
    check_message(info.value, "precision", "'fp8'", "'32-true', 'bf16-mixed', '16-mixed', 'bf16-true', '16-true'",
                  "precision='bf16-mixed'")
    with pytest.raises(ValueError, match=r"Invalid `precision='64-true'`") as info:
        FSDPStrategy(precision="64-true")
    check_message(info.value, "precision", "'64-true'", "'16-true'", "precision=")


@pytest.mark.parametrize("value", [["bf16-mixed"], {"precision": "bf16-mixed"}], ids=["list", "dict"])
def test_precision_plugin_rejects_unhashable_value(value):
    # Not a bare "unhashable type" from the alias lookup: the same message as every other bad precision.
    with pytest.raises((ValueError, TypeError), match=re.escape(f"Invalid `precision={value!r}`")) as info:
        FSDPPrecision(value)
    check_message(info.value, "precision", repr(value), "'bf16-mixed'", "precision='bf16-mixed'")


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "bf16-true", "16-true"])
def test_scaler_only_with_16_mixed(precision):
    scaler = torch.amp.GradScaler("cpu")
    with pytest.raises(ValueError, match=r"Invalid `scaler=<torch\.amp\.grad_scaler\.GradScaler") as info:
        FSDPPrecision(precision, scaler=scaler)
    check_message(info.value, "scaler", "GradScaler object", "precision='16-mixed'", "Drop the scaler")
    # With the one precision that scales, the same scaler is kept.
    assert FSDPPrecision("16-mixed", scaler=scaler).scaler is scaler


def test_untranslatable_lightning_precision_plugin():
    plugin = DoublePrecision()
    with pytest.raises(ValueError, match=r"Invalid `precision=<lightning\.fabric\.plugins\.precision") as info:
        as_fsdp_precision(plugin)
    check_message(info.value, "precision", "DoublePrecision object", "'bf16-mixed'", "no custom precision plugin")
    assert "DoublePrecision cannot drive FSDP2 sharded training" in str(info.value)
    # The same plugin handed to the strategy directly fails the same way.
    with pytest.raises(ValueError, match=r"DoublePrecision cannot drive FSDP2"):
        FSDPStrategy(precision=plugin)


@pytest.mark.parametrize(
    ("mesh", "world_size", "num_nodes", "shown", "problem", "hint"),
    [
        ((3, 2), 4, 1, "(3, 2)", "The mesh has 3 x 2 = 6 ranks, but 4 processes are running", "device_mesh=(1, 4)"),
        ((2, 2), 8, 2, "(2, 2)", "The mesh has 2 x 2 = 4 ranks, but 8 processes are running", "device_mesh=(2, 4)"),
    ],
)
def test_mesh_size_must_match_world_size(mesh, world_size, num_nodes, shown, problem, hint):
    config = FSDPConfig.from_arguments(sharding_strategy="HYBRID_SHARD", device_mesh=mesh)
    assert config.device_mesh == mesh
    with pytest.raises(ValueError, match=re.escape(problem)) as info:
        build_mesh(config, torch.device("cpu"), world_size=world_size, num_nodes=num_nodes)
    check_message(info.value, "device_mesh", shown, f"multiply to the world size, {world_size}", hint)


def test_default_hybrid_mesh_must_divide_world_size():
    # No mesh given: (num_nodes, world // num_nodes) = (2, 2) cannot cover 5 ranks.
    config = FSDPConfig.from_arguments(sharding_strategy="HYBRID_SHARD")
    with pytest.raises(ValueError, match=r"The mesh has 2 x 2 = 4 ranks, but 5 processes are running"):
        build_mesh(config, torch.device("cpu"), world_size=5, num_nodes=2)


# --- warnings -----------------------------------------------------------------------------------------------


def test_deprecated_activation_checkpointing_warns_and_still_works():
    with pytest.warns(DeprecationWarning, match=r"`activation_checkpointing` is deprecated; use "
                                                 r"`activation_checkpointing_policy`") as record:
        strategy = FSDPStrategy(activation_checkpointing={Block})
    # The warning points at the user's call, not into the package.
    assert any(w.filename == __file__ for w in record), [w.filename for w in record]
    policy = strategy.config.activation_checkpointing_policy
    assert isinstance(policy, Policy)
    assert policy.classes == (Block,)
    assert policy.argument == "activation_checkpointing"


def test_new_activation_checkpointing_does_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        strategy = FSDPStrategy(activation_checkpointing_policy={Block})
    assert strategy.config.activation_checkpointing_policy.classes == (Block,)
    assert strategy.config.activation_checkpointing_policy.argument == "activation_checkpointing_policy"


@pytest.mark.parametrize("sharding", ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"])
def test_reduce_scatter_only_without_hybrid_warns(sharding):
    with pytest.warns(UserWarning, match=rf"only changes hybrid sharding, but `sharding_strategy` is '{sharding}'"):
        strategy = FSDPStrategy(sharding_strategy=sharding, hybrid_no_sync="reduce_scatter_only")
    assert strategy.config.hybrid_no_sync == "reduce_scatter_only"


@pytest.mark.parametrize("sharding", ["HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"])
def test_reduce_scatter_only_with_hybrid_is_silent(sharding):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        strategy = FSDPStrategy(sharding_strategy=sharding, hybrid_no_sync="reduce_scatter_only")
    assert strategy.config.hybrid_no_sync == "reduce_scatter_only"


# --- valid inputs are accepted ------------------------------------------------------------------------------


def test_defaults():
    config = FSDPStrategy().config
    assert config.sharding_strategy is ShardingStrategy.FULL_SHARD
    assert config.reshard_after_forward is None
    assert type(config.offload_policy) is OffloadPolicy
    assert config.cpu_offload is False
    assert config.mixed_precision is None
    assert config.auto_wrap_policy == Policy("auto_wrap_policy", auto=True)
    assert config.activation_checkpointing_policy is None
    assert config.state_dict_type == "sharded"
    assert config.device_mesh is None
    assert config.hybrid_no_sync == "skip_all"


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("full_shard", ShardingStrategy.FULL_SHARD),
        ("FULL_SHARD", ShardingStrategy.FULL_SHARD),
        ("Hybrid_Shard", ShardingStrategy.HYBRID_SHARD),
        ("  no_shard ", ShardingStrategy.NO_SHARD),
        ("_hybrid_shard_zero2", ShardingStrategy._HYBRID_SHARD_ZERO2),
        (ShardingStrategy.NO_SHARD, ShardingStrategy.NO_SHARD),
        (TorchShardingStrategy.SHARD_GRAD_OP, ShardingStrategy.SHARD_GRAD_OP),
        (TorchShardingStrategy.HYBRID_SHARD, ShardingStrategy.HYBRID_SHARD),
        (TorchShardingStrategy._HYBRID_SHARD_ZERO2, ShardingStrategy._HYBRID_SHARD_ZERO2),
    ],
)
def test_sharding_strategy_accepted(value, expected):
    assert FSDPStrategy(sharding_strategy=value).config.sharding_strategy is expected


def test_sharding_strategy_meaning():
    assert ShardingStrategy.HYBRID_SHARD.is_hybrid and ShardingStrategy._HYBRID_SHARD_ZERO2.is_hybrid
    assert not ShardingStrategy.FULL_SHARD.is_hybrid and not ShardingStrategy.NO_SHARD.is_hybrid
    assert ShardingStrategy.FULL_SHARD.default_reshard_after_forward is None
    assert ShardingStrategy.HYBRID_SHARD.default_reshard_after_forward is None
    assert ShardingStrategy.SHARD_GRAD_OP.default_reshard_after_forward is False
    assert ShardingStrategy._HYBRID_SHARD_ZERO2.default_reshard_after_forward is False


@pytest.mark.parametrize(
    ("value", "policy_type", "offloaded"),
    [
        (None, OffloadPolicy, False),
        (False, OffloadPolicy, False),
        (True, CPUOffloadPolicy, True),
        (CPUOffload(offload_params=True), CPUOffloadPolicy, True),
        (CPUOffload(offload_params=False), OffloadPolicy, False),
    ],
)
def test_cpu_offload_accepted(value, policy_type, offloaded):
    config = FSDPStrategy(cpu_offload=value).config
    assert type(config.offload_policy) is policy_type
    assert config.cpu_offload is offloaded


def test_cpu_offload_policy_object_is_kept():
    policy = CPUOffloadPolicy(pin_memory=False)
    config = FSDPStrategy(cpu_offload=policy).config
    assert config.offload_policy is policy
    assert config.cpu_offload is True


def test_mixed_precision_policy_is_kept():
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    assert FSDPStrategy(mixed_precision=mp).config.mixed_precision is mp


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, "32-true"),
        ("32-true", "32-true"),
        ("32", "32-true"),
        (32, "32-true"),
        ("bf16", "bf16-mixed"),
        ("bf16-mixed", "bf16-mixed"),
        ("16", "16-mixed"),
        (16, "16-mixed"),
        ("16-mixed", "16-mixed"),
        ("bf16-true", "bf16-true"),
        ("16-true", "16-true"),
    ],
)
def test_precision_accepted(value, expected):
    strategy = FSDPStrategy(precision=value)
    assert isinstance(strategy.precision, FSDPPrecision)
    assert strategy.precision.precision == expected
    if value is not None:
        assert FSDPPrecision(value).precision == expected


def test_precision_meaning():
    assert FSDPPrecision("32-true").mixed_precision_policy() is None
    assert FSDPPrecision("bf16-true").mixed_precision_policy() is None
    bf16 = FSDPPrecision("bf16-mixed").mixed_precision_policy()
    assert (bf16.param_dtype, bf16.reduce_dtype) == (torch.bfloat16, torch.float32)
    fp16 = FSDPPrecision("16-mixed").mixed_precision_policy()
    assert (fp16.param_dtype, fp16.reduce_dtype) == (torch.float16, torch.float32)
    assert FSDPPrecision("32-true").scaler is None
    assert FSDPPrecision("bf16-mixed").scaler is None
    assert type(FSDPPrecision("16-mixed").scaler).__name__ == "DTensorGradScaler"


def test_lightning_precision_plugins_are_translated():
    from lightning.fabric.plugins.precision import HalfPrecision, MixedPrecision as LightningMixedPrecision, Precision

    assert as_fsdp_precision(None).precision == "32-true"
    assert as_fsdp_precision(Precision()).precision == "32-true"
    assert as_fsdp_precision(HalfPrecision("bf16-true")).precision == "bf16-true"
    assert as_fsdp_precision(LightningMixedPrecision("bf16-mixed", "cpu")).precision == "bf16-mixed"
    ours = FSDPPrecision("bf16-true")
    assert as_fsdp_precision(ours) is ours


@pytest.mark.parametrize(
    ("kwargs", "field", "expected"),
    [
        (dict(state_dict_type="full"), "state_dict_type", "full"),
        (dict(state_dict_type="FULL"), "state_dict_type", "full"),
        (dict(state_dict_type="Sharded"), "state_dict_type", "sharded"),
        (dict(reshard_after_forward=True), "reshard_after_forward", True),
        (dict(reshard_after_forward=False), "reshard_after_forward", False),
        (dict(reshard_after_forward=2), "reshard_after_forward", 2),
        (dict(sharding_strategy="HYBRID_SHARD", device_mesh=(2, 4)), "device_mesh", (2, 4)),
        (dict(sharding_strategy="hybrid_shard", device_mesh=[1, 2]), "device_mesh", (1, 2)),
        (dict(sharding_strategy="HYBRID_SHARD", hybrid_no_sync="REDUCE_SCATTER_ONLY"), "hybrid_no_sync",
         "reduce_scatter_only"),
    ],
)
def test_other_arguments_accepted(kwargs, field, expected):
    value = getattr(FSDPStrategy(**kwargs).config, field)
    assert value == expected
    assert type(value) is type(expected)


def test_policies_accepted():
    config = FSDPStrategy(
        auto_wrap_policy=["torch.nn.TransformerEncoderLayer", nn.Linear, "torch.nn.Linear"],
        activation_checkpointing_policy="torch.nn.TransformerEncoderLayer",
    ).config
    # Duplicates (the class and its dotted name) collapse, order is kept.
    assert config.auto_wrap_policy.classes == (nn.TransformerEncoderLayer, nn.Linear)
    assert config.activation_checkpointing_policy.classes == (nn.TransformerEncoderLayer,)


def test_unknown_keyword_argument_is_a_clear_type_error():
    with pytest.raises(TypeError) as info:
        FSDPStrategy(sharding_stratgy="FULL_SHARD")
    check_message(info.value, "sharding_stratgy", "'FULL_SHARD'", "use_orig_params", "help(FSDPStrategy)")


def test_fsdp1_keyword_arguments_warn_and_are_ignored():
    with pytest.warns(UserWarning, match="`limit_all_gathers=True` is an FSDP1 argument and is ignored"):
        strategy = FSDPStrategy(limit_all_gathers=True)
    assert strategy.config.sharding_strategy.value == "FULL_SHARD"


@pytest.mark.parametrize("value, expected", [(None, True), (True, True), (False, False)])
def test_sync_module_states_is_honoured_and_on_by_default(value, expected):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "ignored" warning: the argument is real now
        assert FSDPStrategy(sync_module_states=value).config.sync_module_states is expected


def test_a_configured_scaler_is_kept_when_translating_lightning_plugins():
    from lightning.fabric.plugins.precision import MixedPrecision

    scaler = torch.amp.GradScaler("cpu", init_scale=64.0)
    translated = as_fsdp_precision(MixedPrecision("16-mixed", device="cpu", scaler=scaler))
    assert translated.precision == "16-mixed" and translated.scaler is scaler


def test_a_collective_failure_names_only_a_timeout_known_to_be_in_force(monkeypatch):
    """The message names ``timeout=...`` for a process group this package created with it; for a group the user
    created (whose timeout the strategy never saw) it speaks of "the process group's timeout" instead."""
    import types
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from lightning_fsdp._base import failures
    from lightning_fsdp.engine import mesh

    def failure() -> str:
        with pytest.raises(failures.CollectiveFailure) as caught:
            with failures.explain_collective_failure("forward"):
                raise dist.DistError("gloo: connection closed by peer")
        return str(caught.value)

    monkeypatch.setattr(failures, "_process_group_timeout", None)
    monkeypatch.setattr(failures, "_suspects", lambda: "rank 1")
    monkeypatch.setattr(failures, "_reporter", lambda: "rank 0 of 2")
    failures.remember_timeout(timedelta(seconds=7))
    assert "timeout=0:00:07" in failure()

    # A group that exists already and was not created here: the strategy's own timeout must not be named.
    users_group = object()
    monkeypatch.setattr(mesh, "dist", types.SimpleNamespace(is_initialized=lambda: True,
                                                            group=types.SimpleNamespace(WORLD=users_group)))
    monkeypatch.setattr(mesh, "register_exit_handler", lambda **kwargs: None)
    mesh.init_process_group(None, "gloo", torch.device("cpu"), timedelta(seconds=99))
    message = failure()
    assert "timeout=0:" not in message and "bounded by the process group's timeout" in message, message

    # The group this package created, shared by a later Fabric in the same process: its timeout stays named.
    monkeypatch.setattr(mesh, "_created_group", users_group)
    failures.remember_timeout(timedelta(seconds=7))
    mesh.init_process_group(None, "gloo", torch.device("cpu"), timedelta(seconds=99))
    assert "timeout=0:00:07" in failure()
