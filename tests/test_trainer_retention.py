"""Trainer retention (``ModelCheckpoint(save_top_k=...)``) with background saves never deletes before the commit, and
leaves exactly ``save_top_k`` once every save is committed, in both save modes."""

from launch import case_tests

results, test_case = case_tests("trainer_retention.py", 2, ["save_top_k_waits_for_the_commit",
                                                             "save_top_k_leaves_exactly_k_in_both_save_modes"])
