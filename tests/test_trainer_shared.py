"""Two-rank cases (see ``workers/trainer_shared.py``), in the 2-rank pool: a module or a parameter shared by two
top-level models of a LightningModule is refused at setup, naming it and the fix; the fix (one module holding both)
trains like one process and round-trips both checkpoint formats with the tie intact; Fabric trains the same models; a
tie that ``auto_wrap_policy`` would split between units is refused on both fronts (issue 37, item 5)."""

from launch import case_tests

CASES = [
    "a_submodule_shared_by_two_top_level_models_is_refused_naming_it",
    "a_parameter_tied_across_two_top_level_models_is_refused_naming_it",
    "the_fix_trains_a_shared_submodule_like_one_process_and_round_trips_both_formats",
    "the_fix_trains_a_tied_parameter_like_one_process_and_round_trips_both_formats",
    "fabric_trains_the_same_models_held_by_one_module",
    "a_tie_split_between_two_units_is_refused_on_both_fronts",
]

results, test_case = case_tests("trainer_shared.py", 2, CASES)
