"""The patterns around the step under tensor parallelism inside FSDP (4 ranks, (shard=2, tp=2)): grad-free forwards
before the step, an EMA teacher, Lightning's EMAWeightAveraging, and a LightningCLI run of
``configs/fsdp_tp_cpu.yaml``, each against one process (see ``workers/tp_patterns.py``)."""

from launch import case_tests

CASES = [
    "forwards_without_backward_before_the_step_match_one_process",
    "ema_teacher_updated_in_place_matches_one_process",
    "ema_weight_averaging_on_the_trainer_matches_one_process",
    "yaml_config_trains_like_the_python_front_and_one_process",
]

results, test_case = case_tests("tp_patterns.py", 4, CASES)
