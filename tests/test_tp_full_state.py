"""Full checkpoints under tensor parallelism (issue 37, item 2; ``workers/tp_full_state.py``, in the 4-rank pool):
``local_shard`` cuts every placement list of a tensor-parallel parameter (``_StridedShard`` included) as DTensor lays
it out, a full save with optimizer round-trips on (shard=2, tp=2) and (shard=1, tp=4), and the Trainer resumes under
TP from its default, full, checkpoint."""

from launch import case_tests

CASES = [
    "local_shard_cuts_every_tensor_parallel_placement_as_dtensor_does",
    "full_checkpoint_with_optimizer_round_trips_on_2x2_and_1x4",
    "trainer_resumes_under_tensor_parallel_from_its_default_full_checkpoint",
]

results, test_case = case_tests("tp_full_state.py", 4, CASES)
