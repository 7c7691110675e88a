"""Full state dicts into a hybrid-sharded model (``workers/full_state_load_hybrid.py``, 4 ranks, one launch)."""

from __future__ import annotations

from launch import case_tests

CASES = ["hybrid_load_state_dict_of_a_full_dict", "hybrid_load_raw_through_a_renaming_module"]


results, test_case = case_tests("full_state_load_hybrid.py", 4, CASES)
