"""`latest` and verification of checkpoints in a bucket without a second download (issue 43 item 4), in this process
against the ledger's S3 server (``tests/ledger.py``: bytes counted per access key, at the server).

- ``<dir>/latest`` of a bucket is resolved from the COMMITs alone and the load verifies what it reads: the newest
  checkpoint's bytes move once, not twice (verify, then load).
- A damaged newest is found by the load, warned about by name, remembered, and the one committed before it is loaded
  instead, unless that one lacks entries the failed attempt may have written into the state.
- Verification of a URL (``inspect --verify``, retention) streams the objects: no local copy. The tests point
  ``tempfile`` at a folder that does not exist, so any local copy fails.

The loads need a process group of one rank in this process (a 1-rank gloo group on a ``HashStore``, as
``test_fuzz_readers`` does), created and destroyed per test.
"""

from __future__ import annotations

import tempfile
import warnings

import pytest
import torch

from inprocess import run_cli
from one_rank import one_rank_group

pytestmark = pytest.mark.single_process

LOADER = {"key": "loader", "secret": "testing"}  # the load signs with its own key: the ledger counts its bytes apart


@pytest.fixture()
def bucket(ledger, monkeypatch):
    for key, value in ledger.env.items():
        monkeypatch.setenv(key, value)
    return ledger.bucket()


@pytest.fixture()
def one_rank():
    with one_rank_group():
        yield


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(256, 128)


def _weights(value: float, bias: bool = True) -> dict:
    weights = {"fc.weight": torch.full((128, 256), value)}
    if bias:
        weights["fc.bias"] = torch.full((128,), value)
    return weights


def _save(tmp_path, url: str, value: float, bias: bool = True) -> None:
    """A sharded checkpoint at ``url`` holding ``{"model": _weights(value)}`` (the command line's convert commits it
    as a save does)."""
    source = tmp_path / f"w{value:g}{bias}.pt"
    torch.save(_weights(value, bias), source)
    run = run_cli(["convert", source, url, "--to", "sharded"], cwd=tmp_path)
    assert run.returncode == 0, run.stderr


def _objects(ledger, url: str) -> tuple[str, int]:
    """The token prefix (``bucket/key/.<token>``) of the checkpoint at ``url`` and its objects' total size."""
    import json

    fs = ledger.filesystem(key="setup")
    path = url.removeprefix("s3://")
    record = json.loads(fs.cat_file(f"{path}/COMMIT"))
    return f"{path}/.{record['token']}", sum(size for size, _ in record["objects"].values())


def _flip(ledger, url: str) -> None:
    """Flip one byte in the middle of the checkpoint's shard file (in a tensor's bytes)."""
    prefix, _ = _objects(ledger, url)
    fs = ledger.filesystem(key="setup")
    shard = next(p for p in fs.find(prefix) if p.endswith(".distcp"))
    data = bytearray(fs.cat_file(shard))
    data[len(data) // 2] ^= 0x01
    fs.pipe_file(shard, bytes(data))


def _load_latest(directory: str, strict: bool = True) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    from lightning_fsdp.checkpoint.io.one_process import OneProcess
    from lightning_fsdp.checkpoint.load import load_checkpoint

    model = fully_shard(_Model())
    load_checkpoint(f"{directory}/latest", {"model": model}, strict=strict, comm=OneProcess(), storage_options=LOADER)
    return model


def _value(model: torch.nn.Module) -> set[float]:
    return set(model.fc.weight.full_tensor().unique().tolist()) | set(model.fc.bias.full_tensor().unique().tolist())


def test_latest_of_a_bucket_moves_the_newest_checkpoint_once(ledger, bucket, one_rank, tmp_path):
    directory = f"s3://{bucket}/run"
    _save(tmp_path, f"{directory}/step-00000001", 1.0)
    _save(tmp_path, f"{directory}/step-00000002", 2.0)
    newest, size = _objects(ledger, f"{directory}/step-00000002")
    older, _ = _objects(ledger, f"{directory}/step-00000001")
    ledger.reset()
    assert _value(_load_latest(directory)) == {2.0}
    # Before issue 43: the newest was downloaded and verified, then downloaded again by the load (2.0x).
    read = ledger.bytes_out("loader", prefix=newest)
    assert read <= 1.1 * size, (read, size)
    assert ledger.bytes_out("loader", prefix=older) == 0
    assert ledger.bytes_out("loader") - read < 16 * 2**10  # listings and COMMITs


def test_a_damaged_newest_is_found_by_the_load_and_the_one_before_it_is_loaded(ledger, bucket, one_rank, tmp_path):
    from lightning_fsdp.checkpoint.latest import newest_good_checkpoint

    directory = f"s3://{bucket}/run"
    _save(tmp_path, f"{directory}/step-00000001", 1.0)
    _save(tmp_path, f"{directory}/step-00000002", 2.0)
    _flip(ledger, f"{directory}/step-00000002")
    damaged, damaged_size = _objects(ledger, f"{directory}/step-00000002")
    good, good_size = _objects(ledger, f"{directory}/step-00000001")
    ledger.reset()
    with pytest.warns(UserWarning, match=rf"Skipping the checkpoint '{directory}/step-00000002': it fails verification"):
        model = _load_latest(directory)
    assert _value(model) == {1.0}  # exactly the older checkpoint: the fallback overwrote what the failed attempt wrote
    # Each checkpoint moved at most once (before: the newest and the older one verified whole, then the older loaded).
    moved = ledger.bytes_out("loader", prefix=damaged) + ledger.bytes_out("loader", prefix=good)
    assert moved <= 1.1 * (damaged_size + good_size), (moved, damaged_size, good_size)
    # Remembered in this process: the next `latest` skips it, naming it, without reading it again...
    ledger.reset()
    with pytest.warns(UserWarning, match="step-00000002': it fails verification"):
        assert _value(_load_latest(directory)) == {1.0}
    assert ledger.bytes_out("loader", prefix=damaged) == 0
    # ...and so does the search that retention and `StepCheckpoints.resume` use.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert newest_good_checkpoint(directory, LOADER) == f"{directory}/step-00000001"


def test_no_fall_back_to_a_checkpoint_that_lacks_entries_the_failed_load_wrote(ledger, bucket, one_rank, tmp_path):
    from lightning_fsdp.checkpoint.integrity.digests import ChecksumError

    directory = f"s3://{bucket}/run"
    _save(tmp_path, f"{directory}/step-00000001", 1.0, bias=False)  # no `fc.bias`
    _save(tmp_path, f"{directory}/step-00000002", 2.0)
    _flip(ledger, f"{directory}/step-00000002")
    # A non-strict load of step 1 would leave the bias the damaged attempt wrote: refused, with the way out.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ChecksumError, match=r"step-00000002'.*lacks entries .*model\.fc\.bias.*HINT: load a"
                                                r" checkpoint by its path"):
            _load_latest(directory, strict=False)


def test_inspect_verify_of_a_url_streams_and_finds_a_flipped_byte(ledger, bucket, tmp_path, monkeypatch):
    url = f"s3://{bucket}/run/step-00000001"
    _save(tmp_path, url, 1.0)
    _flip(ledger, url)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "no-local-copies"))  # does not exist: a copy fails
    run = run_cli(["inspect", url, "--verify"], cwd=tmp_path)
    assert run.returncode == 1, run.stderr
    assert f"'{url}/__0_0.distcp' is corrupted: the bytes of the tensor 'model.fc" in run.stderr, run.stderr
    assert not (tmp_path / "no-local-copies").exists()


def test_retention_verifies_a_bucket_without_a_local_copy_and_stops_when_the_newest_cannot_be_read(
        ledger, bucket, tmp_path, monkeypatch):
    from lightning_fsdp.checkpoint import latest
    from lightning_fsdp.checkpoint.io import remote_errors
    from lightning_fsdp.checkpoint.retention import prune

    directory = f"s3://{bucket}/run"
    for step in (1, 2, 3):
        _save(tmp_path, f"{directory}/step-0000000{step}", float(step))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "no-local-copies"))
    monkeypatch.setattr(remote_errors, "BACKOFF_S", 0.0)
    monkeypatch.setattr(remote_errors, "ATTEMPTS", 2)
    monkeypatch.setattr(latest, "_KNOWN", {})  # nothing verified yet in this process
    # The newest cannot be read (its shard answers 503 every time): retention deletes nothing and says why.
    newest, _ = _objects(ledger, f"{directory}/step-00000003")
    ledger.fail(f"GET {newest}/__0_0.distcp", status=503, times=None)
    with pytest.raises(ConnectionError, match=r"step-00000003' failed while .*HINT"):
        prune(directory, keep_last=1, storage_options=LOADER)
    assert latest.step_checkpoints(directory, LOADER) == [f"{directory}/step-0000000{s}" for s in (1, 2, 3)]
    # Once it answers, the newest verifies (streamed: no local copy) and the two before it go.
    ledger.reset()
    assert prune(directory, keep_last=1, storage_options=LOADER) == [f"{directory}/step-0000000{s}" for s in (1, 2)]
    assert not (tmp_path / "no-local-copies").exists()


def test_verify_streams_windows_in_flight_and_fetches_a_failed_window_again_alone(ledger, bucket, tmp_path,
                                                                                   monkeypatch):
    """A shard of 2.5 windows: verified in windows of ``range_size`` with several in flight, and a window the store
    refuses once (503) is asked for again by itself: one request more, not the whole object again."""
    from lightning_fsdp.checkpoint.integrity.digests import ChecksumError
    from lightning_fsdp.checkpoint.io import remote_errors, transfers
    from lightning_fsdp.checkpoint.io.store import store_for

    url = f"s3://{bucket}/run/step-00000001"
    source = tmp_path / "big.pt"
    torch.save({"w": torch.arange(640 * 1024, dtype=torch.float32)}, source)  # 2.5 MiB
    assert run_cli(["convert", source, url, "--to", "sharded"], cwd=tmp_path).returncode == 0
    prefix, _ = _objects(ledger, url)
    shard = f"{prefix}/__0_0.distcp"
    size = ledger.filesystem(key="setup").size(shard)
    monkeypatch.setattr(remote_errors, "BACKOFF_S", 0.0)
    monkeypatch.setattr(transfers, "_current", transfers.check_transfers(range_size=2**20, ranges_in_flight=2))
    ledger.reset()
    ledger.fail(f"GET {shard}", status=503, nth=2)
    assert store_for(url, LOADER).verify(url) is True
    gets = ledger.records("loader", match=f"GET {shard}")
    ranges = sorted(r.range for r in gets)
    windows = ["bytes=0-1048575", "bytes=1048576-2097151", f"bytes=2097152-{size}"]  # the last asks one byte more
    assert len(gets) == 4 and sorted(set(ranges)) == windows, ranges  # ranges only, one of them twice
    assert ledger.bytes_out("loader", prefix=shard) <= size + 1024
    # Cut short below its last window's start (S3 answers that range with 416): damage with the object's real size,
    # not a store that could not be read.
    ledger.filesystem(key="setup").pipe_file(shard, ledger.filesystem(key="setup").cat_file(shard, end=1_500_000))
    with pytest.raises(ChecksumError, match=rf"__0_0.distcp' is damaged: it has 1500000 bytes, its commit records {size}"):
        store_for(url, LOADER).verify(url)
