"""Two-rank Fabric cases (see ``workers/fabric_core.py``), one launch for all of them."""

from launch import case_tests

CASES = [
    "parity_full_shard",
    "parity_full_shard_activation_checkpointing",
    "parity_shard_grad_op",
    "parity_shard_grad_op_activation_checkpointing",
    "parity_no_shard",
    "parity_no_shard_activation_checkpointing",
    "parity_cpu_offload",
    "parity_reshard_after_forward_override",
    "reshard_after_forward_false_keeps_full_shard_blocks_gathered",
    "grad_reduce_dtype_follows_the_precision_table",
    "mixed_precision_policy_overrides_the_precision_setting",
    "parity_bf16_mixed",
    "parity_16_mixed_with_loss_scaler",
    "clip_gradients_norm_unscales_first_under_16_mixed",
    "true_half_precisions_store_low_dtype_shards",
    "loss_scaler_skips_step_on_every_rank_when_one_rank_overflows",
    "sharding_is_real",
    "units_match_each_policy_form",
    "policy_matching_nothing_warns_with_candidates",
    "existing_fsdp_units_are_respected",
    "existing_checkpoint_wrappers_are_not_wrapped_twice",
    "joint_setup_remaps_optimizer_and_trains",
    "separate_setup_trains",
    "meta_init_materializes_shards_and_trains",
    "meta_init_gives_each_shard_its_own_values",
    "save_and_load_after_a_forward_without_backward",
    "joint_setup_refuses_optimizer_with_state",
    "gradient_accumulation_with_no_backward_sync",
    "clip_gradients_norm_matches_reference",
    "clip_gradients_value_matches_reference",
    "collectives_work",
    "torchmetrics_follow_the_model",
    "checkpoint_round_trip_sharded_and_full",
]


results, test_case = case_tests("fabric_core.py", 2, CASES)
