"""A reply lost on its way back is no conflict (issue 43, review defect 6).

A store may apply a request and the connection break before its answer arrives. Sent again, a conditional write
(``If-None-Match: *`` on a shard object's PUT or multipart complete, the COMMIT's PUT) is then refused by our own
object: 412, or, for a complete, 404 from a store that forgot the upload it completed. That refusal was read as
"another save committed", failing a save that had in fact succeeded. Here the real server (moto behind the ledger,
``tests/ledger.py``) applies the request and cuts the connection before the answer (``Ledger.lose_reply``); the
upload must end as its own success, and an object another writer made must still be the conflict error.
"""

from __future__ import annotations

import os
import warnings

import pytest

from lightning_fsdp.checkpoint.io.transfers import Transfers, set_transfers, transfers

pytestmark = pytest.mark.single_process

P = 64 * 1024  # a test part size: moto's 5 MiB minimum is lowered to it (the server runs in this process)


class S3:
    """The ledger, the test's bucket, and a filesystem built as saves build theirs (its client retries nothing)."""

    def __init__(self, ledger):
        from lightning_fsdp.checkpoint.io.urls import filesystem

        self.ledger, self.bucket = ledger, ledger.bucket()
        self.options = {"endpoint_url": ledger.endpoint, "key": "sink", "secret": "testing"}
        self.fs = filesystem("s3://", self.options)

    def url(self, key: str) -> str:
        return f"s3://{self.bucket}/{key}"

    def writes(self, key: str) -> list[tuple[str, str, int, bool]]:
        """The writes of ``key`` the server saw: (method, part number or "", status, whether its reply was lost)."""
        return [(r.method, r.query.get("partNumber", ""), r.status, "cut before the reply" in r.fault)
                for r in self.ledger.records(prefix=f"{self.bucket}/{key}") if r.method in ("PUT", "POST")]


@pytest.fixture
def s3(ledger, monkeypatch):
    import moto.s3.models

    from lightning_fsdp.checkpoint.io import remote_errors

    monkeypatch.setattr(moto.s3.models, "S3_UPLOAD_PART_MIN_SIZE", P)
    monkeypatch.setattr(remote_errors, "BACKOFF_S", 0.01)
    before = transfers()
    set_transfers(Transfers(part_size=P, parts_in_flight=2))
    try:
        yield S3(ledger)
    finally:
        set_transfers(before)


def upload(fs, url: str, data: bytes) -> None:
    from lightning_fsdp.checkpoint.io.sink import open_upload

    with open_upload(fs, url) as sink:
        sink.write(data)


def commit(s3: S3, key: str, payload: bytes, version) -> None:
    """``put_if`` as a save's commit sends it: retried after a transient failure (``FsspecStore._write_commit``)."""
    from lightning_fsdp.checkpoint.io.conditional import put_if
    from lightning_fsdp.checkpoint.io.remote_errors import retrying

    retrying(s3.fs, s3.url(key), "committing", lambda: put_if(s3.fs, s3.url(key), payload, version))


def test_a_lost_reply_to_a_part_costs_one_resend_of_that_part(s3, ledger):
    data = os.urandom(3 * P + 100)
    ledger.lose_reply(f"PUT {s3.bucket}/obj?partNumber=2")
    upload(s3.fs, s3.url("obj"), data)
    assert s3.fs.cat_file(s3.url("obj")) == data
    parts = sorted((number, status, lost) for _, number, status, lost in s3.writes("obj") if number)
    assert parts == [("1", 200, False), ("2", 200, False), ("2", 200, True), ("3", 200, False),
                     ("4", 200, False)], parts


@pytest.mark.parametrize("status", [412, 404])
def test_a_lost_reply_to_the_multipart_complete_is_the_upload_s_own_success(s3, ledger, status):
    """moto completes an upload again as a no-op; other stores refuse the resent complete: 412 (the object is there
    now, If-None-Match) or 404 (the upload is gone: AWS's NoSuchUpload once it forgets a completed one). Injected
    on the resend, after the first complete was applied."""
    data = os.urandom(2 * P + 100)
    ledger.lose_reply(f"POST {s3.bucket}/obj?uploadId")
    ledger.fail(f"POST {s3.bucket}/obj?uploadId", status=status, nth=2)
    upload(s3.fs, s3.url("obj"), data)
    assert s3.fs.cat_file(s3.url("obj")) == data
    completes = [(code, lost) for method, _, code, lost in s3.writes("obj") if method == "POST"]
    assert completes[1:] == [(200, True), (status, False)], completes  # (the first POST created the upload)
    assert ledger.client().list_multipart_uploads(Bucket=s3.bucket).get("Uploads", []) == []


def test_a_lost_reply_to_a_single_put_is_the_upload_s_own_success(s3, ledger):
    data = os.urandom(100)
    ledger.lose_reply(f"PUT {s3.bucket}/obj")
    upload(s3.fs, s3.url("obj"), data)
    assert s3.fs.cat_file(s3.url("obj")) == data
    assert s3.writes("obj") == [("PUT", "", 200, True), ("PUT", "", 412, False)]


def test_a_lost_reply_to_the_commit_put_is_the_save_s_own_commit(s3, ledger):
    """A new COMMIT (If-None-Match) and one over an existing COMMIT (If-Match); then a whole one-process save whose
    COMMIT's answer is lost."""
    import torch

    from lightning_fsdp.checkpoint.io.conditional import version_of
    from lightning_fsdp.checkpoint.io.one_process import OneProcess
    from lightning_fsdp.checkpoint.save import write_sharded

    for payload in (b'{"token": "a"}', b'{"token": "b"}'):
        version = version_of(s3.fs, s3.url("run/COMMIT"))
        ledger.lose_reply(f"PUT {s3.bucket}/run/COMMIT")
        commit(s3, "run/COMMIT", payload, version)
        assert s3.fs.cat_file(s3.url("run/COMMIT")) == payload
    assert [(code, lost) for _, _, code, lost in s3.writes("run/COMMIT")] == [(200, True), (412, False)] * 2
    ledger.reset()
    ledger.lose_reply(f"PUT {s3.bucket}/save/COMMIT")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP "assumes" one process: that is the intent here
        write_sharded(s3.url("save"), {"model": {"w": torch.ones(4)}}, {"step": 1}, OneProcess(),
                      storage_options=s3.options)  # not the environment: a store cached earlier keeps its endpoint
    assert [(code, lost) for _, _, code, lost in s3.writes("save/COMMIT")] == [(200, True), (412, False)]


@pytest.mark.parametrize("kind", ["single PUT", "multipart", "COMMIT"])
def test_another_writer_s_object_is_still_the_conflict_error(s3, ledger, kind):
    """Our first attempt is cut before the server applies it (``drop_connection``: nothing stored), so the resend
    is refused by another writer's object of the very same size (written through the same code: a mark of its own).
    It is not ours: the conflict error, and the other object stays as it was."""
    from lightning_fsdp.checkpoint.io.urls import filesystem

    size = 2 * P + 100 if kind == "multipart" else 100
    theirs, ours = os.urandom(size), os.urandom(size)
    other = filesystem("s3://", {"endpoint_url": ledger.endpoint, "key": "other", "secret": "testing"})
    upload(other, s3.url("obj"), theirs)
    ledger.drop_connection(f"POST {s3.bucket}/obj?uploadId" if kind == "multipart" else f"PUT {s3.bucket}/obj",
                           after_bytes=0)
    with pytest.raises(FileExistsError, match="HINT: give each writer its own checkpoint path"):
        if kind == "COMMIT":
            commit(s3, "obj", ours, None)
        else:
            upload(s3.fs, s3.url("obj"), ours)
    assert s3.fs.cat_file(s3.url("obj")) == theirs
    mine = [r for r in ledger.records("sink", prefix=f"{s3.bucket}/obj") if r.method in ("PUT", "POST")
            and "partNumber" not in r.query and "uploads" not in r.query]
    assert [(r.status, "connection dropped" in r.fault) for r in mine] == [(None, True), (412, False)], mine
