"""Follow-ups on the streaming load and ``latest`` of a bucket (issue 43), in this process against the ledger's S3
server (``tests/ledger.py``: bytes counted per access key, at the server):

- an object shorter than its COMMIT records is damage (a ``ChecksumError`` naming the object with its real size),
  never retried as a store outage, so ``latest`` falls back past a truncated newest;
- a load whose verified items cover the whole checkpoint marks it trusted, so retention does not read it again;
- ``StepCheckpoints.resume`` from a bucket moves the newest good checkpoint once.

The loads need a process group of one rank in this process (a 1-rank gloo group on a ``HashStore``), created and
destroyed per test, as in ``test_streaming_latest``.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from inprocess import run_cli
from one_rank import one_rank_group

pytestmark = pytest.mark.single_process

LOADER = {"key": "loader", "secret": "testing"}  # the load signs with its own key: the ledger counts its bytes apart


@pytest.fixture()
def bucket(ledger, monkeypatch):
    from lightning_fsdp.checkpoint import latest

    for key, value in ledger.env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(latest, "_KNOWN", {})  # nothing learnt about any checkpoint yet in this process
    return ledger.bucket()


@pytest.fixture()
def one_rank():
    with one_rank_group():
        yield


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(256, 128)


def _save(tmp_path, url: str, value: float) -> None:
    """A sharded checkpoint at ``url`` holding ``{"model": ...}`` filled with ``value`` (committed as a save does)."""
    source = tmp_path / f"w{value:g}.pt"
    torch.save({"fc.weight": torch.full((128, 256), value), "fc.bias": torch.full((128,), value)}, source)
    run = run_cli(["convert", source, url, "--to", "sharded"], cwd=tmp_path)
    assert run.returncode == 0, run.stderr


def _objects(ledger, url: str) -> tuple[str, int]:
    """The token prefix (``bucket/key/.<token>``) of the checkpoint at ``url`` and its objects' total size."""
    fs = ledger.filesystem(key="setup")
    path = url.removeprefix("s3://")
    record = json.loads(fs.cat_file(f"{path}/COMMIT"))
    return f"{path}/.{record['token']}", sum(size for size, _ in record["objects"].values())


def _load(url: str) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    from lightning_fsdp.checkpoint.io.one_process import OneProcess
    from lightning_fsdp.checkpoint.load import load_checkpoint

    model = fully_shard(_Model())
    load_checkpoint(url, {"model": model}, comm=OneProcess(), storage_options=LOADER)
    return model


def _value(model: torch.nn.Module) -> set[float]:
    return set(model.fc.weight.full_tensor().unique().tolist()) | set(model.fc.bias.full_tensor().unique().tolist())


def test_latest_falls_back_past_a_newest_whose_shard_object_was_cut_short(ledger, bucket, one_rank, tmp_path,
                                                                          monkeypatch):
    """The newest's shard object replaced by its first bytes (same key): a ranged GET of an item past the cut gets a
    shorter body (206) or a 416. That is damage, said with the object's real size and never retried, so `latest`
    warns naming the newest and loads the one before it (before: a transient ConnectionError, retried to the bound)."""
    from lightning_fsdp.checkpoint.io import remote_errors

    monkeypatch.setattr(remote_errors, "ATTEMPTS", 3)  # a retried outage fails fast (and is no fall-back)
    monkeypatch.setattr(remote_errors, "BACKOFF_S", 0.0)
    directory = f"s3://{bucket}/run"
    _save(tmp_path, f"{directory}/step-00000001", 1.0)
    _save(tmp_path, f"{directory}/step-00000002", 2.0)
    newest, _ = _objects(ledger, f"{directory}/step-00000002")
    fs = ledger.filesystem(key="setup")
    shard = f"{newest}/__0_0.distcp"
    size = fs.size(shard)
    fs.pipe_file(shard, fs.cat_file(shard, end=size // 2))  # the weight's bytes end past the cut
    ledger.reset()
    with pytest.warns(UserWarning, match=rf"Skipping the checkpoint '{directory}/step-00000002': it fails"
                                         rf" verification \(ChecksumError: .*__0_0.distcp' is damaged: it has"
                                         rf" {size // 2} bytes, its commit records {size}"):
        model = _load(f"{directory}/latest")
    assert _value(model) == {1.0}
    # Damage is not retried: each range of the cut object was asked for once.
    gets = ledger.records("loader", match=f"GET {shard}")
    assert len(gets) == len({r.range for r in gets}), [r.range for r in gets]


def test_a_load_that_verified_every_item_spares_retention_a_second_read(ledger, bucket, one_rank, tmp_path,
                                                                         monkeypatch):
    """A load of a URL checks every item it reads; when its reads cover every item checksums.json lists, the
    checkpoint is trusted in this process, and retention's check of it (and `latest`'s search) reads no shard object
    again (before: retention streamed the whole checkpoint once more)."""
    from lightning_fsdp.checkpoint import latest
    from lightning_fsdp.checkpoint.retention import prune

    directory = f"s3://{bucket}/run"
    _save(tmp_path, f"{directory}/step-00000001", 1.0)
    _save(tmp_path, f"{directory}/step-00000002", 2.0)
    newest, _ = _objects(ledger, f"{directory}/step-00000002")
    monkeypatch.setattr(latest, "_KNOWN", {})  # what the saves' commits taught this process is forgotten
    assert _value(_load(f"{directory}/step-00000002")) == {2.0}
    ledger.reset()
    assert prune(directory, keep_last=1, storage_options=LOADER) == [f"{directory}/step-00000001"]
    assert latest.newest_good_checkpoint(directory, LOADER) == f"{directory}/step-00000002"
    shard_gets = ledger.records("loader", match=f"GET {newest}/__0_0.distcp")
    assert shard_gets == [], [r.range for r in shard_gets]


def test_a_load_that_did_not_read_every_item_leaves_the_checkpoint_to_be_verified(ledger, bucket, one_rank, tmp_path,
                                                                                   monkeypatch):
    """A load of part of the state (the model alone, from a checkpoint that also holds other tensors) verified only
    what it read: retention still reads the rest before it counts the checkpoint as good."""
    from torch.distributed.fsdp import fully_shard

    from lightning_fsdp.checkpoint import latest
    from lightning_fsdp.checkpoint.io.one_process import OneProcess
    from lightning_fsdp.checkpoint.load import load_checkpoint

    url = f"s3://{bucket}/run/step-00000001"
    source = tmp_path / "two.pt"
    torch.save({"model": {"fc.weight": torch.ones(128, 256), "fc.bias": torch.ones(128)},
                "other": {"w": torch.ones(64)}}, source)
    assert run_cli(["convert", source, url, "--to", "sharded"], cwd=tmp_path).returncode == 0
    prefix, _ = _objects(ledger, url)
    monkeypatch.setattr(latest, "_KNOWN", {})
    model = fully_shard(_Model())
    load_checkpoint(url, {"model": model}, strict=False, comm=OneProcess(), storage_options=LOADER)
    assert _value(model) == {1.0}
    ledger.reset()
    assert latest.verification_failure(url, LOADER) is None
    assert ledger.records("loader", match=f"GET {prefix}/__0_0.distcp")  # read: it was not trusted unread


class _Fabric:
    """What `StepCheckpoints` asks of a Fabric, for one process: its strategy's communicator and storage options, and
    `load` (the strategy's: `load_checkpoint`)."""

    class strategy:  # noqa: N801 - read as `fabric.strategy`
        from lightning_fsdp.checkpoint.io.one_process import OneProcess

        communicator = OneProcess()

        @staticmethod
        def _storage_options(_):
            return LOADER

    @staticmethod
    def load(path, state, strict=True):
        from lightning_fsdp.checkpoint.load import load_checkpoint

        return load_checkpoint(path, state, strict=strict, comm=_Fabric.strategy.communicator,
                               storage_options=LOADER)


def test_resume_from_a_bucket_moves_the_newest_once_and_falls_back_past_damage(ledger, bucket, one_rank, tmp_path):
    """`StepCheckpoints.resume` of a bucket loads the newest at once, verifying as it reads (before: it streamed the
    newest to verify it, then loaded it: 2x); a damaged newest is warned about by name and the one before it loaded."""
    from torch.distributed.fsdp import fully_shard

    from lightning_fsdp.step_checkpoints import StepCheckpoints

    directory = f"s3://{bucket}/run"
    _save(tmp_path, f"{directory}/step-00000001", 1.0)
    _save(tmp_path, f"{directory}/step-00000002", 2.0)
    newest, size = _objects(ledger, f"{directory}/step-00000002")
    older, older_size = _objects(ledger, f"{directory}/step-00000001")
    ledger.reset()
    model = fully_shard(_Model())
    assert StepCheckpoints(_Fabric, directory).resume({"model": model}) == f"{directory}/step-00000002"
    assert _value(model) == {2.0}
    read = ledger.bytes_out("loader", prefix=newest)
    assert read <= 1.1 * size, (read, size)
    assert ledger.bytes_out("loader", prefix=older) == 0

    fs = ledger.filesystem(key="setup")
    shard = f"{newest}/__0_0.distcp"
    data = bytearray(fs.cat_file(shard))
    data[len(data) // 2] ^= 0x01
    fs.pipe_file(shard, bytes(data))
    ledger.reset()
    model = fully_shard(_Model())
    with pytest.warns(UserWarning, match=rf"Skipping the checkpoint '{directory}/step-00000002': it fails"):
        assert StepCheckpoints(_Fabric, directory).resume({"model": model}) == f"{directory}/step-00000001"
    assert _value(model) == {1.0}
    moved = ledger.bytes_out("loader", prefix=newest) + ledger.bytes_out("loader", prefix=older)
    assert moved <= 1.1 * (size + older_size), (moved, size, older_size)
