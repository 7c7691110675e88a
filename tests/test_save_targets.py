"""What a save does to the checkpoints already there (``workers/save_targets.py``, 2 ranks, one launch): a removal
waits for the background save that supersedes it (issue 21, item 8), and a save through a symbolic link replaces
the link, never what it points to (item 14)."""

from __future__ import annotations

from launch import case_tests

CASES = [
    "top_1_removal_waits_for_the_background_save_that_supersedes_it",
    "a_failed_background_save_keeps_the_checkpoint_it_was_to_supersede",
    "a_save_through_a_link_replaces_the_link_and_keeps_its_target",
    "a_failed_save_through_a_link_leaves_link_and_target_alone",
]


results, test_case = case_tests("save_targets.py", 2, CASES)
