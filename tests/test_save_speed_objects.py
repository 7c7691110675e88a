"""A shard of a few parts is saved as several objects of one PUT each (issue 43 item 6, ``io/sink.py``'s
``ShardUpload``): no multipart upload, so no ``complete_multipart_upload``, which the benchmark's server (moto) answers
by copying and hashing the whole object again, a third of a save's time there. The objects of a shard share one
window of requests and one retry budget; a failure in a later object removes the earlier ones; a shard larger than
``SPLIT_OBJECTS`` parts stays one multipart object. A fake S3 client for the sink's requests, and the suite's S3
server (the ledger, in this process) for a real save and load of one rank."""

from __future__ import annotations

import asyncio
import json
import os
import threading
import warnings

import pytest
import torch

from lightning_fsdp.checkpoint.io import sink as sink_module
from lightning_fsdp.checkpoint.io.transfers import Transfers, set_transfers, transfers
from test_sink import K, P, small_parts  # noqa: F401 - a fixture: pytest finds it here by the name the tests take

pytestmark = pytest.mark.single_process


class _FakeS3:
    """Just enough of s3fs for the sink: each PUT waits a little (so the writer gets ahead of it) and is counted in
    flight; the PUT of key ``deny`` is refused (403, not retried)."""

    def __init__(self, deny: str = "") -> None:
        from fsspec.asyn import get_loop

        self.loop = get_loop()
        self.calls: list[tuple[str, str]] = []
        self.objects: dict[str, bytes] = {}
        self.out = self.peak = 0
        self.deny = deny
        self.lock = threading.Lock()

    def split_path(self, url):
        bucket, key = url.split("://", 1)[-1].split("/", 1)
        return bucket, key, None

    async def _call_s3(self, method, **kw):
        key = kw["Key"]
        self.calls.append((method, key))
        if method == "delete_object":
            self.objects.pop(key, None)
            return {}
        assert method == "put_object" and kw["IfNoneMatch"] == "*", method  # never a multipart request
        with self.lock:
            self.out += 1
            self.peak = max(self.peak, self.out)
        try:
            await asyncio.sleep(0.02)
            if key == self.deny:
                from botocore.exceptions import ClientError

                raise ClientError({"Error": {"Code": "AccessDenied", "Message": "Access Denied"},
                                   "ResponseMetadata": {"HTTPStatusCode": 403}}, "PutObject")
            self.objects[key] = bytes(kw["Body"])
            return {}
        finally:
            with self.lock:
                self.out -= 1


def _shard(fs, names, pieces, size_hint):
    """Write ``pieces`` (bytes) into a ShardUpload, each into the next of ``names``."""
    with sink_module.ShardUpload(fs, lambda name: f"s3://b/{name}", names[0], size_hint=size_hint) as shard:
        assert shard.split_at == P
        for i, piece in enumerate(pieces):
            if i:
                shard.next_object(names[i])
            for start in range(0, len(piece), 10_000):
                shard.write(piece[start:start + 10_000])
    return shard


def test_a_small_shard_is_one_put_per_object_with_the_window_held(small_parts):
    fs = _FakeS3()
    pieces = [os.urandom(P - 100), os.urandom(P), os.urandom(10), os.urandom(P // 2), os.urandom(0)]
    names = [f"__0_{i}.distcp" for i in range(len(pieces))]
    shard = _shard(fs, names, pieces, size_hint=sum(map(len, pieces)))
    assert fs.objects == dict(zip(names, pieces))
    assert [m for m, _ in fs.calls] == ["put_object"] * len(pieces)  # no create, no part, no complete
    # The writer got ahead of the 20 ms PUTs, and never had more than the window out.
    assert fs.peak == K and shard.peak_in_flight == K and shard.requests == len(pieces)
    import xxhash

    assert shard.objects == [(n, len(p), xxhash.xxh3_64_intdigest(p)) for n, p in zip(names, pieces)]


def test_a_later_object_that_fails_removes_the_earlier_ones_and_names_its_url(small_parts):
    fs = _FakeS3(deny="__0_2.distcp")
    names = [f"__0_{i}.distcp" for i in range(4)]
    with pytest.raises(PermissionError, match=r"s3://b/__0_2\.distcp"):
        _shard(fs, names, [os.urandom(P // 2)] * 4, size_hint=2 * P)
    assert fs.objects == {}, sorted(fs.objects)  # the objects already made were removed, the rest never kept
    assert ("delete_object", "__0_0.distcp") in fs.calls and ("delete_object", "__0_1.distcp") in fs.calls


def test_a_shard_over_the_split_limit_stays_one_object(small_parts):
    shard = sink_module.ShardUpload(_FakeS3(), lambda name: f"s3://b/{name}", "__0_0.distcp",
                                    size_hint=sink_module.SPLIT_OBJECTS * P + 1)
    assert shard.split_at is None  # one multipart object: COMMIT names few objects at 1,000 ranks
    shard.__exit__(RuntimeError, RuntimeError("stop"), None)
    import fsspec

    memory = sink_module.ShardUpload(fsspec.filesystem("memory"), lambda name: f"memory://split/{name}",
                                     "__0_0.distcp", size_hint=P)
    assert memory.split_at is None  # other stores write one object through their file
    memory.__exit__(RuntimeError, RuntimeError("stop"), None)


def test_a_sharded_save_of_a_few_parts_is_single_puts_and_loads_exactly(ledger, monkeypatch):
    """At the server: each shard object is one PUT (no multipart request), COMMIT names them all, and the load
    reads them back exactly. The old code sent one multipart upload (``__0_0.distcp`` only)."""
    import moto.s3.models
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from lightning_fsdp.checkpoint.io import store
    from lightning_fsdp.checkpoint.io.one_process import OneProcess
    from lightning_fsdp.checkpoint.load import load_checkpoint
    from lightning_fsdp.checkpoint.save import save_checkpoint

    for key, value in ledger.env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(moto.s3.models, "S3_UPLOAD_PART_MIN_SIZE", 1)  # so that the old code's parts were accepted
    part = 256 * 1024
    before = transfers()
    set_transfers(Transfers(part_size=part, parts_in_flight=K))
    monkeypatch.setattr(store, "_remote_stores", {})  # a store made earlier keeps its endpoint: this is the ledger's
    url = f"s3://{ledger.bucket()}/run/step-1"
    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)

    def model(seed: int) -> torch.nn.Module:
        torch.manual_seed(seed)
        return fully_shard(torch.nn.Sequential(*[torch.nn.Linear(96, 256, bias=False) for _ in range(6)]))

    try:
        saved_model = model(0)  # 6 items of 96 KiB: two per object of at most 256 KiB
        ledger.reset()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            save_checkpoint(url, {"model": saved_model}, full=False, comm=OneProcess())
            saved = ledger.records()
            loaded_model = model(1)
            load_checkpoint(url, {"model": loaded_model}, comm=OneProcess())
    finally:
        set_transfers(before)
        if started:
            dist.destroy_process_group()
    for a, b in zip(saved_model.state_dict().values(), loaded_model.state_dict().values()):
        assert torch.equal(a.full_tensor(), b.full_tensor())
    shard = [r for r in saved if r.key.rsplit("/", 1)[-1].endswith(".distcp")]
    assert all(r.method == "PUT" and not r.query for r in shard), [(r.method, r.key, r.query) for r in shard]
    names = sorted(r.key.rsplit("/", 1)[-1] for r in shard)
    assert names == ["__0_0.distcp", "__0_1.distcp", "__0_2.distcp"], names
    commit = json.loads(ledger.filesystem().cat_file(f"{url}/COMMIT"))
    assert sorted(n for n in commit["objects"] if n.endswith(".distcp")) == names
    assert all(commit["objects"][n][0] <= part for n in names)
