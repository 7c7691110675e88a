"""The COMMIT object is untrusted input (issue 45 item 1, issue 42 item 5).

Anyone who can write one object into a bucket that a job loads from can write a COMMIT there. Its object names were
joined onto the load's temporary folder as they came: an absolute name or one with ``..`` wrote files anywhere
(a ``.pth`` in site-packages runs code at the next start), and a COMMIT with its order key edited verified with
exit 0, then sorted as the oldest; a truncated one gave a traceback. Here each crafted COMMIT is uploaded to the
suite's S3 server and read as a job reads it (a load, a verification, ``latest``, the command line): each must end in
one clear damage error naming the COMMIT, with nothing fetched and nothing written outside the load's folder.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pytest
import torch

from inprocess import run_cli
from lightning_fsdp.checkpoint.formats.commit_order import next_commit_order
from lightning_fsdp.checkpoint.formats.commit_record import build_record, encode_record, parse_record
from lightning_fsdp.checkpoint.integrity.digests import ChecksumError
from lightning_fsdp.checkpoint.io.one_process import OneProcess

pytestmark = pytest.mark.single_process

TOKEN = "0123456789ab"


@pytest.fixture()
def s3(s3_server, monkeypatch):
    s3_server.setenv(monkeypatch)
    return s3_server


@pytest.fixture()
def loads_here(tmp_path, monkeypatch) -> Path:
    """The load's temporary folder is made under ``tmp_path/tmp``: an escape by ``../../..`` lands in ``tmp_path``,
    where the test looks for it, not in the machine's own temporary folder."""
    folder = tmp_path / "tmp"
    folder.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    return folder


@pytest.fixture()
def requests(monkeypatch) -> list[tuple[str, str]]:
    """Every request s3fs sends, as (operation, key): to show that nothing a COMMIT names was fetched."""
    import s3fs

    sent: list[tuple[str, str]] = []
    call = s3fs.S3FileSystem._call_s3

    async def counted(self, method, *args, **kwargs):
        sent.append((getattr(method, "__name__", str(method)), str(kwargs.get("Key", ""))))
        return await call(self, method, *args, **kwargs)

    monkeypatch.setattr(s3fs.S3FileSystem, "_call_s3", counted)
    return sent


def fetched(sent: list[tuple[str, str]]) -> list[str]:
    return [key for method, key in sent if method == "get_object" and not key.endswith("/COMMIT")]


def files_in(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if not p.is_dir())


# The four crafted COMMITs of the issue: (the record's name, its object names). Each also has its objects uploaded
# under the names it gives, so a reader that fetched them would write them.
def crafted_cases(tmp_path: Path) -> dict[str, tuple[str, list[str]]]:
    return {
        "absolute": ("step-00000002", [str(tmp_path / "escaped" / "absolute.pth"), "meta.pt"]),
        "dot-dot": ("step-00000002", ["../../../escaped/up.pth", "meta.pt"]),
        "backslash": ("step-00000002", ["..\\..\\..\\escaped\\back.pth"]),
        "name-dot-dot": ("..", ["x.pth"]),
    }


def upload_crafted(fs, url: str, name: str, objects: list[str]) -> None:
    body = b"import sys; sys.exit('ran code from a crafted checkpoint')\n"
    record = build_record(TOKEN, "sharded", name, {o: [len(body), None] for o in objects}, next_commit_order())
    for o in objects:
        fs.pipe_file(f"{url}/.{TOKEN}/{o}", body)
    fs.pipe_file(f"{url}/COMMIT", encode_record(record))  # a valid digest: the names alone must be refused


@pytest.mark.parametrize("case", ["absolute", "dot-dot", "backslash", "name-dot-dot"])
def test_a_crafted_commit_fetches_nothing_and_writes_nothing_outside_the_load(s3, loads_here, requests, tmp_path,
                                                                                case):
    from lightning_fsdp.checkpoint.io.store import store_for
    from lightning_fsdp.checkpoint.latest import newest_good_checkpoint

    run = f"s3://{s3.bucket()}/run"
    url = f"{run}/step-00000002"
    upload_crafted(s3.filesystem(), url, *crafted_cases(tmp_path)[case])
    commit = f"{url}/COMMIT"
    requests.clear()

    def refused(read) -> str:
        with pytest.raises(ChecksumError) as caught:
            read()
        message = str(caught.value)
        assert commit in message and "damaged" in message and "HINT:" in message, message
        return message

    def load():
        with store_for(url).open_committed(url, OneProcess()):
            pass

    refused(load)
    refused(lambda: store_for(url).verify(url))
    with pytest.warns(UserWarning, match="fails verification") as skipped:  # damage: `latest` skips it, naming it
        assert newest_good_checkpoint(run) is None
    assert any(commit in str(w.message) and "damaged" in str(w.message) for w in skipped.list)
    shown = run_cli(["inspect", "--verify", url], cwd=tmp_path)
    assert shown.returncode == 1 and shown.stdout == "", shown.stderr
    assert shown.stderr.count("\n") == 1 and "Traceback" not in shown.stderr, shown.stderr
    assert commit in shown.stderr and "HINT:" in shown.stderr, shown.stderr

    assert fetched(requests) == [], f"objects the crafted COMMIT names were fetched: {fetched(requests)}"
    assert files_in(tmp_path) == [], f"files were written: {files_in(tmp_path)}"


def test_the_reader_refuses_every_unsafe_name_and_field():
    """The strict reader alone, each field: every refusal is damage naming the URL, with the fix."""
    from lightning_fsdp.checkpoint.formats.commit_record import CommitRecordError

    good = build_record(TOKEN, "sharded", "step-1", {".metadata": [10, 5], "__0_0.distcp": [20, None]}, 7)
    assert parse_record(encode_record(good), "u") == good
    bad_names = ["/etc/x.pth", "../x", "a/../../x", "a\\b", "a//b", "./a", "a/", "", "C:x", "a/c:\\x", "a\x00b",
                 "a\nb", "\ud800", "a/" * 17 + "b", "x" * 256, "a/" + "b" * 1100]
    changes = [("name", ".."), ("name", "a/b"), ("name", "."), ("name", 5), ("token", "../x"), ("token", "ABCDEF12"),
               ("token", 12), ("kind", "other"), ("objects", []), ("objects", {"a": [1]}),
               ("objects", {"a": [-1, None]}),
               ("objects", {"a": [True, None]}), ("objects", {"a": [1.0, None]}), ("objects", {"a": [2**46, None]}),
               ("objects", {"a": [1, 2**64]}), ("objects", {"a": [1, "x"]}), ("objects", {"a": [1, 1], "a/b": [1, 1]}),
               ("commit_order", -1), ("commit_order", True), ("commit_order", "7"), ("time", float("nan")),
               ("time", "now"), ("version", 0), ("version", "1"), ("format", "other")]
    changes += [("objects", {name: [1, None]}) for name in bad_names]
    for key, value in changes:
        for payload in (encode_record({**good, key: value}),  # digest recomputed: the field check must refuse
                        json.dumps({**good, key: value}).encode()):  # no digest, as the previous release wrote
            with pytest.raises(CommitRecordError) as caught:
                parse_record(payload, "s3://b/run/COMMIT")
            assert caught.value.damage and "'s3://b/run/COMMIT' is damaged" in str(caught.value), (key, value)
            assert "HINT:" in str(caught.value)
    full = {**good, "kind": "full"}
    with pytest.raises(CommitRecordError, match="one object, and it names 2"):
        parse_record(encode_record(full), "u")
    with pytest.raises(CommitRecordError, match="appears twice"):
        parse_record(b'{"format": "lightning-fsdp-commit", "format": "x"}', "u")
    newer = encode_record({**good, "version": 2})
    with pytest.raises(CommitRecordError, match="version 2 .*HINT: load it with the lightning-fsdp version") as err:
        parse_record(newer, "u")
    assert not err.value.damage


def test_every_rank_checks_where_it_writes_and_never_follows_a_link(tmp_path, loads_here):
    """Defence in depth in ``_download``: a record that reaches a rank unchecked (rank 0 reads COMMIT, the others get
    its record), with a name that leaves the folder, is refused before anything is fetched; and a symbolic link in
    the load's folder is not written through."""
    import fsspec

    from lightning_fsdp.checkpoint.io.store import store_for

    url = "memory://commit-record/run/step-1"
    store = store_for(url)
    store.fs.pipe_file(f"{url}/.{TOKEN}/a.distcp", b"abc")
    store.fs.pipe_file(f"{url}/.{TOKEN}/../../../escaped/x.pth", b"abc")
    try:
        root = Path(tempfile.mkdtemp())
        unchecked = {"token": TOKEN, "kind": "sharded", "objects": {"../../../escaped/x.pth": [3, None]}}
        with pytest.raises(ChecksumError, match="outside the load's folder"):
            store._download(url, unchecked, root / "step-1")
        assert files_in(tmp_path) == []

        outside = tmp_path / "outside.txt"
        outside.write_bytes(b"keep")
        (root / "step-1").mkdir()
        os.symlink(outside, root / "step-1" / "a.distcp")
        record = {"token": TOKEN, "kind": "sharded", "objects": {"a.distcp": [3, None]}}
        with pytest.raises(ChecksumError, match="outside the load's folder"):  # where the link leads
            store._download(url, record, root / "step-1")
        assert outside.read_bytes() == b"keep"
        os.unlink(root / "step-1" / "a.distcp")
        store._download(url, record, root / "step-1")  # the same record, without the link: fetched
        assert (root / "step-1" / "a.distcp").read_bytes() == b"abc"
    finally:
        fsspec.filesystem("memory").store.clear()


# ------------------------------------------------------------------ a real checkpoint's COMMIT, damaged or edited


@pytest.fixture()
def saved(s3, tmp_path) -> str:
    torch.save({"fc.weight": torch.arange(6.0).reshape(2, 3)}, tmp_path / "bare.pt")
    url = f"s3://{s3.bucket()}/run/step-00000005"
    made = run_cli(["convert", tmp_path / "bare.pt", url, "--to", "sharded"], cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    return url


def one_line_damage(run, commit: str, hint: str = "HINT: load an earlier checkpoint, or save this one again.") -> None:
    assert run.returncode == 1 and run.stdout == "", (run.returncode, run.stdout, run.stderr)
    assert run.stderr.startswith("lightning-fsdp: error: ") and run.stderr.count("\n") == 1, run.stderr
    assert "Traceback" not in run.stderr and commit in run.stderr and hint in run.stderr, run.stderr


def test_a_commit_carries_its_digest_and_an_edited_order_key_is_damage(s3, saved, tmp_path):
    from lightning_fsdp.checkpoint.latest import newest_good_checkpoint

    fs = s3.filesystem()
    commit = f"{saved}/COMMIT"
    payload = fs.cat_file(commit)
    record = json.loads(payload)
    assert record["digest"].startswith("sha256:"), record

    # The previous release wrote no digest: such a COMMIT still loads, checked field by field.
    fs.pipe_file(commit, json.dumps({k: v for k, v in record.items() if k != "digest"}).encode())
    assert run_cli(["inspect", "--verify", saved], cwd=tmp_path).returncode == 0

    # The reproduction: the order key edited by hand verified with exit 0, then sorted as the oldest.
    fs.pipe_file(commit, json.dumps({**record, "commit_order": 1}, sort_keys=True).encode())  # its digest kept
    shown = run_cli(["inspect", "--verify", saved], cwd=tmp_path)
    assert "damaged" in shown.stderr, shown.stderr
    one_line_damage(shown, commit)
    with pytest.warns(UserWarning, match="COMMIT' is damaged: its bytes do not match the digest"):
        assert newest_good_checkpoint(saved.rsplit("/", 1)[0]) is None  # damage: skipped and named, never latest


def test_a_truncated_commit_is_damage_with_exit_1_for_every_command(s3, saved, tmp_path):
    fs = s3.filesystem()
    commit = f"{saved}/COMMIT"
    payload = fs.cat_file(commit)
    fs.pipe_file(commit, payload[: len(payload) // 2])
    for argv in (["inspect", "--verify", saved], ["convert", saved, tmp_path / "out.pt", "--to", "full"]):
        one_line_damage(run_cli(argv, cwd=tmp_path), commit)
    # `clean` says in its own words that it cannot tell the committed objects from leftovers.
    one_line_damage(run_cli(["clean", saved], cwd=tmp_path), saved, hint="HINT:")
    assert not (tmp_path / "out.pt").exists()
    assert fs.cat_file(commit) == payload[: len(payload) // 2], "clean changed what it could not read"


def test_a_damaged_commit_beside_good_ones_is_skipped_as_damage_and_blocks_nothing(s3):
    """One damaged COMMIT in a run directory (cut short here) is one damaged checkpoint: it records no order that can
    be trusted, so it sorts before every checkpoint that does (as a local one with an unreadable manifest does);
    ``latest`` resumes from the good one, a save into that directory still commits above it, and retention runs.
    Before, the listing raised its damage error, so every save, ``latest`` and retention of the whole directory
    failed."""
    from test_commit_clock import _save

    from lightning_fsdp.checkpoint.latest import newest_good_checkpoint, step_checkpoints
    from lightning_fsdp.checkpoint.retention import prune

    directory = f"s3://{s3.bucket()}/run"
    step_1, step_2 = _save(directory, 1, True), _save(directory, 2, True)
    fs = s3.filesystem()
    fs.pipe_file(f"{step_2}/COMMIT", fs.cat_file(f"{step_2}/COMMIT")[:40])
    assert [str(p) for p in step_checkpoints(directory)] == [step_2, step_1]
    assert str(newest_good_checkpoint(directory)) == step_1
    step_3 = _save(directory, 3, True)
    assert [str(p) for p in step_checkpoints(directory)] == [step_2, step_1, step_3]
    assert str(newest_good_checkpoint(directory)) == step_3
    assert [str(p) for p in prune(directory, keep_last=1)] == [step_2, step_1]
    assert [str(p) for p in step_checkpoints(directory)] == [step_3]
