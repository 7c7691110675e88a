"""The speed and memory controls: prefetch depths, int and per-unit ``reshard_after_forward``, every-N and op-level
selective activation checkpointing. Multi-process cases in ``workers/controls.py`` (one launch on 2 ranks, one on
4), and the argument checks, which need no launch."""

from __future__ import annotations

import pytest

from launch import case_tests, launch

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


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    return launch("controls.py", 4, tmp_path_factory.mktemp("controls4"))


@pytest.mark.parametrize("name", FOUR_RANKS)
def test_four_ranks(four_ranks, name):
    four_ranks.check(name)
