"""Lightning's checkpoints load into our strategy, and Lightning's consolidation reads ours (see
``workers/interop.py``), two ranks, one launch for all cases."""

from launch import case_tests

CASES = [
    "fabric_model_parallel_sharded_checkpoint_loads",
    "fabric_model_parallel_full_checkpoint_loads",
    "trainer_model_parallel_sharded_checkpoint_loads",
    "trainer_model_parallel_full_checkpoint_loads",
    "fsdp1_fabric_full_layout_loads",
    "fsdp1_fabric_sharded_layout_loads",
    "fsdp1_trainer_full_layout_loads",
    "fsdp1_trainer_sharded_layout_loads",
    "torchs_fsdp1_trains_on_cpu_gloo",
    "consolidate_function_reads_our_sharded_checkpoint",
    "consolidate_command_reads_our_sharded_checkpoint",
]


results, test_case = case_tests("interop.py", 2, CASES)
