"""Two-rank edge cases for the Fabric front (see ``workers/fabric_edges.py``), one launch for all of them."""

from launch import case_tests

CASES = [
    "preemption_agreement_is_one_all_reduce_of_one_integer_per_step",
    "separate_setup_remaps_an_optimizer_built_before_setup_module",
    "optimizer_with_parameters_of_no_model_is_refused",
    "clip_norms_with_empty_shards_match_reference",
    "replicas_agree_although_ranks_seeded_differently",
    "no_shard_refuses_a_1d_mesh",
    "nested_no_backward_sync_keeps_sync_off_until_the_outer_block_ends",
    "lbfgs_trains_after_joint_setup",
    "saving_before_the_first_step_leaves_the_optimizer_alone",
    "saving_never_overwrites_user_files",
    "load_recovers_a_checkpoint_left_aside_by_a_crashed_save",
    "load_raw_finds_the_model_under_any_key",
    "fsdp1_keyword_arguments_are_accepted_with_a_warning",
    "all_reduce_mean_stays_in_the_tensor_passed",
    "teardown_works_without_checkpoint_io",
    "strategies_set_up_one_after_another_share_each_mesh_and_add_no_groups",
    "models_set_up_one_after_another_are_freed_once_deleted",
]


results, test_case = case_tests("fabric_edges.py", 2, CASES)
