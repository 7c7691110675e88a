"""Trainer checkpoints (see ``workers/trainer_checkpoints.py``): a two-rank launch saves, resumes and reads both
layouts; a one-rank launch then resumes from what the two ranks saved (``workers/trainer_resize.py``)."""

import pytest

from launch import case_tests, launch

TWO_RANK_CASES = [
    "resume_from_sharded_checkpoint_is_bit_exact",
    "resume_from_full_checkpoint_is_bit_exact",
    "resume_from_last",
    "sharded_layout_is_lightnings_and_consolidates",
    "full_checkpoint_is_a_standard_ckpt_file",
    "ddp_resumes_from_our_full_checkpoint",
    "validate_and_test_from_a_sharded_directory",
    "save_top_k_removes_old_sharded_directories",
    "a_failed_save_keeps_the_last_good_checkpoint",
    "async_sharded_saves_are_complete_after_fit",
    "compiled_model_checkpoint_has_clean_keys",
    "uneven_shapes_full_checkpoint_reads_back_exactly",
    "full_ckpt_gathers_one_tensor_at_a_time",
    "a_head_that_never_stepped_resumes_strictly_and_exactly",
]
ONE_RANK_CASES = [
    "sharded_checkpoint_from_2_ranks_resumes_on_1",
    "full_checkpoint_from_2_ranks_resumes_on_1",
    "validate_on_1_process_from_a_2_rank_sharded_directory",
]


# The two-rank launch: `results` is its fixture, `test_two_ranks` its per-case test.
results, test_two_ranks = case_tests("trainer_checkpoints.py", 2, TWO_RANK_CASES)


@pytest.fixture(scope="module")
def resized(results, tmp_path_factory):
    return launch("trainer_resize.py", 1, tmp_path_factory.mktemp("trainer_resize"),
                  LFSDP_TRAINER_CHECKPOINTS=str(results.out))


@pytest.mark.parametrize("name", ONE_RANK_CASES)
def test_one_rank_resumes_what_two_ranks_saved(resized, name):
    resized.check(name)
