"""The Trainer front on 4 CPU ranks with a (replicate=2, shard=2) mesh (see ``workers/trainer_hybrid.py``)."""

from launch import case_tests

CASES = [
    "parity_hybrid_shard_2x2",
    "accumulation_skip_all_defers_every_collective",
    "accumulation_reduce_scatter_only_skips_only_the_all_reduce",
]


results, test_case = case_tests("trainer_hybrid.py", 4, CASES)
