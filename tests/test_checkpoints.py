"""Two-rank checkpoint cases (see ``workers/checkpoints.py``), one launch for all of them."""

from launch import case_tests

CASES = [
    "round_trip_is_exact_and_training_continues_identically",
    "missing_key_is_a_key_error_and_strict_false_tolerates_it",
    "filters_work_for_sharded_and_full_and_load_with_strict_false",
    "several_models_and_optimizers_in_one_checkpoint",
    "full_and_sharded_replace_each_other_at_the_same_path",
    "bad_save_arguments_are_clear_errors",
    "corrupted_checkpoints_fail_on_every_rank_naming_the_file",
    "unpickling_needs_an_explicit_opt_in",
    "sharded_entries_that_need_unpickling_need_the_opt_in_too",
    "plain_single_device_checkpoint_loads_into_the_sharded_model",
    "async_save_returns_early_and_the_checkpoint_is_complete",
    "async_save_errors_surface_at_the_next_call",
    "async_staging_keeps_each_dtensor_on_its_host_copy",
    "consecutive_async_saves_with_training_between_each_load_their_own_state",
    "uneven_shapes_and_views_in_a_full_checkpoint_read_back_exactly",
    "uneven_shapes_convert_exactly_from_a_sharded_checkpoint",
    "never_stepped_parameters_load_as_no_state_and_training_matches",
]


results, test_case = case_tests("checkpoints.py", 2, CASES)
