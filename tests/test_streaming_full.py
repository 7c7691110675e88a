"""Full (one-file) checkpoints in a bucket (issue 43 item 3): the load reads the file on rank 0 alone, by byte ranges
(the other ranks fetch nothing), checks each record as it arrives and keeps nothing on local disk; the save streams
the file from memory into its object. Two ranks against the session's S3 server (moto), one launch of
``workers/streaming_full.py`` (its own: the server is a fixture, started after the pools)."""

from __future__ import annotations

import pytest

from launch import launch

CASES = [
    "a_full_load_from_a_bucket_reads_the_file_on_rank_0_alone_by_ranges_and_nothing_touches_local_disk",
    "a_flipped_byte_in_a_tensor_record_fails_the_load_on_every_rank_naming_the_url_and_the_tensor",
    "checkpoint_keys_of_a_full_checkpoint_in_a_bucket_read_its_index_alone",
]


@pytest.fixture(scope="module")
def results(s3_server, tmp_path_factory):
    env = {**s3_server.env, "LFSDP_TEST_BUCKET": s3_server.bucket()}
    return launch("streaming_full.py", 2, tmp_path_factory.mktemp("streaming_full"), **env)


@pytest.mark.parametrize("name", CASES)
def test_full_checkpoints_in_a_bucket(results, name):
    results.check(name)
