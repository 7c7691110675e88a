"""Two-rank Trainer cases (see ``workers/trainer_core.py``), one launch for all of them: lifecycle, parity with one
process, accumulation, clipping, manual optimization, precision, torch.compile."""

from launch import case_tests

CASES = [
    "fit_matches_single_process_and_each_rank_sees_its_own_data",
    "parity_shard_grad_op_with_dotted_name_policies",
    "parity_no_shard",
    "parity_cpu_offload",
    "reshard_after_forward_overrides_the_sharding_strategy",
    "accumulate_grad_batches_defers_communication_and_matches",
    "clip_gradients_by_norm_matches",
    "clip_gradients_by_value_matches",
    "manual_optimization_with_two_sub_models_and_two_optimizers",
    "validate_test_predict_log_and_torchmetrics_match",
    "init_module_empty_init_materializes_after_sharding",
    "configure_model_sees_the_device_mesh",
    "bf16_mixed_through_trainer_precision",
    "torch_compile_of_blocks_composes_with_sharding",
    "a_parameter_on_the_lightning_module_itself_is_refused_with_a_hint",
    "collectives_work",
    "fits_one_after_another_share_the_mesh_and_add_no_process_groups",
    "modules_fitted_one_after_another_are_freed_once_deleted",
]


results, test_case = case_tests("trainer_core.py", 2, CASES)
