"""Hybrid sharding on 4 CPU ranks: one launch with an explicit (2, 2) mesh, and two simulated nodes."""

import subprocess

import pytest

from launch import LAUNCH_TIMEOUT_S, Launch, free_port, pooled, torchrun, worker_env

CASES = [
    "hybrid_mesh_shape_and_placements",
    "parity_hybrid_shard",
    "parity_hybrid_shard_zero2",
    "parity_no_shard_four_ranks",
    "hybrid_accumulation_in_both_no_sync_modes",
    "meta_init_replicas_agree_and_shards_differ",
    "no_grad_forward_before_each_step_hybrid_zero2",
    "ranks_seeded_differently_start_from_rank0_hybrid",
]


one_node = pooled("hybrid.py", 4, name="one_node")  # one 4-rank launch with the other 4-rank scripts


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    """Two `torchrun --nnodes=2` launches on localhost, two processes each. Only the mesh and parity cases run:
    4 processes on this 2-core machine are slow."""
    out = tmp_path_factory.mktemp("two_nodes") / "hybrid"
    port = free_port()
    env = worker_env(out, LFSDP_NUM_NODES="2", LFSDP_TEST_ONLY="hybrid_mesh_shape_and_placements,parity_hybrid_shard")
    nodes = [
        subprocess.Popen(
            torchrun("hybrid.py", 2, nnodes=2, node_rank=rank, port=port),
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for rank in (0, 1)
    ]
    logs = [node.communicate(timeout=LAUNCH_TIMEOUT_S)[0] for node in nodes]
    # Both simulated nodes must exit 0: the worse of the two exit codes is the launch's.
    worst = max((node.returncode for node in nodes), key=lambda rc: rc != 0)
    return Launch(out=out, world_size=4, log="\n".join(logs), returncode=worst)


@pytest.mark.parametrize("name", CASES)
def test_one_node(one_node, name):
    one_node.check(name)


@pytest.mark.parametrize("name", ["hybrid_mesh_shape_and_placements", "parity_hybrid_shard"])
def test_two_simulated_nodes(two_nodes, name):
    two_nodes.check(name)
