"""Checkpoints that cannot run code and cannot lie (see ``workers/integrity.py``), one two-rank launch."""

from launch import case_tests

CASES = [
    "crafted_files_run_no_code_on_any_rank",
    "trainer_refuses_crafted_checkpoints_on_every_rank",
    "corruption_raises_on_every_rank_naming_file_and_tensor",
    "old_checkpoints_without_checksums_load_with_a_note",
    "async_saves_record_checksums",
    "crc32_checkpoints_still_verify",
    "cli_verifies_and_refuses_crafted_files",
]


results, test_case = case_tests("integrity.py", 2, CASES)
