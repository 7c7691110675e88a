"""Trainer retention (``ModelCheckpoint(save_top_k=...)``) with background saves never deletes before the commit, and
leaves exactly ``save_top_k`` once every save is committed, in both save modes; ``ckpt_path="<dir>/latest"`` follows
the commit order after a rollback."""

from launch import case_tests

results, test_case = case_tests("trainer_retention.py", 2, ["save_top_k_waits_for_the_commit",
                                                             "save_top_k_leaves_exactly_k_in_both_save_modes",
                                                             "latest_after_a_rollback_is_the_save_the_run_went_on_from"])
