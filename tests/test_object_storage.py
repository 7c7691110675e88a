"""Checkpoints on object storage (issue 38): the store layer on ``memory://`` in this process, and two-rank saves and
loads against a real S3 server (moto's, in this process) in one launch (``workers/object_storage.py``)."""

from __future__ import annotations

import pytest

import s3server
from launch import case_tests, torchrun, worker_env
from lightning_fsdp.checkpoint.io.one_process import OneProcess

CASES = [
    "sharded_save_and_load_in_a_bucket_are_exact",
    "full_save_and_load_in_a_bucket_are_exact",
    "async_save_to_a_bucket_uploads_in_the_background_and_loads_exactly",
    "a_second_save_to_the_same_url_replaces_the_first_and_removes_its_objects",
    "a_flipped_byte_in_an_object_is_refused_on_every_rank_naming_the_url",
    "a_missing_bucket_is_one_clear_error_on_every_rank",
    "step_checkpoints_in_a_bucket_keep_the_last_two_and_latest_loads_the_newest",
    "trainer_model_checkpoint_in_a_bucket_resumes_exactly",
    "a_background_upload_that_fails_on_one_rank_is_raised_on_every_rank_and_keeps_the_previous_checkpoint",
]


# In the launch pool of the scripts that work against the session's S3 server (``s3server.pool_env``, which starts the
# server when the pool's turn comes, in the background): with ``workers/streaming_full.py``, one launch for both.
results, test_two_ranks_against_s3 = case_tests("object_storage.py", 2, CASES, env_from=s3server.pool_env)


@pytest.mark.parametrize("mode", ["new", "over"])
def test_a_rank_killed_mid_upload_leaves_the_previous_step_loadable_exactly(s3_server, tmp_path, mode):
    """Rank 1 dies half-way through uploading its shard, saving step 2 to a new path or over step 1: step 1 stays
    committed and whole (never a mix of two saves), `latest` finds it, and it holds step 1's weights exactly."""
    import subprocess

    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from lightning_fsdp.checkpoint.integrity.verify import verify_checkpoint
    from lightning_fsdp.checkpoint.io.store import store_for
    from lightning_fsdp.checkpoint.latest import newest_good_checkpoint

    directory = f"s3://{s3_server.bucket()}/run"
    out = tmp_path / "out"
    env = worker_env(out, **s3_server.env, LFSDP_KILL_DIR=directory, LFSDP_KILL_MODE=mode)
    proc = subprocess.run(torchrun("object_storage_kill.py", 2), env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "the save returned" not in proc.stdout + proc.stderr, proc.stderr[-3000:]
    assert (out / "killed.rank1").is_file(), proc.stderr[-3000:]  # rank 1 died with a request cut off mid-body
    # Issue 42 item 7: the survivor's error names the URL it was saving to, the rank that died and the fix.
    error = (out / "error.rank0.txt").read_text()
    url = f"{directory}/step-0000000{2 if mode == 'new' else 1}"
    assert f"{url!r} failed: " in error and "rank 1" in error and "HINT:" in error, error
    options = {"endpoint_url": s3_server.endpoint, "key": "testing", "secret": "testing"}
    store = store_for(directory, options)
    listed = store.fs.find(directory)
    found = newest_good_checkpoint(directory, options)
    assert found == f"{directory}/step-00000001", (found, listed)
    with store.local_copy(found) as local:  # every object: verified and converted as files
        assert verify_checkpoint(local)
        dcp_to_torch_save(local, tmp_path / "step1_loaded.pt")
    loaded = torch.load(tmp_path / "step1_loaded.pt", weights_only=False)["model"]
    expected = torch.load(out / "step1.pt")
    assert loaded.keys() == expected.keys() and all(torch.equal(loaded[k], expected[k]) for k in expected)


# ------------------------------------------------------------------------------------------- memory://, one process


_Alone = OneProcess  # the collectives of one process: what a save or load needs from ``comm``


def _stage(store, url, token, files):
    from lightning_fsdp.checkpoint.io.remote import FsspecStore  # noqa: F401 - the store under test

    staged = store.staging(url, token, 0)
    staged.mkdir(parents=True)
    for name, data in files.items():
        (staged / name).write_bytes(data)
    return staged


def _read(store, url):
    with store.open_committed(url, _Alone()) as local:
        return {p.name: p.read_bytes() for p in sorted(local.iterdir())}


@pytest.fixture
def memory_url(request):
    import fsspec

    url = f"memory://bucket/{request.node.name[:40]}/ckpt"
    yield url
    fsspec.filesystem("memory").store.clear()


def test_a_commit_is_read_whole_and_a_crashed_save_over_it_is_never_read(memory_url):
    from lightning_fsdp.checkpoint.io.store import store_for

    store = store_for(memory_url)
    store.commit(_stage(store, memory_url, "aaaaaaaaaaaa", {"a.distcp": b"old-a", "b.distcp": b"old-b"}), memory_url,
                 _Alone())
    assert _read(store, memory_url) == {"a.distcp": b"old-a", "b.distcp": b"old-b"}
    # A save over it that dies after uploading one of its two objects, before its commit (the mix DCP's
    # FsspecWriter loads without error): the committed save is read, whole.
    store.fs.pipe_file(f"{memory_url}/.bbbbbbbbbbbb/a.distcp", b"new-a")
    assert _read(store, memory_url) == {"a.distcp": b"old-a", "b.distcp": b"old-b"}
    # The next save commits, and removes the previous save's objects; the crashed one's stay until they are older
    # than the grace period (young, they may be a save still uploading: remote_clean.GRACE_S).
    store.commit(_stage(store, memory_url, "cccccccccccc", {"a.distcp": b"c-a", "b.distcp": b"c-b"}), memory_url,
                 _Alone())
    assert _read(store, memory_url) == {"a.distcp": b"c-a", "b.distcp": b"c-b"}
    listed = sorted(p.rsplit("/", 1)[-1] for p in store.fs.ls(memory_url, detail=False))
    assert listed == [".bbbbbbbbbbbb", ".cccccccccccc", "COMMIT"]


def test_uncommitted_objects_alone_are_no_checkpoint_and_clean_removes_them(memory_url):
    from lightning_fsdp.checkpoint.io.remote import clean
    from lightning_fsdp.checkpoint.io.store import store_for

    store = store_for(memory_url)
    store.fs.pipe_file(f"{memory_url}/.dddddddddddd/a.distcp", b"half")
    with pytest.raises(FileNotFoundError, match="holds no committed checkpoint.*HINT"):
        _read(store, memory_url)
    assert clean(memory_url) == []  # young: it may be a save still uploading
    assert clean(memory_url, grace_s=0) == [f"{memory_url}/.dddddddddddd"]
    assert not store.fs.exists(memory_url)


def test_damage_in_an_object_is_refused_naming_its_url(memory_url):
    from lightning_fsdp.checkpoint.integrity.digests import ChecksumError
    from lightning_fsdp.checkpoint.io.store import store_for

    store = store_for(memory_url)
    store.commit(_stage(store, memory_url, "eeeeeeeeeeee", {"a.distcp": b"0123456789"}), memory_url, _Alone())
    store.fs.pipe_file(f"{memory_url}/.eeeeeeeeeeee/a.distcp", b"0123456780")
    with pytest.raises(ChecksumError, match=r"\.eeeeeeeeeeee/a\.distcp' is damaged"):
        _read(store, memory_url)
    store.fs.pipe_file(f"{memory_url}/.eeeeeeeeeeee/a.distcp", b"012345678")
    with pytest.raises(ChecksumError, match="9 bytes, its commit records 10"):
        _read(store, memory_url)


def test_a_stale_cached_listing_does_not_decide_what_is_committed(memory_url):
    from lightning_fsdp.checkpoint.io.store import store_for

    store = store_for(memory_url)
    directory = memory_url.rsplit("/", 1)[0]
    assert store.checkpoints_in(directory) == []
    listing = store.fs.ls
    # A filesystem whose listing is stale: it still shows nothing (as a cached listing would)...
    store.fs.ls = lambda path, detail=False, **kw: []
    try:
        store.commit(_stage(store, memory_url, "ffffffffffff", {"a.distcp": b"x"}), memory_url, _Alone())
        # ...and the load still finds the commit, read by its name, not from a listing.
        assert _read(store, memory_url) == {"a.distcp": b"x"}
    finally:
        store.fs.ls = listing
    assert [name for name, _, _ in store.checkpoints_in(directory)] == ["ckpt"]


@pytest.mark.parametrize("failures, error", [(2, None), (99, ConnectionError)])
def test_transient_server_errors_are_retried_then_fail_clearly(memory_url, monkeypatch, failures, error):
    from lightning_fsdp.checkpoint.io import remote_errors
    from lightning_fsdp.checkpoint.io.store import store_for

    monkeypatch.setattr(remote_errors, "BACKOFF_S", 0.0)
    monkeypatch.setattr(remote_errors, "ATTEMPTS", 4)  # without waits, the bound alone would retry for its 60 s
    store = store_for(memory_url)
    put = store.fs.put
    calls = []

    def flaky(*args, **kwargs):
        calls.append(1)
        if len(calls) <= failures:
            raise OSError("An error occurred (SlowDown) when calling the PutObject operation: 503 Slow Down")
        return put(*args, **kwargs)

    monkeypatch.setattr(store.fs, "put", flaky)
    staged = _stage(store, memory_url, "111111111111", {"a.distcp": b"x"})
    if error is None:
        store.commit(staged, memory_url, _Alone())
        assert _read(store, memory_url) == {"a.distcp": b"x"} and len(calls) == 3
    else:
        with pytest.raises(ConnectionError, match=f"'{memory_url}'.*after 4 attempts.*SlowDown.*HINT"):
            store.commit(staged, memory_url, _Alone())
        assert len(calls) == 4 and store.read_commit(memory_url) is None


def test_denied_access_names_the_credentials(memory_url, monkeypatch):
    from lightning_fsdp.checkpoint.io.store import store_for

    store = store_for(memory_url)

    def denied(*args, **kwargs):
        raise PermissionError("An error occurred (InvalidAccessKeyId) when calling the PutObject operation")

    monkeypatch.setattr(store.fs, "put", denied)
    with pytest.raises(PermissionError, match=f"Access to '{memory_url}' was refused.*HINT.*AWS_ACCESS_KEY_ID"):
        store.commit(_stage(store, memory_url, "222222222222", {"a": b"x"}), memory_url, _Alone())


def test_a_missing_filesystem_package_names_the_extra(monkeypatch):
    """gcsfs made missing whether or not it is installed here (None in sys.modules fails its import), and forgotten
    by fsspec's registry of imported filesystems."""
    import importlib
    import sys

    from lightning_fsdp.checkpoint.io.urls import filesystem

    imported = importlib.import_module("fsspec.registry")._registry  # `fsspec.registry` is the read-only view

    monkeypatch.setitem(sys.modules, "gcsfs", None)
    for protocol in ("gs", "gcs"):
        monkeypatch.delitem(imported, protocol, raising=False)
    with pytest.raises(ImportError, match=r'needs the package .gcsfs.*pip install "lightning-fsdp\[gcs\]"'):
        filesystem("gs://bucket/ckpt")


def test_storage_options_must_be_a_dict():
    from lightning_fsdp.engine.config import FSDPConfig

    with pytest.raises(TypeError, match=r"Invalid `storage_options='http://x'`.*Allowed.*HINT"):
        FSDPConfig.from_arguments(storage_options="http://x")
    assert FSDPConfig.from_arguments(storage_options={"anon": False}).storage_options_dict == {"anon": False}


def test_a_superseded_checkpoint_at_a_url_is_removed_through_its_store(memory_url):
    """``ModelCheckpoint(save_top_k=...)`` removes old checkpoints through ``strategy.remove_checkpoint``, which
    hands a URL to the background saves' deferred removals: the commit goes first, then the objects."""
    from lightning_fsdp.checkpoint.save import AsyncSaves
    from lightning_fsdp.checkpoint.io.store import store_for

    store = store_for(memory_url)
    store.commit(_stage(store, memory_url, "333333333333", {"a.distcp": b"x"}), memory_url, _Alone())
    AsyncSaves().remove(memory_url)
    assert store.read_commit(memory_url) is None and not store.fs.exists(memory_url)


def test_convert_reads_from_and_writes_to_urls(memory_url, tmp_path):
    """``convert`` from a local full file to a sharded checkpoint at a URL, and from that URL back to a local file."""
    import torch

    from lightning_fsdp.checkpoint.convert import convert
    from lightning_fsdp.checkpoint.io.readers import UsageError
    from lightning_fsdp.checkpoint.io.store import store_for

    weights = {"fc.weight": torch.arange(12.0).reshape(3, 4), "fc.bias": torch.tensor([1.0, -2.0, 3.0])}
    torch.save({"model": weights, "step": 7}, tmp_path / "full.pt")
    assert convert(tmp_path / "full.pt", memory_url, to="sharded") == memory_url
    assert store_for(memory_url).read_commit(memory_url)["kind"] == "sharded"
    convert(memory_url, tmp_path / "back.pt", to="full")
    back = torch.load(tmp_path / "back.pt", weights_only=True)
    assert back["step"] == 7 and all(torch.equal(back["model"][k], weights[k]) for k in weights)
    with pytest.raises(UsageError, match="already exists.*HINT"):  # bad input, as the command line's status 2 says
        convert(tmp_path / "full.pt", memory_url, to="sharded")


def test_missing_credentials_are_one_clear_error_naming_the_fix(s3_server, monkeypatch, tmp_path):
    """No credentials anywhere (no variables, no config file, no instance metadata) against a real S3 endpoint."""
    from lightning_fsdp.checkpoint.io.remote import FsspecStore

    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    url = f"s3://{s3_server.bucket()}/run/step-1"
    store = FsspecStore("s3", {"endpoint_url": s3_server.endpoint, "client_kwargs": {"region_name": "us-east-1"}})
    with pytest.raises(PermissionError, match=f"Access to '{url}' was refused.*HINT.*AWS_ACCESS_KEY_ID"):
        store.commit(_stage(store, url, "444444444444", {"a.distcp": b"x"}), url, _Alone())


def test_an_unreachable_endpoint_is_a_network_error_not_a_missing_bucket(monkeypatch):
    """`fs.exists` answers False when nothing listens: the check must not turn that into "the bucket does not
    exist" (a wrong fix to suggest), but say the store could not be reached and name the endpoint to check."""
    from lightning_fsdp.checkpoint.io import remote, remote_errors

    monkeypatch.setattr(remote_errors, "BACKOFF_S", 0.0)
    monkeypatch.setattr(remote_errors, "ATTEMPTS", 4)  # without waits, the bound alone would retry for its 60 s
    store = remote.FsspecStore("s3", {"endpoint_url": "http://127.0.0.1:1", "key": "k", "secret": "s",
                                      "config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 1}})
    url = "s3://ckpt/run/step-1"
    with pytest.raises(ConnectionError, match=f"The store at '{url}' failed while checking it.*AWS_ENDPOINT_URL"):
        store.check_target(url, 0)


def test_a_load_from_a_missing_bucket_names_the_bucket(s3_server, monkeypatch):
    from lightning_fsdp.checkpoint.io.remote import FsspecStore

    s3_server.setenv(monkeypatch)
    url = "s3://no-such-bucket/run/step-1"
    store = FsspecStore("s3", {"endpoint_url": s3_server.endpoint})
    with pytest.raises(FileNotFoundError, match="The bucket 'no-such-bucket' of .* does not exist.*HINT"):
        with store.open_committed(url, _Alone()):
            pass
