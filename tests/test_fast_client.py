"""The ranged GETs of a load through obstore (``checkpoint/io/transport_download.py``, issue 43 item 6), in this
process against the ledger's S3 server (``tests/ledger.py``: every request recorded, faults injected): the same
requests and bytes as through s3fs, the same errors, our retries the only ones, and every setting obstore cannot
take from the user's s3fs filesystem keeps s3fs."""

from __future__ import annotations

import os
import uuid

import pytest

from lightning_fsdp.checkpoint.integrity.digests import ChecksumError
from lightning_fsdp.checkpoint.io import ranged_read, remote_errors, transport_download
from lightning_fsdp.checkpoint.io.remote_source import RemoteObjects

pytestmark = pytest.mark.single_process
KEY = "fastclient"  # the loads sign with their own key: the ledger counts them apart
NAME = "__0_0.distcp"
SIZE = 3 * 2**20 + 4321


@pytest.fixture()
def stored(ledger, monkeypatch):
    """An object of SIZE random bytes on the ledger's server, and a filesystem built as a store builds its own
    (client retries off, timeouts within the bound)."""
    import s3fs

    for key, value in ledger.env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", KEY)
    monkeypatch.delenv(transport_download.VARIABLE, raising=False)
    bucket, run = ledger.bucket(), f"run-{uuid.uuid4().hex[:8]}"
    target = f"s3://{bucket}/{run}/ck"
    data = os.urandom(SIZE)
    ledger.client(key="setup").put_object(Bucket=bucket, Key=f"{run}/ck/.tok/{NAME}", Body=data)
    fs = remote_errors.bounded_filesystem(s3fs.S3FileSystem, "s3", {})
    ledger.reset()
    return fs, target, data


def _source(fs, target: str, size: int = SIZE) -> RemoteObjects:
    return RemoteObjects(fs, target, f"{target}/.tok", "sharded", {NAME: (size, None)})


def _fetch(source: RemoteObjects, spans, **kwargs) -> dict:
    got: dict = {}
    needs = [(NAME, a, b, (lambda key: lambda view: got.__setitem__(key, bytes(view)))((a, b))) for a, b in spans]
    ranged_read.fetch(source, needs, **kwargs)
    return got


def _refused(*args, **kwargs):
    raise AssertionError("a ranged GET went through s3fs")


def _no_s3fs_gets(monkeypatch) -> None:
    monkeypatch.setattr(ranged_read._Fetcher, "_read_s3", _refused)


SPANS = [(0, 1000), (5000, 2**20), (2**20 + 100, 3 * 2**20), (SIZE - 10, SIZE)]


def test_ranged_gets_go_through_obstore_with_the_same_requests_and_bytes(stored, ledger, monkeypatch):
    import s3fs

    fs, target, data = stored
    with monkeypatch.context() as patch:
        _no_s3fs_gets(patch)  # before transport_download, every GET of an s3fs filesystem went through it
        got = _fetch(_source(fs, target), SPANS, range_size=2**20, ranges_in_flight=3)
    assert got == {(a, b): data[a:b] for a, b in SPANS}
    fast = ledger.records(KEY, method="GET")
    # The requests are the coalescing's, whichever client sends them: as many, the same ranges, the same bytes.
    ledger.reset()
    monkeypatch.setenv(transport_download.VARIABLE, "s3fs")

    plain = remote_errors.bounded_filesystem(s3fs.S3FileSystem, "s3", {})
    assert transport_download.client_for(plain) is None
    assert _fetch(_source(plain, target), SPANS, range_size=2**20, ranges_in_flight=3) == got
    slow = ledger.records(KEY, method="GET")
    assert sorted(r.range for r in fast) == sorted(r.range for r in slow) and len(fast) == 4
    assert sum(r.bytes_out for r in fast) == sum(r.bytes_out for r in slow)


def _errors_of(fs, target, spans, size=SIZE) -> BaseException:
    """The error of the fetch (its type is compared across both clients by the tests)."""
    try:
        _fetch(_source(fs, target, size), spans, range_size=2**20, ranges_in_flight=2)
    except (OSError, ChecksumError) as err:
        return err
    raise AssertionError("the fetch did not fail")


def _both(stored, ledger, monkeypatch, arrange, spans, size=SIZE):
    """The error of the same failing fetch through obstore and through s3fs (``arrange()`` sets the fault up)."""
    import s3fs

    fs, target, _ = stored
    out = []
    for client in ("obstore", "s3fs"):
        if client == "s3fs":
            monkeypatch.setenv(transport_download.VARIABLE, "s3fs")
            fs = remote_errors.bounded_filesystem(s3fs.S3FileSystem, "s3", {})
        else:
            assert transport_download.client_for(fs) is not None
        ledger.reset()
        arrange()
        out.append(_errors_of(fs, target, spans, size))
    return out


def test_a_missing_object_is_said_as_s3fs_says_it(stored, ledger, monkeypatch):
    fast, slow = _both(stored, ledger, monkeypatch, lambda: ledger.fail(f"GET */{NAME}", status=404, times=None),
                       [(0, 100)])
    assert type(fast) is type(slow) is FileNotFoundError
    assert "was not found while downloading it" in str(fast) and "HINT" in str(fast)


def test_a_refusal_is_said_with_the_credentials_hint(stored, ledger, monkeypatch):
    fast, slow = _both(stored, ledger, monkeypatch, lambda: ledger.fail(f"GET */{NAME}", status=403, times=None),
                       [(0, 100)])
    assert type(fast) is type(slow) is PermissionError
    assert "HINT: check the credentials" in str(fast) and "HINT: check the credentials" in str(slow)


def test_an_object_shorter_than_its_commit_is_damage_with_its_real_size(stored, ledger, monkeypatch):
    # COMMIT says 1 MiB more than the object holds: a range inside the real end is answered short (Content-Range
    # gives the size), a range past it with 416; both are damage naming the real size, never retried.
    for spans in ([(SIZE - 100, SIZE + 100)], [(SIZE + 10, SIZE + 2**19)]):
        fast, slow = _both(stored, ledger, monkeypatch, lambda: None, spans, size=SIZE + 2**20)
        monkeypatch.delenv(transport_download.VARIABLE)
        assert type(fast) is type(slow) is ChecksumError
        assert f"it has {SIZE} bytes, its commit records {SIZE + 2**20}" in str(fast)
        assert f"it has {SIZE} bytes" in str(slow)


def test_a_503_is_retried_by_us_alone_within_the_bound(stored, ledger, monkeypatch):
    fs, target, data = stored
    _no_s3fs_gets(monkeypatch)
    ledger.fail(f"GET */{NAME}", status=503, times=1)
    assert _fetch(_source(fs, target), [(0, 2**20)], range_size=2**20) == {(0, 2**20): data[:2**20]}
    assert len(ledger.records(KEY, method="GET")) == 2  # the 503, then our one retry
    # With our retries capped at one attempt, the 503 is the error: obstore retried nothing by itself (its default
    # is 10 retries within 3 minutes, which would stack on ours past LFSDP_STORE_TIMEOUT_S).
    ledger.reset()
    ledger.fail(f"GET */{NAME}", status=503, times=None)
    monkeypatch.setattr(remote_errors, "ATTEMPTS", 1)
    with pytest.raises(ConnectionError, match=r"failed while downloading it, after 1 attempts"):
        _fetch(_source(fs, target), [(0, 2**20)], range_size=2**20)
    assert len(ledger.records(KEY, method="GET")) == 1


def test_a_body_cut_off_resumes_from_the_byte_reached(stored, ledger, monkeypatch):
    fs, target, data = stored
    _no_s3fs_gets(monkeypatch)
    ledger.drop_connection(f"GET */{NAME}", after_bytes=1_500_000)
    assert _fetch(_source(fs, target), [(0, 3 * 2**20)], range_size=4 * 2**20) == {(0, 3 * 2**20): data[:3 * 2**20]}
    first, again = ledger.records(KEY, method="GET")
    assert first.range == f"bytes=0-{3 * 2**20 - 1}"
    resumed = int(again.range.split("=")[1].split("-")[0])
    assert 0 < resumed <= 1_500_000 and again.bytes_out == 3 * 2**20 - resumed


@pytest.mark.parametrize("options", [{"requester_pays": True}, {"version_aware": True},
                                     {"s3_additional_kwargs": {"SSECustomerKey": "k" * 32}},
                                     {"client_kwargs": {"verify": False}},
                                     {"config_kwargs": {"signature_version": "s3"}},
                                     {"config_kwargs": {"proxies": {"https": "http://127.0.0.1:9"}}}])
def test_a_setting_obstore_cannot_take_keeps_s3fs(stored, options):
    import s3fs

    fs = remote_errors.bounded_filesystem(s3fs.S3FileSystem, "s3", options)
    assert transport_download.client_for(fs) is None


@pytest.mark.parametrize("endpoint", ["https://s3-fips.us-east-1.amazonaws.com",
                                      "https://bucket.vpce-0a1b-xyz.s3.us-east-1.vpce.amazonaws.com",
                                      "https://s3.dualstack.us-east-1.amazonaws.com"])
def test_an_aws_endpoint_obstore_would_replace_keeps_s3fs(stored, endpoint):
    """Review (2026-11-28): any *.amazonaws.com endpoint was dropped and obstore's public regional one used instead,
    so signed GETs left a FIPS or PrivateLink setup for the public endpoint."""
    import s3fs

    fs = remote_errors.bounded_filesystem(s3fs.S3FileSystem, "s3", {"endpoint_url": endpoint,
                                                                    "client_kwargs": {"region_name": "us-east-1"}})
    assert transport_download.client_for(fs) is None
    for plain in ("https://s3.amazonaws.com", "https://s3.us-east-1.amazonaws.com", "http://127.0.0.1:9000"):
        assert transport_download._plain_aws_or_custom(plain, "us-east-1"), plain


def test_anonymous_and_turned_off(stored, monkeypatch):
    import s3fs

    anon = remote_errors.bounded_filesystem(s3fs.S3FileSystem, "s3", {"anon": True})
    assert transport_download.client_for(anon)._kwargs.get("skip_signature") is True
    monkeypatch.setenv(transport_download.VARIABLE, "s3fs")
    fresh = remote_errors.bounded_filesystem(s3fs.S3FileSystem, "s3", {})
    assert transport_download.client_for(fresh) is None


class _Marker(Exception):
    pass


def test_a_load_runs_with_the_cyclic_collector_paused_and_restores_it(monkeypatch):
    # A load's objects set off full collections of the whole process (checkpoint/io/collector.py): the collector is
    # paused while a checkpoint is read, and on again after, also when the load raises.
    import gc
    from pathlib import Path

    from lightning_fsdp.checkpoint import load

    seen = []

    def first_step(comm, what, step):
        seen.append(gc.isenabled())
        raise _Marker(what)

    monkeypatch.setattr(load, "together", first_step)
    assert gc.isenabled()
    with pytest.raises(_Marker):
        load._load(Path("unused"), {}, True, None, None)
    assert seen == [False] and gc.isenabled()
    gc.disable()  # a caller that paused it itself keeps it paused
    try:
        with pytest.raises(_Marker):
            load._load(Path("unused"), {}, True, None, None)
        assert not gc.isenabled()
    finally:
        gc.enable()


@pytest.mark.parametrize("length, low, most", [(1000, 3, 8), (2**20, 1, 2)])
def test_small_ranges_run_more_at_once_within_the_windows_bytes(monkeypatch, length, low, most):
    # Small requests are mostly round trips: up to SMALL_REQUESTS x ranges_in_flight run at once while their bytes
    # stay within ranges_in_flight x range_size; requests of range_size run ranges_in_flight at once, as before.
    # (Before, small ones ran ranges_in_flight at once too: 2 here.)
    import threading
    import time

    import fsspec

    fs = fsspec.filesystem("memory")
    target = f"memory://fast-{uuid.uuid4().hex[:8]}/ck"
    fs.pipe_file(f"{target}/.tok/{NAME}", b"x" * (17 * 2**21))
    running, peak, lock = [0], [0], threading.Lock()
    original = ranged_read._Fetcher.get

    def counted(self, name, start, end, **into):
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        time.sleep(0.05)  # long enough for every request the window allows to be started meanwhile
        try:
            return original(self, name, start, end, **into)
        finally:
            with lock:
                running[0] -= 1

    monkeypatch.setattr(ranged_read._Fetcher, "get", counted)
    spans = [(i * 2**21, i * 2**21 + length) for i in range(16)]
    got = _fetch(_source(fs, target, 17 * 2**21), spans, ranges_in_flight=2, range_size=2**20)
    assert len(got) == 16 and low <= peak[0] <= most, peak
