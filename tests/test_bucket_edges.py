"""Edges a second review of issues 45 and 42 found, each a test that failed on the code before its fix:

- a safetensors export's clean-up deleted by pattern (a crafted index naming `*.safetensors`, a URL like `exp[1]`);
- a local checkpoint with a shard missing stopped `latest` as a store outage, instead of being skipped as damage;
- a bad `LFSDP_STORE_TIMEOUT_S` (and the store errors that are no ``OSError``) gave a traceback from the command line;
- a COMMIT written by a newer release was taken for damage, so retention deleted that release's checkpoints;
- a removal that raced a save to the same URL deleted the COMMIT the save had just written.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from inprocess import run_cli

pytestmark = pytest.mark.single_process


@pytest.fixture()
def s3(s3_server, monkeypatch):
    s3_server.setenv(monkeypatch)
    return s3_server


def test_an_exports_clean_up_deletes_exact_names_never_a_pattern(s3):
    from lightning_fsdp.checkpoint.convert import _previous_export, _remove

    fs = s3.filesystem()
    bucket = s3.bucket()
    for name in ("exp1/hf/model.safetensors", "exp1/hf/other.safetensors", "exp[1]/hf/model.safetensors"):
        fs.pipe_file(f"{bucket}/{name}", b"x")
    crafted = {"weight_map": {"a": "*.safetensors", "b": "model-00001-of-00002-0123abcd.safetensors", "c": "../x"}}
    fs.pipe_file(f"{bucket}/exp1/hf/model.safetensors.index.json", json.dumps(crafted).encode())
    previous = _previous_export(fs, f"s3://{bucket}/exp1/hf")
    assert previous == {"model.safetensors", "model.safetensors.index.json", "model-00001-of-00002-0123abcd.safetensors"}
    _remove(fs, [f"s3://{bucket}/exp[1]/hf/model.safetensors"])
    assert sorted(fs.find(bucket)) == [f"{bucket}/exp1/hf/{n}" for n in
                                       ("model.safetensors", "model.safetensors.index.json", "other.safetensors")]


def _save_local(directory, step):
    from lightning_fsdp.checkpoint.io.one_process import OneProcess
    from lightning_fsdp.checkpoint.save import write_sharded

    path = directory / f"step-{step:08d}"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP "assumes" one process: that is the intent here
        write_sharded(path, {"model": {"w": torch.full((8,), float(step))}}, {"step": step}, OneProcess())
    return path


def test_a_local_checkpoint_missing_a_shard_is_damage_that_latest_skips(tmp_path):
    from lightning_fsdp.checkpoint.latest import newest_good_checkpoint
    from lightning_fsdp.checkpoint.retention import to_delete

    first, second = _save_local(tmp_path, 1), _save_local(tmp_path, 2)
    next(second.glob("*.distcp")).unlink()
    with pytest.warns(UserWarning, match="fails verification"):
        assert newest_good_checkpoint(tmp_path) == first
    assert to_delete(tmp_path, keep_last=1) == []  # the damaged newer one is kept to look at; the good one too


def test_a_bad_store_timeout_setting_is_one_line_with_exit_2(tmp_path, monkeypatch):
    monkeypatch.setenv("LFSDP_STORE_TIMEOUT_S", "abc")
    shown = run_cli(["inspect", "--verify", "memory://nothing/step-1"], cwd=tmp_path)
    assert shown.returncode == 2, shown.stderr
    assert shown.stderr.count("\n") == 1 and "LFSDP_STORE_TIMEOUT_S" in shown.stderr and "HINT" in shown.stderr


def test_a_newer_releases_commit_is_neither_damage_nor_deleted(s3):
    from lightning_fsdp.checkpoint.formats.commit_order import next_commit_order
    from lightning_fsdp.checkpoint.formats.commit_record import build_record, encode_record
    from lightning_fsdp.checkpoint.integrity.agreement import CheckpointError
    from lightning_fsdp.checkpoint.integrity.digests import ChecksumError
    from lightning_fsdp.checkpoint.io.store import store_for
    from lightning_fsdp.checkpoint.retention import prune

    fs = s3.filesystem()
    directory = f"s3://{s3.bucket()}/run"
    record = {**build_record("0123456789ab", "sharded", "step-00000009", {"a": [1, None]}, next_commit_order()),
              "version": 99}
    fs.pipe_file(f"{directory}/step-00000009/COMMIT", encode_record(record))
    with pytest.raises(CheckpointError, match="HINT") as caught:
        prune(directory, keep_last=1)
    assert not isinstance(caught.value, ChecksumError), caught.value
    with pytest.raises(CheckpointError):
        store_for(directory).remove(f"{directory}/step-00000009")
    assert fs.exists(f"{directory}/step-00000009/COMMIT")


def test_a_removal_that_races_a_save_to_the_same_url_keeps_the_save(s3, monkeypatch):
    from test_commit_clock import _save

    from lightning_fsdp.checkpoint.io.store import store_for

    directory = f"s3://{s3.bucket()}/run"
    url = _save(directory, 1, True)
    store = store_for(url)
    read = store.read_commit
    fs = s3.filesystem()

    def a_save_commits_meanwhile(target):
        found = read(target)
        monkeypatch.setattr(store, "read_commit", read)
        fs.pipe_file(f"{url}/COMMIT", fs.cat_file(f"{url}/COMMIT").replace(b'"time"', b'"time" ', 1))
        return found

    monkeypatch.setattr(store, "read_commit", a_save_commits_meanwhile)
    with pytest.raises(FileExistsError, match="changed after"):
        store.remove(url)
    assert fs.exists(f"{url}/COMMIT")
