"""After setup, no rank keeps the whole model it built before sharding: the original parameters are freed and live
host memory grows by this rank's share only (see ``workers/held_memory.py``)."""

from launch import case_tests

CASES = [
    "fabric_joint_setup_with_an_optimizer_built_before",
    "fabric_setup_module_then_an_optimizer_of_the_shards",
    "fabric_setup_module_then_setup_optimizers_of_one_built_before",
    "fabric_cpu_offload",
    "fabric_shard_grad_op",
    "hugging_face_llama_with_tied_embeddings",
    "trainer_with_the_model_built_in_init",
]

# A launch of its own: each case counts the live tensors of its process. In the forked 2-rank pool, that count once
# found a whole model still alive after the pool's earlier scripts had run in the same process (not understood; with
# real ranks, and alone, forked, it never did). Each case measures growth from its own start. Started in the
# background with the pools (``alone=True``), not on the main process's path.
results, test_case = case_tests("held_memory.py", 2, CASES, alone=True)
