"""Review of issue 43's streaming load (defects 3 and 5), in this process against the ledger's S3 server
(``tests/ledger.py``: every request recorded per access key, faults injected):

- a sharded COMMIT is held to what a save writes (``.metadata``, ``checksums.json``, ``meta.pt`` and ``*.distcp``
  shard files, each small object within ``remote_download.MAX_SMALL_BYTES``): anything else is damage, raised before
  any of it is fetched, so a crafted COMMIT cannot make every load pull an object of any size;
- the requests of one load share one retry budget (``LFSDP_STORE_TIMEOUT_S``), the ranged GETs on the pool threads
  too, and time that several of them failed through together counts once.
"""

from __future__ import annotations

import threading
import uuid

import fsspec
import pytest
import torch

from inprocess import run_cli
from lightning_fsdp.checkpoint.io import ranged_read, remote_errors
from lightning_fsdp.checkpoint.io.remote_source import RemoteObjects
from one_rank import one_rank_group

LOADER = {"key": "loader", "secret": "testing"}  # the load signs with its own key: the ledger counts it apart


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


def _model(value: float = 0.0) -> torch.nn.Module:
    model = torch.nn.Module()
    for i in range(4):
        model.register_parameter(f"w{i}", torch.nn.Parameter(torch.full((64, 1024), value + i)))
    return model


def _save(tmp_path, url: str, value: float) -> None:
    """A sharded checkpoint at ``url`` of :func:`_model` (four 256 KiB weights), committed as a save commits."""
    source = tmp_path / f"w{value:g}.pt"
    torch.save({name: p.detach() for name, p in _model(value).named_parameters()}, source)
    run = run_cli(["convert", source, url, "--to", "sharded"], cwd=tmp_path)
    assert run.returncode == 0, run.stderr


def _load(url: str) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    from lightning_fsdp.checkpoint.io.one_process import OneProcess
    from lightning_fsdp.checkpoint.load import load_checkpoint

    model = fully_shard(_model())
    load_checkpoint(url, {"model": model}, comm=OneProcess(), storage_options=LOADER)
    return model


def _recommit(ledger, url: str, change) -> str:
    """COMMIT of ``url`` re-encoded (a valid digest) after ``change(objects)``; returns ``bucket/key/.<token>``."""
    from lightning_fsdp.checkpoint.formats.commit_record import encode_record, parse_record

    fs = ledger.filesystem(key="setup")
    path = url.removeprefix("s3://")
    record = parse_record(fs.cat_file(f"{path}/COMMIT"), url)
    change(fs, f"{path}/.{record['token']}", record["objects"])
    fs.pipe_file(f"{path}/COMMIT", encode_record(record))
    return f"{path}/.{record['token']}"


def _extra_object(fs, prefix: str, objects: dict) -> None:
    fs.pipe_file(f"{prefix}/extra.bin", b"\0" * 4096)  # stands for a 50 GB one: its size is never asked for
    objects["extra.bin"] = [4096, None]


def _huge_metadata(fs, prefix: str, objects: dict) -> None:
    objects[".metadata"] = [5 * 2**30, None]  # a COMMIT may record up to 2**45 bytes per object


@pytest.mark.single_process
@pytest.mark.parametrize("change, named", [(_extra_object, r"names 'extra\.bin', which no save writes"),
                                           (_huge_metadata, r"gives '\.metadata' 5,368,709,120 bytes, more than")])
def test_a_sharded_commit_naming_what_no_save_writes_is_damage_fetched_from_nothing(ledger, bucket, one_rank,
                                                                                    tmp_path, change, named):
    # Before: every object not ending .distcp was fetched whole by rank 0 (`extra.bin` loaded fine, after a GET of
    # it), and `.metadata` was fetched at whatever size COMMIT gave (a 416 retried as a store outage here).
    from lightning_fsdp.checkpoint.integrity.digests import ChecksumError

    directory = f"s3://{bucket}/run"
    _save(tmp_path, f"{directory}/step-00000001", 1.0)
    _save(tmp_path, f"{directory}/step-00000002", 2.0)
    prefix = _recommit(ledger, f"{directory}/step-00000002", change)
    ledger.reset()
    with pytest.raises(ChecksumError, match=rf"step-00000002/COMMIT' is damaged: it {named}.*HINT"):
        _load(f"{directory}/step-00000002")
    assert ledger.records("loader", prefix=prefix) == []  # nothing of that save was fetched, not even .metadata
    # Verification (retention, `inspect --verify`) refuses it alike, reading nothing of it either.
    from lightning_fsdp.checkpoint.io.store import store_for

    with pytest.raises(ChecksumError, match=rf"step-00000002/COMMIT' is damaged: it {named}"):
        store_for(f"{directory}/step-00000002", LOADER).verify(f"{directory}/step-00000002")
    assert ledger.records("loader", prefix=prefix) == []
    # Every rank says it alike (`together`), as damage: `latest` falls back to the checkpoint before it.
    with pytest.warns(UserWarning, match=r"Skipping the checkpoint .*step-00000002.*COMMIT' is damaged"):
        assert _load(f"{directory}/latest").w0.full_tensor().unique().tolist() == [1.0]


def test_ranged_gets_share_the_callers_budget():
    # Before: the GETs ran on pool threads without the caller's context, so each got a fresh budget of the bound.
    fs = fsspec.filesystem("memory")
    target = f"memory://review-{uuid.uuid4().hex[:8]}/ck"
    fs.pipe_file(f"{target}/.tok/__0_0.distcp", b"x" * 4096)
    seen = []

    def retry(step):
        return remote_errors.retrying(fs, target, "downloading",
                                      lambda: (seen.append(remote_errors._SHARED.get()), step())[1])

    source = RemoteObjects(fs, target, f"{target}/.tok", "sharded", {"__0_0.distcp": (4096, None)}, retry=retry)
    with remote_errors.one_budget():
        outer = remote_errors._SHARED.get()
        ranged_read.fetch(source, [("__0_0.distcp", 0, 2048, lambda v: None),
                                   ("__0_0.distcp", 3000, 4096, lambda v: None)], range_size=1024, ranges_in_flight=2)
    assert outer is not None and len(seen) >= 3
    assert all(budget is outer for budget in seen), seen


def test_failed_time_of_several_threads_at_once_is_spent_once():
    # Shared by a load's pool threads, the budget counts the time they failed through together once: eight threads
    # failing through the same two seconds spend two, not sixteen (which would end the load 8x early).
    budget = remote_errors._Budget()
    threads = [threading.Thread(target=budget.spend, args=(10.0, 12.0)) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    budget.spend(11.0, 13.0)
    assert budget.spent == pytest.approx(3.0)


@pytest.mark.single_process
def test_a_load_whose_every_ranged_get_keeps_failing_ends_within_one_bound(ledger, bucket, one_rank, tmp_path,
                                                                           monkeypatch):
    """A store that answers each ranged GET only at its third attempt (two 503s first): each request alone stays
    within the bound, so before, every request retried within a bound of its own and the load went on for as long as
    the ranges took (it loaded, after 8 x 3 GETs). One budget for the load: the retry error within the bound, after
    a bounded number of GETs."""
    from lightning_fsdp.checkpoint.io import transfers

    url = f"s3://{bucket}/run/ck"
    _save(tmp_path, url, 1.0)
    monkeypatch.setenv(remote_errors.TIMEOUT_VARIABLE, "2")  # requests get 1 s; retries end 1 s into an outage
    # 8 ranges of 128 KiB (the 1 MiB shard), 2 in flight (set directly: below the argument's 1 MiB minimum)
    monkeypatch.setattr(transfers, "_current", transfers.Transfers(ranges_in_flight=2, range_size=128 * 2**10))
    attempts: dict = {}
    lock = threading.Lock()

    def first_two_of_each_range(record) -> bool:
        if record.method != "GET" or not record.key.endswith(".distcp"):
            return False
        with lock:
            attempts[record.range] = attempts.get(record.range, 0) + 1
            return attempts[record.range] <= 2

    ledger.reset()
    ledger.fail(first_two_of_each_range, times=None)
    with pytest.raises(ConnectionError, match=r"failed while downloading it, after \d+ attempts in .* at most 2 s"):
        _load(url)
    gets = ledger.records("loader", match="GET */*.distcp")
    # The budget (1 s of backoff and failed requests, counted once across the 2 threads) ends within 3 rounds of 2
    # ranges x 3 attempts: at most 18 GETs, where answering every range took 24.
    assert 0 < len(gets) <= 18, sorted(attempts.items())
