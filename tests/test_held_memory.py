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

# Pooled: each case measures growth from its own start, so what earlier cases of the pool left alive cancels out.
# Real ranks: with ranks forked from a warm server (whose imported objects are frozen out of the collector's reach),
# the count of live tensors once found a whole model still alive after the pool's earlier scripts had run; real
# ranks never did (CONTRIBUTING.md, "Forked or real processes").
results, test_case = case_tests("held_memory.py", 2, CASES, real_ranks=True)
