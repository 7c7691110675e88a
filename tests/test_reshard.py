"""A checkpoint saved on 2 ranks loads on 1, 3 and 4 ranks, into FULL_SHARD, SHARD_GRAD_OP (with activation
checkpointing), NO_SHARD and (on 4) HYBRID_SHARD layouts, from both the sharded and the full format, exactly."""

import pytest

from launch import launch


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("reshard")
    result = launch("reshard.py", 2, root / "save-results", LFSDP_RESHARD_DIR=str(root), LFSDP_RESHARD_MODE="save")
    result.check("save_on_two_ranks")
    return root


@pytest.mark.parametrize("world_size", [1, 3, 4])
def test_load_on_another_world_size(saved, world_size, tmp_path):
    result = launch(
        "reshard.py", world_size, tmp_path, LFSDP_RESHARD_DIR=str(saved), LFSDP_RESHARD_MODE="load"
    )
    details = result.check("load_into_every_layout")
    assert len(details[0]) == {1: 4, 3: 6, 4: 8}[world_size], details[0]
