"""Issue 43's byte targets at world 4 and 8 (its item 8 and its table), counted per rank by the ledger server
(``tests/ledger.py``) and checked inside the launches (``workers/streaming_scale.py``, which says how):

- a sharded save streams: rank r PUTs its own objects' bytes once, only rank 0 the small ones, and its TMPDIR holds
  at most 0.1x its shard;
- a sharded load, 4 -> 4, 8 -> 8, 8 -> 4 and 4 -> 8: per rank, GET bytes of ``.distcp`` objects <= 1.1x its share of
  tensor bytes, ranks != 0 read none of the small objects, TMPDIR <= 0.1x; the state loads exactly;
- a full (one-file) load: ranks != 0 download nothing of the file, rank 0 at most 1.02x it;
- ``latest``: over a damaged newest, the older one exactly, for C2's partial read plus 1.1x C1; <= 1.1x the newest
  when it is good;
- a byte flipped where one rank alone reads: ``ChecksumError`` on every rank naming the object and the tensor.

Three launches of their own, in order (first: world 4, wide: world 8, narrow: world 4): the S3 endpoint is this
session's ledger, which exists only once the tests run, so they cannot join a pool (pools start at collection).
"""

from __future__ import annotations

import pytest

from launch import launch

# Four and eight ranks keep both cores busy throughout (LFSDP_TEST_TIMELINE: 85-90 %); the whole file, since its
# launches are module fixtures that its tests share.
pytestmark = pytest.mark.fills_both_cores

FIRST = [
    "sharded_save_at_world_4_streams_each_rank_s_own_file",
    "sharded_load_4_to_4_reads_only_each_rank_s_share",
    "full_save_and_load_at_world_4_ranks_other_than_0_download_nothing",
]
WIDE = [
    "latest_over_a_damaged_newest_loads_the_one_before_for_its_partial_read_plus_1_1x",
    "sharded_save_at_world_8_streams_each_rank_s_own_file",
    "sharded_load_8_to_8_reads_only_each_rank_s_share",
    "sharded_load_4_to_8_reads_only_the_overlapping_ranges",
    "a_byte_flipped_where_only_rank_5_reads_fails_the_load_on_every_rank_naming_object_and_tensor",
]
NARROW = ["sharded_load_8_to_4_reads_only_each_rank_s_share", "latest_over_a_good_newest_loads_it_for_1_1x"]


@pytest.fixture(scope="module")
def scale(ledger_server, tmp_path_factory):
    root = tmp_path_factory.mktemp("streaming_scale")
    return root, {**ledger_server.env, "LFSDP_TEST_BUCKET": ledger_server.bucket(), "LFSDP_SCALE_DIR": str(root)}


def _launch(scale, phase: str, world: int):
    root, env = scale  # a fresh TMPDIR folder per launch (and per rank: the worker adds r<rank>)
    return launch("streaming_scale.py", world, root / phase, LFSDP_SCALE_PHASE=phase,
                  LFSDP_SCALE_TMP=str(root / phase / "tmp"), **env)


@pytest.fixture(scope="module")
def first(scale):
    return _launch(scale, "first", 4)


@pytest.fixture(scope="module")
def wide(scale, first):  # loads C4 and `run`, which `first` saved
    return _launch(scale, "wide", 8)


@pytest.fixture(scope="module")
def narrow(scale, wide):  # loads C8, which `wide` saved, and `fine`, which `first` saved
    return _launch(scale, "narrow", 4)


@pytest.mark.parametrize("name", FIRST)
def test_world_4(first, name):
    first.check(name)


@pytest.mark.parametrize("name", WIDE)
def test_world_8(wide, name):
    wide.check(name)


@pytest.mark.parametrize("name", NARROW)
def test_world_4_from_8(narrow, name):
    narrow.check(name)
