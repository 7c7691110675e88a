"""Sharded saves to object storage stream from memory (issue 43 items 1 and 5): each rank's shard file goes from its
tensors into a multipart upload, with nothing on local disk but rank 0's small files; the result verifies, loads
with plain DCP after a download, and records the block digests of ``checksums.json``'s ``"payloads"``. In this
process, on one rank (``OneProcess``) against the suite's S3 server; the kill of a rank mid-multipart at world 2 has
a launch of its own (it must own its processes)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from lightning_fsdp.checkpoint.io.one_process import OneProcess
from lightning_fsdp.checkpoint.io.transfers import Transfers, set_transfers, transfers

P = 64 * 1024  # a part size below S3's minimum, so that a tiny shard is several parts (moto's minimum is lowered)


@pytest.fixture
def small_parts(monkeypatch):
    import moto.s3.models

    monkeypatch.setattr(moto.s3.models, "S3_UPLOAD_PART_MIN_SIZE", P)  # the server runs in this process
    before = transfers()
    set_transfers(Transfers(part_size=P, parts_in_flight=2))
    try:
        yield
    finally:
        set_transfers(before)


def _state():
    torch.manual_seed(0)
    return {
        "w": torch.randn(400, 300),  # 480 KB: several parts, one item of several blocks
        "b": torch.randn(300),
        "h": torch.randn(64, 64).to(torch.bfloat16),
        "view": torch.randn(200)[10:60],  # its storage is larger than itself: saved as exactly its own bytes
        "t": torch.randn(30, 20).t(),  # not contiguous
    }


@pytest.mark.single_process
def test_a_sharded_save_to_s3_streams_and_loads_exactly_with_plain_dcp(s3_server, monkeypatch, small_parts, tmp_path):
    import torch.distributed.checkpoint as dcp

    from lightning_fsdp.checkpoint.integrity.digests import ALGORITHMS
    from lightning_fsdp.checkpoint.integrity.verify import verify_checkpoint
    from lightning_fsdp.checkpoint.io import remote_upload
    from lightning_fsdp.checkpoint.save import write_sharded

    s3_server.setenv(monkeypatch)
    url = f"s3://{s3_server.bucket()}/run/step-1"
    staged_files: list[tuple[str, int]] = []
    upload = remote_upload.upload

    def watching(fs, staged, target, token):  # what is on local disk when the commit uploads (then it is removed)
        staged_files.extend((p.name, p.stat().st_size) for p in Path(staged).rglob("*") if p.is_file())
        return upload(fs, staged, target, token)

    monkeypatch.setattr(remote_upload, "upload", watching)
    state = _state()
    write_sharded(url, {"model": state}, {"step": 3}, OneProcess())
    # Local disk: rank 0's small files only (the old code staged the whole shard, `__0_0.distcp`, here).
    assert sorted(name for name, _ in staged_files) == [".metadata", "checksums.json", "meta.pt"], staged_files
    assert sum(size for _, size in staged_files) < 16 * 1024

    fs = s3_server.filesystem()
    record = json.loads(fs.cat_file(f"{url}/COMMIT"))
    size, digest = record["objects"]["__0_0.distcp"]
    assert size > 3 * P and digest is not None  # several parts; small objects keep their digest in COMMIT
    local = tmp_path / "copy"
    local.mkdir()
    for name in record["objects"]:
        fs.get(f"{url}/.{record['token']}/{name}", str(local / name))
    assert verify_checkpoint(local)  # every item digest and the bound files, as a local checkpoint is checked
    loaded = {"model": {k: torch.zeros_like(v) for k, v in state.items()}}
    dcp.load(loaded, storage_reader=dcp.FileSystemReader(local), no_dist=True)
    assert all(torch.equal(loaded["model"][k], state[k]) for k in state)

    # "payloads": per tensor item, where its raw bytes start and the digests of their blocks, seeded as items are.
    manifest = json.loads((local / "checksums.json").read_bytes())
    new_hasher = ALGORITHMS[manifest["algorithm"]][1]
    seed = ALGORITHMS[manifest["algorithm"]][0](manifest["save_id"])
    by_offset = {(file, offset): length for file, offset, length, _, _ in manifest["items"]}
    raw = {tuple(v.shape): v.contiguous() for v in state.values()}
    assert len(manifest["payloads"]) == len(state)
    for file, offset, start, block, digests in manifest["payloads"]:
        assert file.startswith("__0_") and block == 64 * 1024  # a shard of a few parts is one object per part
        shard = (local / file).read_bytes()
        payload = shard[offset + start:offset + by_offset[file, offset]]
        tensor = torch.load(__import__("io").BytesIO(shard[offset:offset + by_offset[file, offset]]), weights_only=True)
        length = tensor.numel() * tensor.element_size()
        assert payload[:length] == raw[tuple(tensor.shape)].view(torch.uint8).numpy().tobytes()
        expected = []
        for i in range(0, length, block):
            hasher = new_hasher(seed)
            hasher.update(payload[i:min(i + block, length)])
            expected.append(hasher.intdigest())
        assert digests == expected and len(digests) == -(-length // block)


@pytest.mark.single_process
def test_a_failed_streamed_write_leaves_the_previous_checkpoint_and_no_upload(s3_server, monkeypatch, small_parts):
    from lightning_fsdp.checkpoint.integrity import streaming_write
    from lightning_fsdp.checkpoint.io.store import store_for
    from lightning_fsdp.checkpoint.save import write_sharded

    s3_server.setenv(monkeypatch)
    bucket = s3_server.bucket()
    url = f"s3://{bucket}/run/step-1"
    write_sharded(url, {"model": _state()}, {"step": 1}, OneProcess())
    committed = store_for(url).read_commit(url)
    calls = [0]
    save = torch.save

    def failing(obj, f, *args, **kwargs):  # the fourth item fails, after several parts went out
        calls[0] += 1
        if calls[0] == 4:
            raise OSError("device lost")
        return save(obj, f, *args, **kwargs)

    monkeypatch.setattr(streaming_write.torch, "save", failing)
    with pytest.raises(OSError, match="device lost"):
        write_sharded(url, {"model": _state()}, {"step": 2}, OneProcess())
    assert store_for(url).read_commit(url) == committed
    assert s3_server.client().list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []
    listed = {p.rsplit("/", 2)[-2] for p in s3_server.filesystem().find(url)}
    assert listed == {"step-1", "." + committed["token"]}  # the failed save's objects are gone


@pytest.mark.single_process
def test_transfer_arguments_are_checked_with_the_argument_range_and_fix():
    from lightning_fsdp.engine.config import FSDPConfig
    from lightning_fsdp.fabric import FSDPStrategy
    from lightning_fsdp.trainer import FSDPStrategy as TrainerStrategy

    config = FSDPConfig.from_arguments(part_size=16 * 2**20, parts_in_flight=8)
    assert config.transfer_arguments == {"part_size": 16 * 2**20, "parts_in_flight": 8}
    for front in (FSDPStrategy, TrainerStrategy):
        assert front(range_size=2**20, ranges_in_flight=3).config.transfer_arguments == {
            "range_size": 2**20, "ranges_in_flight": 3}
    with pytest.raises(ValueError, match=r"Invalid `part_size=1000`\. Allowed: an integer from 5242880 to 5368709120"
                                         r" \(bytes per upload part.*HINT: leave it out for the default \(8388608\)"):
        FSDPStrategy(part_size=1000)
    with pytest.raises(ValueError, match=r"Invalid `parts_in_flight=True`.*from 1 to 64.*HINT"):
        TrainerStrategy(parts_in_flight=True)
    with pytest.raises(ValueError, match=r"Invalid `range_size='32MB'`.*HINT"):
        FSDPConfig.from_arguments(range_size="32MB")


@pytest.mark.single_process
def test_a_save_sets_the_strategy_transfer_sizes(monkeypatch):
    from lightning_fsdp.fabric import FSDPStrategy

    before = transfers()
    try:
        strategy = FSDPStrategy(part_size=6 * 2**20, parts_in_flight=3)
        set_transfers(Transfers())
        strategy._storage_options(None)  # what every save, load and removal of the strategy calls first
        assert (transfers().part_size, transfers().parts_in_flight) == (6 * 2**20, 3)
    finally:
        set_transfers(before)


@pytest.mark.parametrize("mode", ["new", "over"])
def test_a_rank_killed_mid_multipart_leaves_the_previous_step_loadable_exactly(s3_server, tmp_path, small_parts, mode):
    """Rank 1 dies in the middle of its shard's third upload part (world 2): step 1 stays committed and loads
    exactly, the survivor's error names the URL, the dead rank and the fix, and rank 0 removes what the failed save
    left under its token (the other rank's completed object, and the dead rank's multipart upload, aborted)."""
    from launch import torchrun, worker_env
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from lightning_fsdp.checkpoint.latest import newest_good_checkpoint

    bucket = s3_server.bucket()
    directory = f"s3://{bucket}/run"
    out = tmp_path / "out"
    env = worker_env(out, **s3_server.env, LFSDP_KILL_DIR=directory, LFSDP_KILL_MODE=mode, LFSDP_PART_SIZE=str(P))
    proc = subprocess.run(torchrun("streaming_save_kill.py", 2), env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "the save returned" not in proc.stdout + proc.stderr, proc.stderr[-3000:]
    assert (out / "killed.rank1").is_file(), proc.stderr[-3000:]
    error = (out / "error.rank0.txt").read_text()
    url = f"{directory}/step-0000000{2 if mode == 'new' else 1}"
    assert f"{url!r} failed: " in error and "rank 1" in error and "HINT:" in error, error
    options = {"endpoint_url": s3_server.endpoint, "key": "testing", "secret": "testing"}
    assert newest_good_checkpoint(directory, options) == f"{directory}/step-00000001"
    fs = s3_server.filesystem()
    record = json.loads(fs.cat_file(f"{directory}/step-00000001/COMMIT"))
    tokens = {p.split("/")[3] for p in fs.find(directory) if p.split("/")[3].startswith(".")}
    assert tokens == {"." + record["token"]}, tokens  # nothing of the failed save is left
    assert s3_server.client().list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []
    local = tmp_path / "step1"
    local.mkdir()
    for name in record["objects"]:
        fs.get(f"{directory}/step-00000001/.{record['token']}/{name}", str(local / name))
    dcp_to_torch_save(local, tmp_path / "step1.pt")
    loaded = torch.load(tmp_path / "step1.pt", weights_only=False)["model"]
    expected = torch.load(out / "step1.pt")
    assert loaded.keys() == expected.keys() and all(torch.equal(loaded[k], expected[k]) for k in expected)


@pytest.mark.single_process
def test_clean_aborts_the_multipart_upload_a_dead_process_left(s3_server, monkeypatch, small_parts):
    """A whole job killed mid-save leaves an incomplete multipart upload (nobody aborts it): `clean` aborts it."""
    from lightning_fsdp.checkpoint.io import sink as sink_module
    from lightning_fsdp.checkpoint.io.remote import clean
    from lightning_fsdp.checkpoint.io.urls import filesystem

    bucket = s3_server.bucket()
    url = f"s3://{bucket}/run/step-1"
    options = {"endpoint_url": s3_server.endpoint, "key": "testing", "secret": "testing"}
    monkeypatch.setattr(sink_module.UploadSink, "_abort", lambda self: None)  # the process dies: no abort is sent
    with pytest.raises(RuntimeError, match="killed"):
        with sink_module.open_upload(filesystem("s3://", options), f"{url}/.aaaaaaaaaaaa/__0_0.distcp") as sink:
            sink.write(b"x" * (2 * P + 1))
            raise RuntimeError("killed")
    client = s3_server.client()
    assert len(client.list_multipart_uploads(Bucket=bucket).get("Uploads", [])) == 1
    # (moto dates every multipart upload 2010-11-10, so its age cannot show that a young one is kept here.)
    clean(url, options, grace_s=0)
    assert client.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []


@pytest.mark.single_process
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8, torch.float64, torch.bool])
def test_the_payload_start_found_from_the_zip_ends_is_where_the_tensor_bytes_are(dtype):
    """What the writer finds from an item's first and last 64 KiB (it never holds the item whole) is where
    `zipfile` says `data/0` starts, and the tensor's raw bytes are there."""
    import io
    import zipfile

    import xxhash

    from lightning_fsdp.checkpoint.integrity.streaming_write import _ItemTee, payload_start

    for shape in [(1,), (3, 5, 7), (300, 257)]:
        tensor = (torch.randn(shape) * 100).to(dtype)
        out = io.BytesIO()
        tee = _ItemTee(out, xxhash.xxh3_64())
        torch.save(tensor, tee)
        item = out.getvalue()
        assert tee.size == len(item) and tee.hasher.intdigest() == xxhash.xxh3_64_intdigest(item)
        size = tensor.numel() * tensor.element_size()
        start = payload_start(tee.head, tee.tail, len(item), size)
        with zipfile.ZipFile(io.BytesIO(item)) as archive:
            record = next(i for i in archive.infolist() if i.filename.endswith("/data/0"))
            assert archive.read(record) == item[start:start + size]
        assert item[start:start + size] == tensor.view(torch.uint8).numpy().tobytes()
        assert payload_start(tee.head, tee.tail, len(item), size + 1) is None  # not the tensor's size: read whole


@pytest.mark.single_process
def test_a_listing_that_lags_behind_the_streamed_objects_does_not_fail_the_commit(s3_server, monkeypatch):
    """The commit checks that every object it names is there with its size: what a lagging listing lacks is asked
    for by name (HEAD), so a save is not failed by a listing; an object truly gone still fails it."""
    from lightning_fsdp.checkpoint.io import remote_clean
    from lightning_fsdp.checkpoint.io.urls import filesystem

    bucket = s3_server.bucket()
    fs = filesystem("s3://", {"endpoint_url": s3_server.endpoint, "key": "testing", "secret": "testing"})
    target = f"s3://{bucket}/run/step-1"
    fs.pipe_file(f"{target}/.aaaaaaaaaaaa/__0_0.distcp", b"x" * 10)
    fs.pipe_file(f"{target}/.aaaaaaaaaaaa/__1_0.distcp", b"y" * 20)
    listed = remote_clean.objects_under

    def lagging(fs, prefix):  # the listing has not caught up with rank 1's object yet
        found = listed(fs, prefix)
        found.sizes = {k: v for k, v in found.sizes.items() if not k.endswith("__1_0.distcp")}
        return found

    monkeypatch.setattr(remote_clean, "objects_under", lagging)
    remote_clean.check_uploaded(fs, target, "aaaaaaaaaaaa", {"__0_0.distcp": [10, None], "__1_0.distcp": [20, None]})
    with pytest.raises(FileNotFoundError, match=r"1 of the 3 objects .* are gone or changed.*'__2_0.distcp'.*HINT"):
        remote_clean.check_uploaded(fs, target, "aaaaaaaaaaaa", {"__0_0.distcp": [10, None],
                                                                 "__1_0.distcp": [20, None],
                                                                 "__2_0.distcp": [5, None]})
