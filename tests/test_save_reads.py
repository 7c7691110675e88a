"""What rank 0 reads from a bucket on the path of every save (issue 43: save speed, a background save's stall): a
bucket's existence is checked once per process, the COMMITs of the target's directory are read side by side under
one retry budget, and the host's stale staging folders are swept once per temporary folder, not on every save.
In process, against the ledger's S3 server (``tests/ledger.py``), which counts every request."""

from __future__ import annotations

import tempfile
import threading
import uuid

import pytest

from lightning_fsdp.checkpoint.io import remote_clean
from lightning_fsdp.checkpoint.io.one_process import OneProcess
from lightning_fsdp.checkpoint.io.remote import FsspecStore

pytestmark = pytest.mark.single_process
HANG_S = 30  # a bound against a hang only: the reads below take milliseconds


@pytest.fixture()
def store(ledger, monkeypatch):
    for key, value in ledger.env.items():
        monkeypatch.setenv(key, value)
    return FsspecStore("s3", None)


def _save(store: FsspecStore, url: str, files: dict[str, bytes]) -> None:
    """A rank-0 save of ``files`` to ``url`` in this process (check, stage, upload, commit)."""
    url = store.target(url)
    staged = store.staging(url, uuid.uuid4().hex[:12], 0)
    staged.mkdir(parents=True)
    for name, data in files.items():
        (staged / name).write_bytes(data)
    store.check_target(url, 0)
    store.commit(staged, url, OneProcess())


def test_a_second_save_to_a_bucket_asks_nothing_of_the_bucket_itself(store, ledger):
    bucket = ledger.bucket()
    _save(store, f"s3://{bucket}/run/step-1", {"a.distcp": b"1"})
    ledger.reset()
    _save(store, f"s3://{bucket}/run/step-2", {"a.distcp": b"2"})
    # Listings (of objects, of uploads) are requests on the bucket too, with a prefix; its own check has none.
    on_bucket = [r for r in ledger.records() if r.bucket == bucket and not r.key and "prefix" not in r.query]
    assert on_bucket == [], on_bucket  # the first save saw it exist: no HEAD of the bucket per save


def test_the_checks_before_a_save_to_a_new_target_are_four_requests(store, ledger):
    bucket = ledger.bucket()
    _save(store, f"s3://{bucket}/run/step-1", {"a.distcp": b"1"})
    ledger.reset()
    store.check_target(store.target(f"s3://{bucket}/run/step-2"), 0)
    asked = sorted((r.method, r.key or r.query.get("prefix")) for r in ledger.records())  # sent side by side
    # A HEAD of the target (is it an object?) and a LIST of its prefix (anything under it?); then COMMIT's version,
    # which the save's conditional PUT begins from (a HEAD, and s3fs's LIST when it finds none). No HEAD of the
    # bucket, no LIST of the whole directory (the code before asked 7 times).
    assert asked == [("GET", "run/step-2/"), ("GET", "run/step-2/COMMIT/"), ("HEAD", "run/step-2"),
                     ("HEAD", "run/step-2/COMMIT")], asked


def test_an_object_at_the_target_is_still_refused_and_a_foreign_folder_too(store, ledger):
    bucket = ledger.bucket()
    ledger.client().put_object(Bucket=bucket, Key="run/notes", Body=b"mine")
    ledger.client().put_object(Bucket=bucket, Key="run/data/table.csv", Body=b"mine")
    with pytest.raises(FileExistsError, match="is an existing object that is not a checkpoint.*HINT"):
        store.check_target(store.target(f"s3://{bucket}/run/notes"), 0)
    with pytest.raises(IsADirectoryError, match=r"holds objects no checkpoint save wrote \(table.csv\).*HINT"):
        store.check_target(store.target(f"s3://{bucket}/run/data"), 0)


def test_a_bucket_deleted_after_a_save_is_named_at_the_next_saves_upload(store, ledger):
    bucket = ledger.bucket()
    _save(store, f"s3://{bucket}/run/step-1", {"a.distcp": b"1"})  # the bucket is now known to exist
    client = ledger.client()
    for item in client.list_objects_v2(Bucket=bucket).get("Contents", []):
        client.delete_object(Bucket=bucket, Key=item["Key"])
    client.delete_bucket(Bucket=bucket)
    with pytest.raises(FileNotFoundError, match=f"The bucket '{bucket}' of .* does not exist.*HINT: create it"):
        _save(store, f"s3://{bucket}/run/step-2", {"a.distcp": b"2"})
    with pytest.raises(FileNotFoundError, match=f"The bucket '{bucket}' .* does not exist"):
        store.check_target(store.target(f"s3://{bucket}/run/step-3"), 0)  # and no longer known to exist


def test_the_commits_of_a_directory_are_read_side_by_side(store, ledger, monkeypatch):
    bucket = ledger.bucket()
    for step in range(1, 5):
        _save(store, f"s3://{bucket}/run/step-{step}", {"a.distcp": str(step).encode()})
    read = FsspecStore.read_commit
    together = threading.Barrier(4, timeout=HANG_S)  # one after another, the first read would wait here in vain

    def meeting(self, target):
        together.wait()
        return read(self, target)

    monkeypatch.setattr(FsspecStore, "read_commit", meeting)
    found = store.checkpoints_in(f"s3://{bucket}/run")
    assert [name for name, _, _ in found] == [f"step-{step}" for step in range(1, 5)]
    assert [record["token"] for _, _, record in found] == [read(store, url)["token"] for _, url, _ in found]


def test_a_failed_commit_read_is_retried_and_the_first_error_in_listing_order_is_raised(store, ledger, monkeypatch):
    bucket = ledger.bucket()
    for step in range(1, 4):
        _save(store, f"s3://{bucket}/run/step-{step}", {"a.distcp": b"x"})
    ledger.fail(f"GET {bucket}/run/step-2/COMMIT", status=503, times=1)  # transient: retried within the budget
    assert [name for name, _, _ in store.checkpoints_in(f"s3://{bucket}/run")] == ["step-1", "step-2", "step-3"]
    read = FsspecStore.read_commit

    def refused(self, target):
        if not target.endswith("step-1"):
            raise PermissionError(f"refused {target}")
        return read(self, target)

    monkeypatch.setattr(FsspecStore, "read_commit", refused)
    with pytest.raises(PermissionError, match="refused .*/run/step-2$"):
        store.checkpoints_in(f"s3://{bucket}/run")


def test_stale_staging_folders_are_swept_once_per_process_and_temporary_folder(store, ledger, tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "first"))
    (tmp_path / "first").mkdir()
    calls = []
    sweep = remote_clean.remove_stale_staging
    monkeypatch.setattr(remote_clean, "remove_stale_staging", lambda *a: calls.append(a) or sweep(*a))
    url = f"s3://{ledger.bucket()}/run/step-1"
    for token in ("0123456789ab", "0123456789ac", "0123456789ad"):
        store.staging(url, token, 0)
    assert len(calls) == 1, calls
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "second"))  # another temporary folder: swept too
    (tmp_path / "second").mkdir()
    store.staging(url, "0123456789ae", 0)
    assert len(calls) == 2, calls
