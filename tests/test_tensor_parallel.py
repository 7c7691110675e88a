"""Tensor parallelism inside FSDP on 4 ranks, (shard=2, tp=2): parity with one process on both fronts, the plan's
checks, the batches of tensor-parallel peers, clipping, and checkpoints across layouts (see
``workers/tensor_parallel.py``)."""

from launch import case_tests

CASES = [
    "fabric_gpt_with_an_explicit_plan_matches_one_process",
    "fabric_hugging_face_llama_with_its_own_plan_matches_one_process",
    "clipping_takes_the_norm_over_both_mesh_axes",
    "a_bad_plan_is_one_clear_error_before_any_weight_moves",
    "a_tensor_parallel_size_that_does_not_divide_the_world_is_refused",
    "sharded_checkpoints_load_across_dp_tp_layouts",
    "meta_device_init_splits_pieces_and_keeps_copies_equal",
    "activation_checkpointing_and_accumulation_without_sync_match_one_process",
    "bf16_mixed_precision_trains",
    "trainer_gpt_with_an_explicit_plan_matches_one_process_and_tp_peers_share_batches",
    "trainer_hugging_face_llama_with_its_own_plan_matches_one_process",
]

results, test_case = case_tests("tensor_parallel.py", 4, CASES)
