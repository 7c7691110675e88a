"""Full (unsharded) state dicts into a set-up model, by every route, on both fronts (``workers/full_state_load.py``,
2 ranks, one launch; issue 19, part 1): both reproductions from the issue, ``strict`` either way against what torch
reports for an unsharded copy, ``assign=True``, ``load_raw`` and ``load`` of full files, key-renaming and reshaping
hooks, shapes that do not divide by the world size, SHARD_GRAD_OP and NO_SHARD, one training step after a load, and
the Trainer's ``LightningModule.load_state_dict`` and ``strategy.load_model_state_dict``."""

from __future__ import annotations

from launch import case_tests

CASES = [
    "issue_reproduction_load_state_dict_of_a_full_dict",
    "issue_reproduction_load_raw_through_a_renaming_module",
    "renaming_module_through_load_state_dict",
    "reshaping_hook",
    "strict_false_reports_the_keys_torch_reports",
    "strict_raises_what_torch_raises",
    "size_mismatch_is_reported_by_torch",
    "odd_shapes_load_exactly",
    "assign_true_keeps_shards_of_their_own",
    "one_training_step_after_a_load_matches_one_process",
    "load_after_a_grad_free_forward_is_not_lost",
    "shard_grad_op_and_no_shard",
    "load_raw_of_a_full_file_strict",
    "load_of_a_full_checkpoint_with_optimizer",
    "load_raw_strict_through_hooks_is_judged_as_torch_judges_it",
    "load_raw_through_a_reshaping_hook",
    "bf16_parameters_offloaded_to_the_host",
    "trainer_lightning_module_load_state_dict",
    "trainer_strict_false_result_object",
    "trainer_strategy_load_model_state_dict",
]


# A launch of its own: on Lightning 2.5.6 (CI's oldest-lightning leg), after these cases had run in the 2-rank pool's
# process, the pool's compiled Trainer case (`trainer_checkpoints.py::compiled_model_checkpoint_has_clean_keys`) died
# in dynamo's guard building (IndexError) and took the pool's process group with it. The mechanism: dynamo traced
# `at_rest.reshard_all`, run from a root's forward hook inside the compiled forward; it is now `torch.compiler.disable`d,
# and the pool that failed passes. This script stays apart until the pool has run clean on that leg more than once:
# its own processes, started in the background with the pools (``alone=True``), not on the main process's path.
results, test_case = case_tests("full_state_load.py", 2, CASES, alone=True)
