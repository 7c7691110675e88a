"""Hugging Face safetensors into sharded models and back out (see ``workers/hf.py``), two ranks, one launch."""

from launch import case_tests
from skips import require

require("transformers")  # a required test extra: where it is missing, this file fails, not skips

CASES = [
    "single_file_loads_exactly_and_generates_the_same",
    "indexed_directory_loads_exactly",
    "tied_embeddings_load_from_the_one_stored_name",
    "bf16_file_into_fp32_parameters_and_back",
    "missing_and_unexpected_names_are_reported_like_from_pretrained",
    "a_shape_mismatch_raises_on_every_rank",
    "trainer_finetune_exports_what_from_pretrained_reads_exactly",
]

results, test_case = case_tests("hf.py", 2, CASES)
