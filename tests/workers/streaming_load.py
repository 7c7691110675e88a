"""Two-rank loads from a bucket that read only each rank's own byte ranges (issue 43 item 2), against the counting
S3 server of ``tests/ledger.py`` (started by ``tests/test_streaming_load.py``; its endpoint arrives in the
environment). Each rank loads with its own access key (``r<rank>``), so the pytest side counts each rank's GETs;
the cases return what each rank's share is (the bytes of its local shards) and which URLs they loaded.

Checkpoints: ``two`` saved by the package on 2 ranks here (2 -> 2, and into a whole model on every rank, as a load on
one rank reads); ``one``, ``old`` and ``bad`` saved by the pytest process as one rank and the old staging save wrote
them (``streaming_ckpt``), ``one`` with the streaming writer's block digests (1 -> 2 reads half of each saved chunk),
``old`` without them, ``bad`` as ``one`` with a flipped bit that only rank 1 reads."""

from __future__ import annotations

import contextlib
import os
import tempfile
import uuid
from pathlib import Path

from torch import nn

from common import full_params, make_fabric, same_tensors
from harness import case, run_cases
from streaming_ckpt import add_payloads, two_weights

WORLD = 2
BUCKET = os.environ.get("LFSDP_TEST_BUCKET", "ckpt")


def _model(seed: int) -> nn.Module:
    return two_weights(seed)


def _options(rank: int) -> dict:
    return {"key": f"r{rank}", "secret": "testing"}  # the ledger counts each rank by its access key


def _s3():
    import s3fs

    return s3fs.S3FileSystem(skip_instance_cache=True, use_listings_cache=False)


def _share(model: nn.Module) -> int:
    """The bytes of this rank's own pieces of the model's state."""
    total = 0
    for value in model.state_dict().values():
        local = value.to_local() if hasattr(value, "to_local") else value
        total += local.numel() * local.element_size()
    return total


@contextlib.contextmanager
def _watching_load_folders(seen: list):
    """Notes every shard file under the load folders of this host while DCP reads (the old load downloaded them)."""
    import torch.distributed.checkpoint as dcp

    original = dcp.load

    def watched(*args, **kwargs):
        seen.extend(str(p) for p in Path(tempfile.gettempdir()).glob("lightning-fsdp-load-*/**/*.distcp"))
        return original(*args, **kwargs)

    dcp.load = watched
    try:
        yield
    finally:
        dcp.load = original


@case
def each_rank_reads_only_its_own_ranges_and_no_shard_file_reaches_local_disk():
    fabric = make_fabric(WORLD)
    model = fabric.setup(_model(0))
    expected = full_params(model)
    base = f"s3://{BUCKET}/{fabric.broadcast(uuid.uuid4().hex[:8])}"
    urls = {"two": f"{base}/two", "two-again": f"{base}/two-again"}  # one per load: the counts stay apart
    for url in urls.values():
        fabric.save(url, {"model": model})
    whole = make_fabric(WORLD, sharding_strategy="NO_SHARD")
    if fabric.global_rank == 0:
        for url in urls.values():
            add_payloads(_s3(), url)  # the package's save may have written them already (then kept)
    fabric.barrier()
    urls.update({name: os.environ[f"LFSDP_TEST_{name.upper()}_URL"] for name in ("one", "old")})
    loads, seen = {}, []
    for name, source in (("2->2", "two"), ("1->2", "one"), ("1->2 old", "old"), ("2->whole", "two-again")):
        # "2->whole": every rank holds the whole model (NO_SHARD), so it reads every chunk, as a load on one rank does.
        target = (whole if name == "2->whole" else fabric).setup(_model(1))
        url = urls[source]
        # A copy per load so that the counts of one load are not mixed with another's (same objects, new prefix).
        with _watching_load_folders(seen):
            remainder = fabric.strategy.load_checkpoint(url, {"model": target}, storage_options=_options(
                fabric.global_rank))
        got = full_params(target)
        assert same_tensors(got, expected), name
        loads[name] = {"url": url, "share": _share(target), "remainder": sorted(remainder)}
        fabric.barrier()
    return {"loads": loads, "rank": fabric.global_rank, "local_shards": seen}  # checked by the pytest side


@case
def a_flipped_byte_in_blocks_only_rank_1_reads_is_refused_on_every_rank_naming_the_object():
    fabric = make_fabric(WORLD)
    url = os.environ["LFSDP_TEST_BAD_URL"]
    objects = {"shard": os.environ["LFSDP_TEST_BAD_SHARD"], "block": int(os.environ["LFSDP_TEST_BAD_BLOCK"])}
    target = fabric.setup(_model(1))
    try:
        fabric.strategy.load_checkpoint(url, {"model": target}, storage_options=_options(fabric.global_rank))
    except Exception as err:  # noqa: BLE001  # the agreed error, checked by its words below
        message = str(err)
    else:
        raise AssertionError("a flipped byte loaded without an error")
    assert objects["shard"] in message, message
    assert f"block {objects['block']}" in message and "model.l0.weight" in message and "HINT:" in message, message
    assert "/tmp/" not in message, message
    return {"message": message[:600]}


@case
def damage_found_in_the_small_objects_names_urls_not_local_folders_on_every_rank():
    """Each rank checks the skeleton in its own temporary folder; the agreed error is one rank's words, and names the
    checkpoint's URL on every rank, never a folder of this host (the other rank's least of all)."""
    fabric = make_fabric(WORLD)
    url = os.environ["LFSDP_TEST_FOREIGN_URL"]
    target = fabric.setup(_model(1))
    try:
        fabric.strategy.load_checkpoint(url, {"model": target}, storage_options=_options(fabric.global_rank))
    except Exception as err:  # noqa: BLE001  # the agreed error, checked by its words below
        message = str(err)
    else:
        raise AssertionError("a checksums.json of another save loaded without an error")
    assert f"{url}/checksums.json" in message and "HINT:" in message, message
    assert "lightning-fsdp-load" not in message, message
    return {"message": message[:600]}


if __name__ == "__main__":
    run_cases()
