"""Trainer retention (``ModelCheckpoint(save_top_k=1)``) with background saves never deletes before the commit."""

from launch import case_tests

results, test_case = case_tests("trainer_retention.py", 2, ["save_top_k_waits_for_the_commit"])
