"""What a save to object storage pays besides its bytes (issue 43 item 6): the cyclic collector is paused while a
save runs (a full collection of the whole process cost a quarter of a sharded save), and the part buffers of the
upload sink are kept for the next save instead of being allocated, zero-filled and faulted in again each time."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest

pytestmark = pytest.mark.single_process


class _Marker(Exception):
    pass


@pytest.mark.parametrize("entry", ["save_checkpoint", "write_sharded", "write_full"])
def test_a_save_runs_with_the_cyclic_collector_paused_and_restores_it(monkeypatch, entry):
    from lightning_fsdp.checkpoint import save

    seen = []

    def first_step(*args, **kwargs):
        seen.append(gc.isenabled())
        raise _Marker(entry)

    # The first thing each entry does past its arguments: build the state (save_checkpoint) or take the guard.
    monkeypatch.setattr(save, "split_state", first_step)

    class _Comm:
        def guard(self, what):
            first_step()

    calls = {
        "save_checkpoint": lambda: save.save_checkpoint(Path("unused"), {}, full=False, comm=_Comm()),
        "write_sharded": lambda: save.write_sharded(Path("unused"), {}, {}, _Comm()),
        "write_full": lambda: save.write_full(Path("unused"), {}, _Comm()),
    }
    assert gc.isenabled()
    with pytest.raises(_Marker):
        calls[entry]()
    assert seen == [False] and gc.isenabled()
    gc.disable()  # a caller that paused it itself keeps it paused
    try:
        with pytest.raises(_Marker):
            calls[entry]()
        assert not gc.isenabled()
    finally:
        gc.enable()


class _FakeS3:
    """Just enough of s3fs for the sink's single PUTs: records which buffer each PUT's body was read from."""

    def __init__(self, deny: str = "") -> None:
        from fsspec.asyn import get_loop

        self.loop = get_loop()
        self.buffers: list[int] = []
        self.deny = deny

    def split_path(self, url):
        bucket, key = url.split("://", 1)[-1].split("/", 1)
        return bucket, key, None

    async def _call_s3(self, method, **kw):
        import asyncio

        await asyncio.sleep(0.005)  # the writer gets ahead: several buffers are in use at once
        if method == "put_object":
            if kw["Key"] == self.deny:
                raise PermissionError(f"AccessDenied {kw['Key']}")
            self.buffers.append(id(kw["Body"].view.obj))
        return {}


def _shard(fs, objects: int, part: int) -> None:
    from lightning_fsdp.checkpoint.io import sink

    with sink.ShardUpload(fs, lambda name: f"s3://b/{name}", "__0_0.distcp", size_hint=objects * part) as shard:
        for i in range(objects):
            if i:
                shard.next_object(f"__0_{i}.distcp")
            shard.write(b"x" * (part - 7))


def test_part_buffers_are_kept_for_the_next_save_within_one_sinks_bound():
    from lightning_fsdp.checkpoint.io import sink
    from lightning_fsdp.checkpoint.io.transfers import Transfers, set_transfers, transfers

    before = transfers()
    part, window = 64 * 1024, 2
    set_transfers(Transfers(part_size=part, parts_in_flight=window))  # unchecked: below S3's part minimum
    sink.release_buffers()
    try:
        first = _FakeS3()
        _shard(first, 8, part)
        kept = list(sink._KEPT)
        # What one sink holds at most while it runs, and no more, of the part size in use.
        assert 1 <= len(kept) <= window + 1 and all(len(b) == part for b in kept)
        second = _FakeS3()
        _shard(second, 8, part)
        # The second save sent from the first one's buffers only: none allocated (before: a new set per save).
        assert len(second.buffers) == 8 and set(second.buffers) <= set(map(id, kept)), (second.buffers, kept)
        assert len(sink._KEPT) <= window + 1
        failing = _FakeS3(deny="__0_3.distcp")
        with pytest.raises(PermissionError):
            _shard(failing, 8, part)
        set_transfers(Transfers(part_size=2 * part, parts_in_flight=window))
        _shard(_FakeS3(), 2, 2 * part)
        assert sink._KEPT and all(len(b) == 2 * part for b in sink._KEPT)  # another part size replaces them
    finally:
        set_transfers(before)
        sink.release_buffers()


@pytest.mark.parametrize("streaming", [True, False])
def test_the_manifest_is_written_once_and_fsynced_only_where_the_folder_is_kept(tmp_path, monkeypatch, streaming):
    # A save to object storage stages `.metadata` and `checksums.json` locally only for its upload: it wrote the
    # manifest twice (the payloads added by a rewrite), each with an fsync. A local save's folder is the checkpoint
    # itself and keeps its fsync.
    import json
    import os

    from torch.distributed.checkpoint.metadata import Metadata

    from lightning_fsdp.checkpoint.formats.layout import CHECKSUMS_FILENAME
    from lightning_fsdp.checkpoint.integrity.sharded_write import ChecksumWriter
    from lightning_fsdp.checkpoint.integrity.streaming_write import PAYLOADS_KEY, StreamingWriter

    synced, opened = [], []
    real_fsync, real_open = os.fsync, open
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd))[1])

    def counting_open(path, mode="r", *args, **kwargs):
        if str(path).endswith(CHECKSUMS_FILENAME) and "w" in mode:
            opened.append(path)
        return real_open(path, mode, *args, **kwargs)

    monkeypatch.setattr("builtins.open", counting_open)
    if streaming:
        writer = StreamingWriter(tmp_path, save_id="0123456789abcdef0123456789abcdef", open_object=None)
    else:
        writer = ChecksumWriter(tmp_path, save_id="0123456789abcdef0123456789abcdef")
    from lightning_fsdp.checkpoint.integrity.digests import ALGORITHM, ALGORITHMS

    seed_of, new_hasher = ALGORITHMS[ALGORITHM]
    writer._recording.start(lambda: new_hasher(seed_of(writer.save_id)))  # as write_data does first
    writer.finish(Metadata(state_dict_metadata={}), [[]])
    manifest = json.loads((tmp_path / CHECKSUMS_FILENAME).read_bytes())
    assert len(opened) == 1
    if streaming:
        assert manifest[PAYLOADS_KEY] == [] and synced == []
    else:
        assert PAYLOADS_KEY not in manifest and synced


def test_rank_0s_reads_of_a_bucket_before_a_save_run_side_by_side(monkeypatch, tmp_path):
    # The target's checks and the directory's commit orders are round trips to the store each, on the path of every
    # save (and of a background save's call): they ran one after the other. Each waits here for the other to start.
    import threading

    from lightning_fsdp.checkpoint import save
    from lightning_fsdp.checkpoint.io.one_process import OneProcess

    both = threading.Barrier(2, timeout=10)  # a bound against a hang only: the old code waited it out alone
    seen = []

    class _Store:
        remote = True

        def target(self, path):
            return str(path)

        def staging(self, target, token, rank):
            return tmp_path / token / "ckpt"

        def check_target(self, target, rank):
            both.wait()
            seen.append("checked")

        def discard(self, staged, rank):
            pass

    def orders(store, target, options):
        both.wait()
        seen.append("ordered")

    monkeypatch.setattr(save, "_count_above_the_directory", orders)
    target, staged, _ = save._prepare(_Store(), "s3://b/run/ckpt", OneProcess(), "Saving", None,
                                      lambda staged: seen.append("staged"))
    assert target == "s3://b/run/ckpt" and sorted(seen[:2]) == ["checked", "ordered"] and seen[2] == "staged"

    def refused(target, rank):
        raise FileExistsError(f"{target!r} is an existing object")

    store = _Store()
    store.check_target = refused
    both.reset()
    monkeypatch.setattr(save, "_count_above_the_directory", lambda *args: None)
    with pytest.raises(FileExistsError, match="is an existing object"):  # the check's own error, as before
        save._prepare(store, "s3://b/run/ckpt", OneProcess(), "Saving", None)
