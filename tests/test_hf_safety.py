"""Hugging Face safetensors loads that cannot be exact are refused (see ``workers/hf_safety.py``), two ranks, one
launch."""

from launch import case_tests
from skips import require

require("safetensors")  # a dependency of the package: where it is missing, this file fails, not skips

CASES = [
    "a_weight_that_chunks_cover_only_in_part_is_refused",
    "overlapping_chunks_are_refused",
    "chunks_outside_the_weight_or_of_another_rank_are_refused",
    "index_entries_must_stay_inside_the_directory",
    "a_dtype_of_another_kind_is_refused_and_precision_changes_load",
    "trainer_fit_refuses_a_partial_weight_on_every_rank",
]

results, test_case = case_tests("hf_safety.py", 2, CASES)
