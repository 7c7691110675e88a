"""Two-rank Fabric cases for forwards without backward, EMA/teacher models, optimizers built after an evaluation
forward, and ranks seeded differently (see ``workers/patterns.py``), one launch for all of them."""

from launch import case_tests

_STRATEGIES = ["full_shard", "shard_grad_op", "no_shard", "full_shard_ac", "shard_grad_op_ac", "cpu_offload",
               "keep_after_forward", "per_unit_reshard"]

CASES = [f"no_grad_forward_before_step_{label}" for label in _STRATEGIES] + [
    f"{kind}_forward_before_step_{label}"
    for label in ("full_shard", "shard_grad_op_ac", "cpu_offload")
    for kind in ("inference_mode", "eval_mode", "generation")
] + ["generation_forward_before_step_per_unit_reshard"] + [
    "two_forwards_one_backward",
    "extra_forwards_change_nothing_under_bf16_mixed",
    "ema_teacher_updated_in_place_full_shard",
    "ema_teacher_updated_in_place_shard_grad_op_ac",
    "ema_teacher_updated_in_place_no_shard",
    "optimizer_built_after_a_no_grad_forward_trains_the_root_full_shard",
    "optimizer_built_after_a_dropped_forward_trains_the_root_full_shard",
    "optimizer_built_after_a_dropped_forward_trains_every_unit_shard_grad_op",
    "state_dict_after_a_dropped_forward_holds_shards",
    "several_models_each_stay_at_rest",
    "ranks_seeded_differently_start_from_rank0_full_shard",
    "ranks_seeded_differently_start_from_rank0_shard_grad_op",
    "ranks_seeded_differently_start_from_rank0_no_shard",
    "ranks_seeded_differently_start_from_rank0_cpu_offload",
    "meta_init_buffers_agree_across_ranks",
    "sync_module_states_false_keeps_each_ranks_values",
    "registry_strings_train_on_cpu",
]

results, test_case = case_tests("patterns.py", 2, CASES)
