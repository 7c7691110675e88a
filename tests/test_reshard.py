"""A checkpoint saved on 2 ranks loads on 1, 3 and 4 ranks, into FULL_SHARD, SHARD_GRAD_OP (with activation
checkpointing), NO_SHARD and (on 4) HYBRID_SHARD layouts, from both the sharded and the full format, exactly.

The save and the 4-rank load run in the background with the launch pools, each a launch of its own (``launch.pooled``
with ``env_from``: the folder is the save's launch folder, known when its turn comes). The pools run one after another,
every 2-rank one before every 4-rank one, so the save has ended when the load starts. The 1- and 3-rank loads have no
pool of their size to join: they are launched by their tests, from the same folder."""

from pathlib import Path

import pytest

from launch import launch, pooled

# Where the save wrote, set by _save_env when the save's launch starts (in the pools' thread of this process).
_SAVED: dict[str, Path] = {}


def _save_env(out: Path) -> dict[str, str]:
    _SAVED["root"] = out / "reshard"
    _SAVED["root"].mkdir(parents=True, exist_ok=True)
    return {"LFSDP_RESHARD_DIR": str(_SAVED["root"])}


def _load_env(out: Path) -> dict[str, str]:
    if "root" not in _SAVED:
        raise RuntimeError("the 4-rank load started before the 2-rank save (the pools' order changed?)")
    return {"LFSDP_RESHARD_DIR": str(_SAVED["root"])}


save_launch = pooled("reshard.py", 2, name="save_launch", env_from=_save_env, LFSDP_RESHARD_MODE="save")
load_on_4 = pooled("reshard.py", 4, name="load_on_4", env_from=_load_env, LFSDP_RESHARD_MODE="load")


@pytest.fixture(scope="module")
def saved(save_launch):
    save_launch.check("save_on_two_ranks")
    return _SAVED["root"]


@pytest.mark.parametrize("world_size", [1, 3, 4])
def test_load_on_another_world_size(saved, load_on_4, world_size, tmp_path):
    if world_size == 4:
        result = load_on_4
    else:
        result = launch("reshard.py", world_size, tmp_path, LFSDP_RESHARD_DIR=str(saved), LFSDP_RESHARD_MODE="load")
    details = result.check("load_into_every_layout")
    assert len(details[0]) == {1: 4, 3: 6, 4: 8}[world_size], details[0]
