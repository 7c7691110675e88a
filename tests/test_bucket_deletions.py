"""Deletions in a bucket delete only what a save of this project wrote (issue 45 items 3, 4, 10, 11; issue 42 items
1, 2, 13), against the suite's S3 server (``tests/s3server.py``):

- names are plain names: ``[``, ``]``, ``*``, ``?`` in a run's name, and ``step-1`` beside ``step-10``;
- objects no save wrote (``.env``, ``.dvc/``, ``.hydra/``, ``.gitkeep``) survive saves, retention and ``clean``;
- ``clean`` says when there is nothing to clean, and fails in one line for a missing bucket or a damaged COMMIT;
- two saves racing for one URL, from two processes, under every interleaving of their steps, leave one whole
  checkpoint and a clear error for the loser; ``clean`` during a save never costs a checkpoint;
- stale staging folders of this host go, a live process's stay; incomplete multipart uploads follow the tokens.

The two-process races run a small writer (:data:`WRITER`) forked from the warm servers: it saves through the store
and stops before its COMMIT's PUT and before its clean-up, until the test says ``go``.
"""

from __future__ import annotations

import itertools
import json
import os
import queue
import socket
import subprocess
import tempfile
import threading

import pytest
import torch
import xxhash

import forkserver
from inprocess import run_cli
from launch import script_env

pytestmark = pytest.mark.single_process

HANG_S = 120  # a bound against a hung writer only: a whole interleaving took under 1 s here (2026-11-28)


@pytest.fixture()
def s3(s3_server, monkeypatch):
    s3_server.setenv(monkeypatch)
    return s3_server


_MADE: dict = {}


def _store():
    """One store per server for this process's saves and loads (a new s3fs client costs ~0.1 s); its listings are
    never cached (every listing of the store is fresh)."""
    from lightning_fsdp.checkpoint.io.remote import FsspecStore

    key = ("store", os.environ["AWS_ENDPOINT_URL"])
    if key not in _MADE:
        _MADE[key] = FsspecStore("s3", None)
    return _MADE[key]


def _client(s3):
    key = ("client", s3.endpoint)
    if key not in _MADE:
        _MADE[key] = s3.client()
    return _MADE[key]


def _commit(url: str, token: str, files: dict[str, bytes]) -> None:
    """A save of ``files`` to ``url`` in this process, as a rank-0 save makes it (check, upload, commit)."""
    from lightning_fsdp.checkpoint.io.one_process import OneProcess

    store = _store()
    url = store.target(url)  # as a save names its target
    staged = store.staging(url, token, 0)
    staged.mkdir(parents=True)
    for name, data in files.items():
        (staged / name).write_bytes(data)
    store.check_target(url, 0)
    store.commit(staged, url, OneProcess())


def _loaded(url: str) -> dict[str, bytes]:
    from lightning_fsdp.checkpoint.io.one_process import OneProcess

    with _store().open_committed(url, OneProcess()) as local:
        return {p.name: p.read_bytes() for p in sorted(local.iterdir())}


def _keys(s3, prefix: str) -> set[str]:
    """Every key under ``prefix`` (a bucket and a key prefix), listed by the server."""
    bucket, _, key = prefix.partition("/")
    pages = _client(s3).get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=key)
    return {item["Key"] for page in pages for item in page.get("Contents", [])}


# ------------------------------------------------------------------------------------------------ plain names


def test_glob_characters_and_sibling_prefixes_are_plain_names(s3):
    """Retention in `exp[1]` once deleted `exp1`'s checkpoint (a glob), and `step-1` is a prefix of `step-10`."""
    bucket = s3.bucket()
    names = ["exp1", "exp[1]", "e?p*", "step-1", "step-10"]  # as globs, the second and third match the first
    for i, name in enumerate(names):
        _commit(f"s3://{bucket}/sweep/{name}", f"{i:02x}" + "0" * 10, {"a.distcp": name.encode()})
    before = _keys(s3, f"{bucket}/sweep/")
    # A second save to `exp[1]` (its clean-up removes what it replaced), then the removal (retention,
    # ModelCheckpoint) and `clean` of each name but the ones kept.
    _commit(f"s3://{bucket}/sweep/exp[1]", "1" * 12, {"a.distcp": b"second"})
    for name in ["exp[1]", "e?p*", "step-1"]:
        _store().remove(f"s3://{bucket}/sweep/{name}")
        assert run_cli(["clean", f"s3://{bucket}/sweep/{name}", "--grace", "0"]).returncode == 0
    left = _keys(s3, f"{bucket}/sweep/")
    assert left == {k for k in before if k.startswith(("sweep/exp1/", "sweep/step-10/"))}, sorted(left)
    assert _loaded(f"s3://{bucket}/sweep/exp1") == {"a.distcp": b"exp1"}
    assert _loaded(f"s3://{bucket}/sweep/step-10") == {"a.distcp": b"step-10"}


def test_a_capital_scheme_is_the_same_url_and_the_bucket_keeps_its_case(s3):
    from lightning_fsdp.checkpoint.io.remote import FsspecStore

    assert FsspecStore("s3", None).target("S3://MyBucket/Run/") == "s3://MyBucket/Run"
    bucket = s3.bucket()
    _commit(f"S3://{bucket}/run/step-1", "0123456789ab", {"a.distcp": b"x"})
    assert _loaded(f"s3://{bucket}/run/step-1") == {"a.distcp": b"x"}
    assert _loaded(f"S3://{bucket}/run/step-1") == {"a.distcp": b"x"}


# ------------------------------------------------------------------------------------------ foreign objects


FOREIGN = {".env": b"SECRET=1", ".dvc/config": b"[core]", "run/.hydra/config.yaml": b"lr: 1",
           "run/.gitkeep": b"", "run/step-00000001/.hydra/config.yaml": b"lr: 2",
           "run/step-00000002/.0123456789/x": b"a dot-name no save makes (10 hex digits)"}


def test_foreign_dot_objects_survive_saves_retention_and_clean(s3, tmp_path):
    from lightning_fsdp.checkpoint.convert import convert
    from lightning_fsdp.checkpoint.retention import prune

    bucket = s3.bucket()
    client = _client(s3)
    for key, data in FOREIGN.items():
        client.put_object(Bucket=bucket, Key=key, Body=data)
    torch.save({"model": {"w": torch.arange(4.0)}}, tmp_path / "bare.pt")
    for step in (1, 2, 3):
        convert(tmp_path / "bare.pt", f"s3://{bucket}/run/step-0000000{step}", to="sharded")
    convert(tmp_path / "bare.pt", f"s3://{bucket}/run/step-00000001", to="sharded", overwrite=True)  # its clean-up
    assert sorted(prune(f"s3://{bucket}/run", keep_last=1)) == [f"s3://{bucket}/run/step-00000001",
                                                                f"s3://{bucket}/run/step-00000002"]
    for url in (f"s3://{bucket}", f"s3://{bucket}/run/", f"s3://{bucket}/run/step-00000001"):
        run = run_cli(["clean", url, "--grace", "0"])
        assert run.returncode == 0, run.stderr
    left = _keys(s3, bucket + "/")
    assert set(FOREIGN) <= left, sorted(set(FOREIGN) - left)
    assert {k for k in left if k.startswith("run/step-00000003/")}, "the newest checkpoint was removed"
    assert {k for k in left if k.startswith("run/step-0000000")} - {k for k in left if "step-00000003" in k} == \
        {"run/step-00000001/.hydra/config.yaml", "run/step-00000002/.0123456789/x"}


def test_clean_of_a_url_with_no_checkpoint_deletes_nothing_and_says_so(s3):
    bucket = s3.bucket()
    _client(s3).put_object(Bucket=bucket, Key="run/.gitkeep", Body=b"")
    run = run_cli(["clean", f"s3://{bucket}/run", "--grace", "0"])
    assert run.returncode == 0, run.stderr
    assert "nothing to clean" in run.stdout and "nothing was removed" in run.stdout, run.stdout
    assert _keys(s3, bucket + "/") == {"run/.gitkeep"}


def _one_line(run) -> str:
    assert run.stdout == "" and run.stderr.count("\n") == 1, run.stderr
    assert run.stderr.startswith("lightning-fsdp: error: ") and "HINT: " in run.stderr, run.stderr
    assert "Traceback" not in run.stderr
    return run.stderr


def test_clean_of_a_missing_bucket_or_a_damaged_commit_is_one_line_and_removes_nothing(s3):
    missing = run_cli(["clean", "s3://no-such-bucket-h2/run/step-1"])
    assert missing.returncode == 2 and "bucket 'no-such-bucket-h2'" in _one_line(missing)
    bucket = s3.bucket()
    client = _client(s3)
    client.put_object(Bucket=bucket, Key="run/step-1/COMMIT", Body=b"not json")
    client.put_object(Bucket=bucket, Key="run/step-1/.0123456789ab/a.distcp", Body=b"x")
    damaged = run_cli(["clean", f"s3://{bucket}/run/step-1", "--grace", "0"])
    assert damaged.returncode == 1 and "removed nothing" in _one_line(damaged)
    assert _keys(s3, bucket + "/") == {"run/step-1/COMMIT", "run/step-1/.0123456789ab/a.distcp"}
    bad = run_cli(["clean", f"s3://{bucket}/run/step-1", "--grace", "soon"])
    assert bad.returncode == 2 and "Allowed: a duration" in _one_line(bad)


def test_a_load_that_loses_its_objects_to_another_save_says_the_checkpoint_changed(s3, monkeypatch):
    """A load reads COMMIT, then another save replaces the checkpoint and removes the objects being read."""
    from lightning_fsdp.checkpoint.io.one_process import OneProcess
    from lightning_fsdp.checkpoint.io.remote import FsspecStore

    url = f"s3://{s3.bucket()}/run/step-1"
    _commit(url, "0123456789ab", {"a.distcp": b"first"})
    download = FsspecStore._download

    def racing(self, target, record, local):
        _commit(url, "ba9876543210", {"a.distcp": b"second"})  # between the load's COMMIT and its objects
        return download(self, target, record, local)

    monkeypatch.setattr(FsspecStore, "_download", racing)
    with pytest.raises(FileNotFoundError, match="changed while it was being read.*another save replaced it.*HINT"):
        with _store().open_committed(url, OneProcess()):
            pass
    monkeypatch.setattr(FsspecStore, "_download", download)
    assert _loaded(url) == {"a.distcp": b"second"}


# ------------------------------------------------------------------------------------------- staging folders


def test_stale_staging_folders_go_and_a_live_process_keeps_its_own(s3, tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    host = xxhash.xxh3_64_hexdigest(socket.gethostname().encode())[:8]
    gone = _dead_pid()
    names = {
        f"lightning-fsdp-0123456789ab-r0-h{host}-p{gone}": False,  # a killed save's
        f"lightning-fsdp-load-h{host}-p{gone}-x1y2z3": False,  # a killed load's
        f"lightning-fsdp-0123456789ab-r1-h{host}-p{os.getpid()}": True,  # this live process's
        f"lightning-fsdp-0123456789ab-r0-h{'0' * 8 if host != '0' * 8 else '1' * 8}-p{gone}": True,  # another host's
        "lightning-fsdp-0123456789ab-r0": True,  # an older release's: its owner cannot be told
    }
    for name in names:
        (tmp_path / name / "step-1").mkdir(parents=True)
    _store().staging(f"s3://{s3.bucket()}/run/step-2", "fedcba987654", 0)  # the next save removes stale ones
    kept = {name for name in names if (tmp_path / name).exists()}
    assert kept == {name for name, stays in names.items() if stays}
    (tmp_path / f"lightning-fsdp-load-h{host}-p{gone}-again").mkdir()
    run = run_cli(["clean", f"s3://{s3.bucket()}/run/step-2"])  # and so does `clean`
    assert run.returncode == 0 and f"lightning-fsdp-load-h{host}-p{gone}-again" in run.stdout, run.stdout
    assert not (tmp_path / f"lightning-fsdp-load-h{host}-p{gone}-again").exists()


def _dead_pid() -> int:
    """The id of a process that has ended (and been reaped)."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


# ---------------------------------------------------------------------------------------- multipart uploads


def test_incomplete_multipart_uploads_are_aborted_by_clean_and_the_next_save_once_stale(s3, monkeypatch):
    from lightning_fsdp.checkpoint.io import remote_clean

    bucket = s3.bucket()
    client = _client(s3)
    url = f"s3://{bucket}/run/step-1"
    _commit(url, "0123456789ab", {"a.distcp": b"x"})

    def start(key: str) -> str:
        return client.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]

    def open_uploads() -> set[str]:
        return {u["Key"] for u in client.list_multipart_uploads(Bucket=bucket).get("Uploads", [])}

    ours, other, foreign = "run/step-1/.aaaaaaaaaaaa/big.distcp", "run/step-10/.aaaaaaaaaaaa/big.distcp", \
        "run/step-1/.hydra/big.bin"
    for key in (ours, other, foreign):
        start(key)
    # A save still uploading: one object of its token is there, one large one is in parts. (moto dates every
    # upload 2010-11-10, so the fresh object is what makes this token young here; S3 dates uploads truly.)
    client.put_object(Bucket=bucket, Key="run/step-1/.aaaaaaaaaaaa/small.distcp", Body=b"x")
    run = run_cli(["clean", url])
    assert run.returncode == 0 and open_uploads() == {ours, other, foreign}, run.stdout
    run = run_cli(["clean", url, "--grace", "0"])
    assert run.returncode == 0 and f"{url}/.aaaaaaaaaaaa/big.distcp (multipart upload)" in run.stdout, run.stdout
    assert open_uploads() == {other, foreign}
    again = "run/step-1/.bbbbbbbbbbbb/big.distcp"
    start(again)
    monkeypatch.setattr(remote_clean, "GRACE_S", 0.0)
    _commit(url, "cccccccccccc", {"a.distcp": b"y"})  # the next save's clean-up
    assert open_uploads() == {other, foreign}


# ------------------------------------------------------------------------------ two processes, one URL


WRITER = r'''
import json, sys
from lightning_fsdp.checkpoint.io import remote
from lightning_fsdp.checkpoint.io.one_process import OneProcess


def say(**message):
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def pausing(original, step):
    def run(*args, **kwargs):
        say(at=step)
        assert sys.stdin.readline().strip() == "go"
        return original(*args, **kwargs)
    return run


remote.FsspecStore._put_commit = pausing(remote.FsspecStore._put_commit, "put")
if hasattr(remote.FsspecStore, "_after_commit"):
    remote.FsspecStore._after_commit = pausing(remote.FsspecStore._after_commit, "cleanup")
else:  # the code before issue 42's fix cleaned up with clean_target
    remote.clean_target = pausing(remote.clean_target, "cleanup")
for line in sys.stdin:
    job = json.loads(line)
    store = remote.FsspecStore("s3", None)
    staged = store.staging(job["url"], job["token"], 0)
    staged.mkdir(parents=True)
    for name, text in job["files"].items():
        (staged / name).write_text(text)
    try:
        store.check_target(job["url"], 0)
        store.commit(staged, job["url"], OneProcess())
    except Exception as err:
        say(done=f"{type(err).__name__}: {err}")
    else:
        say(done="ok")
'''


class _Writer:
    """A process that saves through the store, stopping before its COMMIT's PUT and before its clean-up."""

    def __init__(self, script, env):
        self.proc = subprocess.Popen([forkserver.python(), str(script)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: [self.lines.put(x) for x in self.proc.stdout], daemon=True).start()

    def send(self, text: str) -> dict:
        self.proc.stdin.write(text + "\n")
        self.proc.stdin.flush()
        try:
            return json.loads(self.lines.get(timeout=HANG_S))
        except queue.Empty:
            self.proc.kill()
            raise AssertionError(f"the writer did not answer in {HANG_S} s: {self.proc.stderr.read()[-3000:]}")

    def start(self, url: str, token: str, files: dict[str, str]) -> dict:
        return self.send(json.dumps({"url": url, "token": token, "files": files}))

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=HANG_S)
        self.proc.stdout.close()
        self.proc.stderr.close()


@pytest.fixture()
def writers(s3, tmp_path):
    (tmp_path / "writer.py").write_text(WRITER)
    env = script_env()
    pair = [_Writer(tmp_path / "writer.py", env), _Writer(tmp_path / "writer.py", env)]
    yield pair
    for writer in pair:
        writer.close()


def _step(writer: _Writer, state: dict, step: str, url: str, token: str, files: dict[str, str]) -> None:
    """One step of a save: S (check the target and upload), P (the COMMIT's PUT), C (the clean-up)."""
    if step == "S":
        state["at"] = writer.start(url, token, files)
        assert state["at"] == {"at": "put"}, state["at"]
    elif "done" not in state:
        answer = writer.send("go")
        if "done" in answer:
            state["done"] = answer["done"]
        else:
            assert answer == {"at": "cleanup"}, answer


def test_two_saves_to_one_url_leave_one_whole_checkpoint_under_every_interleaving(s3, writers):
    """Each save in three steps: S (check the target, upload), P (the COMMIT's PUT), C (the clean-up); two processes
    over a committed checkpoint. Both began before either committed: the first to commit wins and the other fails
    naming the URL and the winner; otherwise both commit in turn. Either way one whole checkpoint, the last
    committed, and nothing else is left under the URL."""
    bucket = s3.bucket()
    saves = {"A": {"a.distcp": "A" * 10, "b.distcp": "AA"}, "B": {"a.distcp": "B" * 20, "b.distcp": "BBB"}}
    # A's three steps at three of the six places; A begins first (the two writers run the same code, so the ten
    # orders where B begins first are these with the names swapped).
    for n, places in enumerate(p for p in itertools.combinations(range(6), 3) if p[0] == 0):
        order = "".join("A" if i in places else "B" for i in range(6))
        url = f"s3://{bucket}/race/{n}"
        _commit(url, f"{n:02x}" + "0" * 10, {"a.distcp": b"before"})
        tokens = {"A": f"{n:02x}" + "a" * 10, "B": f"{n:02x}" + "b" * 10}
        states = {"A": {}, "B": {}}
        for who, step in zip(order, [order[:i + 1].count(order[i]) for i in range(6)]):
            _step(writers[who == "B"], states[who], "SPC"[step - 1], url, tokens[who], saves[who])
        at = {who: [i for i, w in enumerate(order) if w == who] for who in "AB"}
        raced = at["A"][0] < at["B"][1] and at["B"][0] < at["A"][1]  # both began before either committed
        last = "A" if at["A"][1] > at["B"][1] else "B"
        winner = ("B" if last == "A" else "A") if raced else last
        loser = "B" if winner == "A" else "A"
        assert states[winner]["done"] == "ok", (order, states)
        if raced:
            error = states[loser]["done"]
            assert error.startswith("FileExistsError") and url in error and tokens[winner] in error, (order, error)
        else:
            assert states[loser]["done"] == "ok", (order, states)
        assert _loaded(url) == {k: v.encode() for k, v in saves[winner].items()}, order
        assert _keys(s3, f"{bucket}/race/{n}/") == {f"race/{n}/COMMIT"} | {
            f"race/{n}/.{tokens[winner]}/{name}" for name in saves[winner]}, order


def test_clean_during_a_save_keeps_its_objects_and_a_save_whose_objects_vanished_fails(s3, writers):
    from lightning_fsdp.checkpoint.io.remote import clean

    bucket = s3.bucket()
    writer = writers[0]
    url = f"s3://{bucket}/run/step-1"
    _commit(url, "000000000000", {"a.distcp": b"before"})
    state: dict = {}
    _step(writer, state, "S", url, "aaaaaaaaaaaa", {"a.distcp": "new"})
    assert clean(url) == [] and clean(url).kept == [f"{url}/.aaaaaaaaaaaa"]  # uploading: too young to be abandoned
    _step(writer, state, "P", url, "", {})
    _step(writer, state, "C", url, "", {})
    assert state["done"] == "ok" and _loaded(url) == {"a.distcp": b"new"}

    state = {}
    _step(writer, state, "S", url, "bbbbbbbbbbbb", {"a.distcp": "newer"})
    assert clean(url, grace_s=0) == [f"{url}/.bbbbbbbbbbbb"]  # told to: the save in flight loses its objects
    _step(writer, state, "P", url, "", {})
    assert state["done"].startswith("FileNotFoundError") and "gone or changed" in state["done"], state
    assert _loaded(url) == {"a.distcp": b"new"}  # the previous checkpoint stands, whole


@pytest.mark.parametrize("client", ["obstore", "s3fs"])
def test_a_streamed_load_whose_small_objects_another_process_removes_says_the_checkpoint_changed(
        s3, writers, monkeypatch, client):
    """Two processes: this one loads a sharded checkpoint by ranges (COMMIT, then `.metadata`, `checksums.json` and
    `meta.pt` side by side); between its COMMIT and those GETs, a writer process replaces the checkpoint and its
    clean-up removes the objects being read. Through obstore and through s3fs alike, the load says the checkpoint
    changed while it was read (never a bare missing-object error), and the new checkpoint is whole."""
    from lightning_fsdp.checkpoint.io import remote_download, transport_download
    from lightning_fsdp.checkpoint.io.one_process import OneProcess

    if client == "s3fs":
        monkeypatch.setenv(transport_download.VARIABLE, "s3fs")
    url = f"s3://{s3.bucket()}/run/step-{client}"
    small = {".metadata": b"m" * 40, "checksums.json": b"{}", "meta.pt": b"p" * 30, "__0_0.distcp": b"x" * 50}
    _commit(url, "0123456789ab", small)
    fetch_small, raced = remote_download.fetch_small, []

    def racing(fs, target, record):
        if not raced:  # the first read only: the retry reads the new COMMIT's objects
            state: dict = {}
            for step in "SPC":
                _step(writers[0], state, step, url, "ba9876543210", {n: "second" for n in small})
            raced.append(state["done"])
        return fetch_small(fs, target, record)

    monkeypatch.setattr(remote_download, "fetch_small", racing)
    with pytest.raises(FileNotFoundError, match="changed while it was being read.*another save replaced it.*HINT"):
        with _store().open_committed(url, OneProcess()):
            pass
    assert raced == ["ok"], raced
    monkeypatch.setattr(remote_download, "fetch_small", fetch_small)
    # The new COMMIT's small objects (a streamed load lays out only those; its shards are read by ranges).
    assert _loaded(url) == {n: b"second" for n in small if not n.endswith(".distcp")}
