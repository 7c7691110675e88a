"""The ``lightning-fsdp`` command on object storage (issue 38): ``inspect``, ``inspect --verify`` and ``convert`` from
a URL and to a URL, against the suite's S3 server (``tests/s3server.py``), in this process (``run_cli``).

The endpoint and credentials come from the environment (``AWS_ENDPOINT_URL``, ...), as on a cluster, or from
``--storage-option KEY=VALUE``. A checkpoint at a URL is the committed one (``checkpoint/io/remote.py``): what
``convert`` writes there is read back through its ``COMMIT`` object, and verified as a local one is.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load as load_safetensors

from inprocess import run_cli

pytestmark = pytest.mark.single_process

WEIGHTS = {"fc.weight": torch.arange(12.0).reshape(3, 4), "fc.bias": torch.tensor([1.0, -2.0, 3.0])}


@pytest.fixture()
def s3(s3_server, monkeypatch):
    s3_server.setenv(monkeypatch)
    return s3_server


@pytest.fixture()
def bare(tmp_path):
    torch.save(WEIGHTS, tmp_path / "bare.pt")
    return tmp_path / "bare.pt"


def one_line_error(run) -> str:
    assert run.stdout == "" and run.stderr.count("\n") == 1, run.stderr
    assert run.stderr.startswith("lightning-fsdp: error: ") and "HINT: " in run.stderr, run.stderr
    assert "Traceback" not in run.stderr
    return run.stderr


def weights_of(path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)["model"]


def test_sharded_and_full_round_trip_through_a_bucket_exactly(s3, bare, tmp_path):
    url = f"s3://{s3.bucket()}/run/step-1"
    run = run_cli(["convert", bare, url, "--to", "sharded"], cwd=tmp_path)
    assert run.returncode == 0 and url in run.stdout, run.stderr
    assert not (tmp_path / "s3:").exists(), "a local folder named 's3:' was written"
    assert "COMMIT" in [p.rsplit("/", 1)[-1] for p in s3.filesystem().ls(url)]

    shown = run_cli(["inspect", url, "--json", "--verify"], cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    info = json.loads(shown.stdout)
    assert (info["path"], info["format"], info["checksums"]) == (url, "sharded", "verified")
    assert info["models"]["model"]["parameters"] == 15

    full_url = f"{url}.pt"
    assert run_cli(["convert", url, full_url, "--to", "full"], cwd=tmp_path).returncode == 0
    assert run_cli(["inspect", full_url, "--verify"], cwd=tmp_path).returncode == 0
    back = run_cli(["convert", full_url, tmp_path / "back", "--to", "sharded"], cwd=tmp_path)
    assert back.returncode == 0, back.stderr
    assert run_cli(["convert", tmp_path / "back", tmp_path / "back.pt", "--to", "full"]).returncode == 0
    for name, tensor in WEIGHTS.items():
        assert torch.equal(weights_of(tmp_path / "back.pt")[name], tensor), name


def test_inspect_verify_exits_1_for_a_flipped_byte_in_an_object(s3, bare, tmp_path):
    url = f"s3://{s3.bucket()}/run/step-2"
    assert run_cli(["convert", bare, url, "--to", "sharded"], cwd=tmp_path).returncode == 0
    fs = s3.filesystem()
    shard = next(p for p in fs.find(url) if p.endswith(".distcp"))
    data = bytearray(fs.cat_file(shard))
    data[len(data) // 2] ^= 0x01
    fs.pipe_file(shard, bytes(data))
    run = run_cli(["inspect", url, "--verify"], cwd=tmp_path)
    assert run.returncode == 1
    err = one_line_error(run)
    assert f"s3://{shard}" in err or url in err, err
    assert "lightning-fsdp-load-" not in err, f"the error names the temporary copy, not the URL: {err}"


def test_a_url_without_a_checkpoint_exits_2_naming_the_url(s3, tmp_path):
    url = f"s3://{s3.bucket()}/run/step-3"
    for argv in (["inspect", "--verify", url], ["convert", url, tmp_path / "o.pt", "--to", "full"]):
        run = run_cli(argv, cwd=tmp_path)
        assert run.returncode == 2, run.stderr
        err = one_line_error(run)
        assert repr(url) in err and "s3:/" + url[len("s3://"):] not in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_convert_to_an_existing_url_needs_overwrite_and_then_replaces_it(s3, bare, tmp_path):
    url = f"s3://{s3.bucket()}/run/step-4"
    assert run_cli(["convert", bare, url, "--to", "sharded"], cwd=tmp_path).returncode == 0
    commit = s3.filesystem().cat_file(f"{url}/COMMIT")
    again = run_cli(["convert", bare, url, "--to", "sharded"], cwd=tmp_path)
    assert again.returncode == 2 and "already exists" in one_line_error(again)
    assert s3.filesystem().cat_file(f"{url}/COMMIT") == commit
    assert run_cli(["convert", bare, url, "--to", "sharded", "--overwrite"], cwd=tmp_path).returncode == 0
    assert s3.filesystem().cat_file(f"{url}/COMMIT") != commit
    assert run_cli(["inspect", url, "--verify"], cwd=tmp_path).returncode == 0


def test_safetensors_export_to_a_url_is_plain_objects_hugging_face_reads(s3, bare, tmp_path):
    bucket = s3.bucket()
    one = run_cli(["convert", bare, f"s3://{bucket}/hf/w.safetensors", "--to", "safetensors"], cwd=tmp_path)
    assert one.returncode == 0, one.stderr
    got = load_safetensors(s3.filesystem().cat_file(f"{bucket}/hf/w.safetensors"))
    assert all(torch.equal(got[k], v) for k, v in WEIGHTS.items()) and set(got) == set(WEIGHTS)
    folder = run_cli(["convert", bare, f"s3://{bucket}/hf/dir", "--to", "safetensors"], cwd=tmp_path)
    assert folder.returncode == 0, folder.stderr
    assert s3.filesystem().ls(f"{bucket}/hf/dir") == [f"{bucket}/hf/dir/model.safetensors"]


def test_storage_options_on_the_command_line_reach_the_store(s3, bare, tmp_path, monkeypatch):
    url = f"s3://{s3.bucket()}/run/step-5"
    for key in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(key)
    options = ["--storage-option", f"endpoint_url={s3.endpoint}", "--storage-option", "key=testing",
               "--storage-option", "secret=testing"]
    run = run_cli(["convert", bare, url, "--to", "sharded", *options], cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert run_cli(["inspect", url, "--verify", *options], cwd=tmp_path).returncode == 0
    bad = run_cli(["inspect", url, "--storage-option", "endpoint_url"], cwd=tmp_path)
    assert bad.returncode == 2 and "--storage-option KEY=VALUE" in one_line_error(bad)


def test_a_missing_bucket_is_one_error_naming_it(s3, bare, tmp_path):
    """As a destination, a bucket that does not exist is a write that failed: status 1, as for a local DST whose
    directory cannot be written. As a source it is input that names nothing to read: status 2, as for a missing
    path (docs/reference/cli.md)."""
    url = "s3://no-such-bucket-cli/run/step-6"
    run = run_cli(["convert", bare, url, "--to", "sharded"], cwd=tmp_path)
    assert run.returncode == 1, run.stderr
    assert "no-such-bucket-cli" in one_line_error(run)
    assert not (tmp_path / "s3:").exists()
    read = run_cli(["inspect", url], cwd=tmp_path)
    assert read.returncode == 2, read.stderr
    assert "no-such-bucket-cli" in one_line_error(read)


def test_clean_removes_an_unfinished_saves_objects_and_keeps_the_committed_checkpoint(s3, bare, tmp_path):
    url = f"s3://{s3.bucket()}/run/step-7"
    assert run_cli(["convert", bare, url, "--to", "sharded"], cwd=tmp_path).returncode == 0
    fs = s3.filesystem()
    fs.pipe_file(f"{url}/.0123456789abcdef/__0_0.distcp", b"half an upload")  # a save killed before its commit
    run = run_cli(["clean", url, "--grace", "0"], cwd=tmp_path)  # the default keeps a token this young
    assert run.returncode == 0 and f"{url}/.0123456789abcdef" in run.stdout, run.stderr
    assert not s3.filesystem().exists(f"{url}/.0123456789abcdef/__0_0.distcp")
    assert run_cli(["inspect", url, "--verify"], cwd=tmp_path).returncode == 0
    local = run_cli(["clean", tmp_path], cwd=tmp_path)
    assert local.returncode == 2 and "takes a checkpoint URL" in one_line_error(local)


def test_a_flipped_byte_in_an_object_too_large_for_a_commit_digest_names_the_url(s3, tmp_path):
    # Objects of 4 MiB and more have only their size in COMMIT: the checkpoint's own checksums find the damage, on
    # the local copy, and the error must still name the URL.
    torch.save({"big": torch.zeros(1_100_000)}, tmp_path / "big.pt")
    url = f"s3://{s3.bucket()}/run/step-8"
    assert run_cli(["convert", tmp_path / "big.pt", url, "--to", "sharded"], cwd=tmp_path).returncode == 0
    fs = s3.filesystem()
    shard = max((p for p in fs.find(url)), key=lambda p: fs.size(p))
    data = bytearray(fs.cat_file(shard))
    data[len(data) // 2] ^= 0x01
    fs.pipe_file(shard, bytes(data))
    run = run_cli(["inspect", url, "--verify"], cwd=tmp_path)
    assert run.returncode == 1
    err = one_line_error(run)
    assert url in err and "lightning-fsdp-load-" not in err, err
