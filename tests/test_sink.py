"""The upload sink (issue 43, ``checkpoint/io/sink.py``): an object written from memory into S3 multipart parts,
at most ``parts_in_flight`` out at once, one PUT under one part, no object when the block raises; a part that
fails transiently is re-sent alone. A fake S3 client (``_FakeS3``) counts what is in flight and every request; the
real server (moto's, ``s3_server``) shows the same bytes arrive and that an aborted upload leaves nothing."""

from __future__ import annotations

import asyncio
import os
import threading

import pytest

from lightning_fsdp.checkpoint.io import sink as sink_module
from lightning_fsdp.checkpoint.io.sink import open_upload
from lightning_fsdp.checkpoint.io.transfers import Transfers, set_transfers, transfers

pytestmark = pytest.mark.single_process

# A test part size, below S3's 5 MiB minimum part: single PUTs have no minimum, nor do the fakes, and moto's is lowered
# per test. test_save_speed_objects.py imports these three.
P = 64 * 1024
K = 2


@pytest.fixture
def small_parts():
    """Parts of ``P`` bytes, ``K`` in flight, for the test; the transfers before it after."""
    before = transfers()
    set_transfers(Transfers(part_size=P, parts_in_flight=K))  # unchecked on purpose: below the 5 MiB minimum
    try:
        yield
    finally:
        set_transfers(before)


class _FakeS3:
    """Just enough of s3fs for the sink: ``_call_s3`` on fsspec's loop, with every request recorded, the parts in
    flight counted (each part waits a little so that the writer gets ahead of it), and faults by rule."""

    def __init__(self, fail=None):
        from fsspec.asyn import get_loop

        self.loop = get_loop()
        self.calls: list[tuple[str, int]] = []
        self.objects: dict[str, bytes] = {}
        self.parts: dict[int, bytes] = {}
        self.out = self.peak = 0
        self.fail = dict(fail or {})  # part number -> failures left
        self.lock = threading.Lock()

    def split_path(self, url):
        bucket, key = url.split("://", 1)[-1].split("/", 1)
        return bucket, key, None

    async def _call_s3(self, method, **kw):
        self.calls.append((method, kw.get("PartNumber", 0)))
        if method == "put_object":
            assert kw["IfNoneMatch"] == "*"
            self.objects[kw["Key"]] = bytes(kw["Body"])
            return {}
        if method == "create_multipart_upload":
            return {"UploadId": "u1"}
        if method == "upload_part":
            with self.lock:
                self.out += 1
                self.peak = max(self.peak, self.out)
            try:
                await asyncio.sleep(0.02)
                number = kw["PartNumber"]
                if self.fail.get(number):
                    self.fail[number] -= 1
                    from botocore.exceptions import ClientError

                    raise ClientError({"Error": {"Code": "SlowDown", "Message": "Please reduce your request rate."},
                                       "ResponseMetadata": {"HTTPStatusCode": 503}}, "UploadPart")
                self.parts[number] = bytes(kw["Body"])
                return {"ETag": f'"{number}"'}
            finally:
                with self.lock:
                    self.out -= 1
        if method == "complete_multipart_upload":
            assert kw["IfNoneMatch"] == "*"
            numbers = [p["PartNumber"] for p in kw["MultipartUpload"]["Parts"]]
            assert numbers == sorted(self.parts)
            self.objects[kw["Key"]] = b"".join(self.parts[n] for n in numbers)
            return {}
        if method == "abort_multipart_upload":
            self.parts.clear()
            return {}
        raise AssertionError(method)


def _write(sink, data, piece=10_000):
    for start in range(0, len(data), piece):
        sink.write(data[start:start + piece])


@pytest.mark.parametrize("size", [0, P // 3, 3 * P + P // 2])
def test_an_object_of_any_size_arrives_whole_with_at_most_k_parts_out(small_parts, size):
    fs = _FakeS3()
    data = os.urandom(size)
    with open_upload(fs, "s3://b/k") as sink:
        _write(sink, data)
        assert sink.tell() == size
    assert fs.objects == {"k": data} and sink.size == size
    methods = [m for m, _ in fs.calls]
    if size < P:  # under one part: one PUT, no multipart upload
        assert methods == ["put_object"]
    else:
        assert methods == ["create_multipart_upload"] + ["upload_part"] * 4 + ["complete_multipart_upload"]
        # The window was used (the writer got ahead of the 20 ms parts) and never exceeded.
        assert fs.peak == K and sink.peak_in_flight == K


def test_a_503_on_part_3_costs_exactly_one_more_request(small_parts, monkeypatch):
    from lightning_fsdp.checkpoint.io import remote_errors

    monkeypatch.setattr(remote_errors, "BACKOFF_S", 0.01)
    fs = _FakeS3(fail={3: 1})
    data = os.urandom(3 * P + P // 2)
    with open_upload(fs, "s3://b/k") as sink:
        _write(sink, data)
    assert fs.objects == {"k": data}
    parts = [n for m, n in fs.calls if m == "upload_part"]
    assert sorted(parts) == [1, 2, 3, 3, 4], parts  # part 3 again, alone; nothing else re-sent
    assert len(fs.calls) == 7 and sink.requests == 7


def test_a_part_that_keeps_failing_aborts_the_upload_naming_the_url(small_parts, monkeypatch):
    from lightning_fsdp.checkpoint.io import remote_errors

    monkeypatch.setattr(remote_errors, "ATTEMPTS", 2)
    monkeypatch.setattr(remote_errors, "BACKOFF_S", 0.01)
    fs = _FakeS3(fail={2: 5})
    with pytest.raises(ConnectionError, match=r"'s3://b/k' failed while uploading to it, after 2 attempts.*HINT"):
        with open_upload(fs, "s3://b/k") as sink:
            _write(sink, os.urandom(4 * P))
    assert "k" not in fs.objects and ("abort_multipart_upload", 0) in fs.calls
    assert [m for m, _ in fs.calls].count("complete_multipart_upload") == 0


def test_an_error_in_the_block_aborts_and_leaves_no_object(small_parts):
    fs = _FakeS3()
    with pytest.raises(RuntimeError, match="writer failed"):
        with open_upload(fs, "s3://b/k") as sink:
            _write(sink, os.urandom(2 * P + 5))
            raise RuntimeError("writer failed")
    assert fs.objects == {} and fs.calls[-1] == ("abort_multipart_upload", 0)


def test_a_size_hint_past_the_part_limit_raises_the_part_size():
    sink = open_upload(_FakeS3(), "s3://b/k", size_hint=200 * 2**30)  # 200 GiB at 8 MiB parts: 25,600 parts
    assert sink.part_size * sink_module._PARTS_BEFORE_GROWING >= 200 * 2**30 and sink.part_size % 2**20 == 0
    sink._abort()


def test_other_stores_write_through_their_file_object(small_parts):
    import fsspec

    fs = fsspec.filesystem("memory")
    data = os.urandom(2 * P + 7)
    with open_upload(fs, "memory://sink-test/ok") as sink:
        _write(sink, data)
    assert fs.cat_file("memory://sink-test/ok") == data and sink.size == len(data)
    with pytest.raises(RuntimeError, match="stop"):
        with open_upload(fs, "memory://sink-test/no") as sink:
            _write(sink, data)
            raise RuntimeError("stop")
    assert not fs.exists("memory://sink-test/no")
    fs.rm("memory://sink-test", recursive=True)


# --------------------------------------------------------------------------------------- the real server (moto)


@pytest.fixture
def moto_small_parts(monkeypatch, small_parts):
    """moto refuses parts under 5 MiB but the last; these tests lower that, in this process (the server's)."""
    import moto.s3.models

    monkeypatch.setattr(moto.s3.models, "S3_UPLOAD_PART_MIN_SIZE", P)


def test_on_s3_the_object_is_the_bytes_written_and_a_failed_one_leaves_no_upload(s3_server, moto_small_parts):
    from lightning_fsdp.checkpoint.io.urls import filesystem

    bucket = s3_server.bucket()
    fs = filesystem("s3://", {"endpoint_url": s3_server.endpoint, "key": "testing", "secret": "testing"})
    data = os.urandom(3 * P + P // 2)
    for name, size in (("empty", 0), ("small", 100), ("multi", len(data))):
        with open_upload(fs, f"s3://{bucket}/{name}") as sink:
            _write(sink, data[:size])
        assert fs.cat_file(f"s3://{bucket}/{name}") == data[:size]
    # A key that exists is never replaced: If-None-Match on the PUT and on the complete.
    for size in (100, len(data)):
        with pytest.raises(FileExistsError, match="HINT"):
            with open_upload(fs, f"s3://{bucket}/multi") as sink:
                _write(sink, data[:size])
    assert fs.cat_file(f"s3://{bucket}/multi") == data
    with pytest.raises(RuntimeError, match="stop"):
        with open_upload(fs, f"s3://{bucket}/failed") as sink:
            _write(sink, data)
            raise RuntimeError("stop")
    fs.invalidate_cache()
    assert not fs.exists(f"s3://{bucket}/failed")
    assert s3_server.client().list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []


def test_a_503_from_the_server_on_part_3_resends_part_3_alone(ledger, moto_small_parts, monkeypatch):
    """The same against a real server (moto behind the counting ledger, tests/ledger.py): the 503 on part 3 costs
    exactly one more request, of part 3's bytes, and the object is whole."""
    from lightning_fsdp.checkpoint.io import remote_errors
    from lightning_fsdp.checkpoint.io.urls import filesystem

    monkeypatch.setattr(remote_errors, "BACKOFF_S", 0.01)
    bucket = ledger.bucket()
    fs = filesystem("s3://", {"endpoint_url": ledger.endpoint, "key": "sink", "secret": "testing"})
    ledger.fail(f"PUT {bucket}/obj?partNumber=3", status=503)
    data = os.urandom(3 * P + P // 2)
    with open_upload(fs, f"s3://{bucket}/obj") as sink:
        _write(sink, data)
    assert fs.cat_file(f"s3://{bucket}/obj") == data
    records = ledger.records("sink", prefix=f"{bucket}/obj")
    parts = sorted((int(r.query["partNumber"]), r.status) for r in records if "partNumber" in r.query)
    assert parts == [(1, 200), (2, 200), (3, 200), (3, 503), (4, 200)], parts
    sent = [(r.method, sorted(r.query), r.status) for r in records if r.method in ("PUT", "POST")]
    assert len(sent) == 7, sent  # create, 4 parts, part 3 again, complete (the read back is GETs and a HEAD)
    assert sum(r.bytes_in for r in records if r.method == "PUT") == len(data) + P  # part 3 twice, nothing else
