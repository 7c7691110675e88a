"""The speed and memory controls: prefetch depths, int and per-unit ``reshard_after_forward``, every-N and op-level
selective activation checkpointing. Multi-process cases in ``workers/controls.py`` (one launch on 2 ranks, one on
4), and the argument checks, which need no launch."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from launch import case_tests, pooled
from lightning_fsdp.engine.activation_checkpointing import CheckpointingPolicy
from lightning_fsdp.engine.resharding import ReshardPlan
from lightning_fsdp.fabric import FSDPStrategy
from lightning_fsdp.trainer import FSDPStrategy as TrainerFSDPStrategy

TWO_RANKS = [
    "prefetch_depth_2_registers_and_trains_full_shard",
    "prefetch_depth_2_registers_and_trains_shard_grad_op",
    "prefetch_defaults_register_nothing_and_true_means_one",
    "per_unit_reshard_reaches_the_right_units_full_shard",
    "per_unit_reshard_reaches_the_right_units_shard_grad_op",
    "reshard_errors_at_setup_name_the_value_and_the_units",
    "selective_checkpointing_recomputes_pointwise_ops_not_matmuls",
    "custom_save_ops_recompute_what_they_leave_out",
    "every_2nd_block_checkpoints_exactly_blocks_1_and_3_full_shard",
    "every_3rd_auto_block_shard_grad_op",
    "selective_every_2nd_trains_like_the_reference_shard_grad_op",
    "selective_trains_like_the_reference_full_shard",
    "all_controls_together_full_shard",
]
# An int reshard needs a shard axis of 4 to have a smaller group to go to; hybrid sharding needs 4 ranks.
FOUR_RANKS = [
    "int_reshard_leaves_blocks_on_groups_of_2",
    "int_reshard_per_unit_with_a_grad_free_forward_stays_at_rest",
    "int_reshard_parity_shard_grad_op",
    "hybrid_shard_with_every_control",
]

results, test_two_ranks = case_tests("controls.py", 2, TWO_RANKS)


four_ranks = pooled("controls.py", 4, name="four_ranks")  # one 4-rank launch with the other 4-rank scripts


@pytest.mark.parametrize("name", FOUR_RANKS)
def test_four_ranks(four_ranks, name):
    four_ranks.check(name)


# --- argument checks (no launch) -----------------------------------------------------------------------------------

BAD = [
    # (id, kwargs, error type, argument, what the message must also say)
    ("forward-negative", dict(forward_prefetch=-1), ValueError, "forward_prefetch", "an int >= 0"),
    ("forward-string", dict(forward_prefetch="2"), TypeError, "forward_prefetch", "True (same as 1)"),
    ("backward-zero", dict(backward_prefetch=0), ValueError, "backward_prefetch", "cannot be switched off"),
    ("backward-post", dict(backward_prefetch="BACKWARD_POST"), ValueError, "backward_prefetch", "no BACKWARD_POST"),
    ("backward-float", dict(backward_prefetch=1.5), TypeError, "backward_prefetch", "an int >= 1"),
    ("reshard-dict-one", dict(reshard_after_forward={"root": 1}), ValueError, "reshard_after_forward", "use False"),
    ("reshard-dict-empty", dict(reshard_after_forward={}), ValueError, "reshard_after_forward", "chooses nothing"),
    ("reshard-dict-key", dict(reshard_after_forward={3: True}), TypeError, "reshard_after_forward", "not a class"),
    ("reshard-dict-value", dict(reshard_after_forward={"root": "yes"}), ValueError, "reshard_after_forward",
     "'yes' (the value for 'root') is not a choice"),
    ("ac-every-zero", dict(activation_checkpointing_policy={"every": 0}), ValueError,
     "activation_checkpointing_policy", "'every' is 0"),
    ("ac-every-string", dict(activation_checkpointing_policy={"every": "2"}), TypeError,
     "activation_checkpointing_policy", "'every' is '2'"),
    ("ac-unknown-key", dict(activation_checkpointing_policy={"evry": 2}), TypeError,
     "activation_checkpointing_policy", "Unknown key 'evry'"),
    ("ac-unknown-op", dict(activation_checkpointing_policy={"save_ops": ["torch.ops.aten.no_such_op"]}), ValueError,
     "activation_checkpointing_policy", "'torch.ops.aten.no_such_op' names no torch op"),
    ("ac-op-not-a-name", dict(activation_checkpointing_policy={"save_ops": [3]}), TypeError,
     "activation_checkpointing_policy", "3 is not an op"),
    ("ac-empty-ops", dict(activation_checkpointing_policy={"save_ops": []}), TypeError,
     "activation_checkpointing_policy", "'save_ops' is []"),
    ("ac-bad-blocks", dict(activation_checkpointing_policy={"blocks": "Block"}), ValueError,
     "activation_checkpointing_policy", "not a dotted name"),
]


@pytest.mark.parametrize("front", [FSDPStrategy, TrainerFSDPStrategy], ids=["fabric", "trainer"])
@pytest.mark.parametrize(("kwargs", "exc", "argument", "needle"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_control_values_name_the_argument_the_value_and_a_fix(front, kwargs, exc, argument, needle):
    with pytest.raises(exc) as info:
        front(**kwargs)
    message = str(info.value)
    assert type(info.value) is exc
    assert message.startswith(f"Invalid `{argument}="), message
    assert "Allowed: " in message and "HINT: " in message, message
    assert needle in message, message


def test_good_control_values_become_the_config():
    from torch.distributed.fsdp import BackwardPrefetch

    config = FSDPStrategy(
        forward_prefetch=True, backward_prefetch=BackwardPrefetch.BACKWARD_PRE,
        reshard_after_forward={"root": True, "torch.nn.TransformerEncoderLayer": 2, "blocks.3": False, nn.Linear: True},
        activation_checkpointing_policy={"blocks": ["torch.nn.TransformerEncoderLayer"], "every": 2,
                                         "save_ops": ["default", "aten.gelu", torch.ops.aten.silu.default]},
    ).config
    assert (config.forward_prefetch, config.backward_prefetch) == (1, 1)
    assert config.reshard_after_forward == ReshardPlan(
        # dotted strings stay strings until setup, where the model is asked first (tests/test_names_at_setup.py)
        entries=(("root", True), ("torch.nn.TransformerEncoderLayer", 2), ("blocks.3", False), (nn.Linear, True)),
        shown=config.reshard_after_forward.shown)
    policy = config.activation_checkpointing_policy
    assert isinstance(policy, CheckpointingPolicy) and policy.every == 2
    assert policy.classes == (nn.TransformerEncoderLayer,)
    assert torch.ops.aten.mm in policy.save_ops and torch.ops.aten.gelu in policy.save_ops
    assert torch.ops.aten.silu.default in policy.save_ops
    defaults = FSDPStrategy().config
    assert (defaults.forward_prefetch, defaults.backward_prefetch) == (0, 1)


def test_fsdp1_prefetch_keywords_are_now_arguments_not_ignored_kwargs():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "is an FSDP1 argument and is ignored" warning any more
        assert FSDPStrategy(forward_prefetch=False, backward_prefetch=None).config.backward_prefetch == 1


def test_every_n_selects_the_nth_outermost_blocks():
    encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(8, 2, 16), num_layers=5, enable_nested_tensor=False)
    policy = FSDPStrategy(activation_checkpointing_policy={"blocks": [nn.TransformerEncoderLayer, nn.Linear],
                                                           "every": 2}).config.activation_checkpointing_policy
    chosen = policy.select(encoder)
    # The Linear layers inside the chosen blocks do not count: only outermost blocks are numbered.
    assert chosen == [encoder.layers[1], encoder.layers[3]], chosen
