"""One storage interface (issue 43 item 7): every operation above ``checkpoint/io`` goes through a ``Store``
(``store_for`` is the one place that tells a URL from a local path), and what reads Hugging Face weights at a URL
costs in requests.

Requests are counted where they arrive, by the suite's ledger (``tests/ledger.py``: moto's S3 app behind a middleware
that records each request with the access key that signed it), each simulated rank signing with a key of its own
(``rank_key``). Two ranks are simulated in this process: rank 0 runs
the load with a communicator that records what it broadcasts, then rank 1 runs it with one that hands it those
values. Nothing here races, so one process shows which rank sends which request; a launch would add seconds.
"""

from __future__ import annotations

import ast
import contextlib
import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save as safetensors_bytes

import lightning_fsdp

pytestmark = pytest.mark.single_process

SRC = Path(lightning_fsdp.__file__).parent


class Recording:
    """Rank 0 of two: collectives of one process that keep what it broadcasts."""

    global_rank = 0

    def __init__(self) -> None:
        self.sent: list[Any] = []

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        self.sent.append(obj)
        return obj

    def agree(self, error: Any) -> Any:
        return None if error is None else (0, error)

    def barrier(self) -> None:
        pass

    def guard(self, phase: str) -> Any:
        return contextlib.nullcontext()


class Replaying(Recording):
    """Rank 1 of two: each broadcast gives what rank 0 sent, in the same order."""

    global_rank = 1

    def __init__(self, sent: list[Any]) -> None:
        self._sent = list(sent)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        assert obj is None or isinstance(obj, str), f"rank 1 computed something to broadcast: {obj!r}"[:200]
        return self._sent.pop(0)


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(11, 6)
        self.fc = torch.nn.Linear(6, 5)


def test_hf_weights_at_a_url_cost_rank_0_one_get_of_the_index_and_the_other_ranks_no_request_but_their_rows(ledger):
    """Before: every rank HEADed the index twice and read it (a HEAD and a GET), HEADed every file, and read every
    header. Now rank 0 lists the directory (once to see that it holds Hugging Face weights, once for the sizes),
    reads the index once and each header once, and broadcasts; rank 1 sends only ranged GETs of tensor data."""
    from ledger import rank_key

    from lightning_fsdp.checkpoint.load import load_checkpoint

    torch.manual_seed(0)
    weights = {k: v.detach().clone() for k, v in Tiny().state_dict().items()}
    setup = ledger.filesystem("setup")
    bucket = ledger.bucket()
    names = {"model-00001-of-00002.safetensors": {"embed.weight": weights["embed.weight"]},
             "model-00002-of-00002.safetensors": {k: v for k, v in weights.items() if k.startswith("fc")}}
    for name, part in names.items():
        setup.pipe_file(f"{bucket}/llama/{name}", safetensors_bytes(part))
    index = {"metadata": {}, "weight_map": {k: n for n, part in names.items() for k in part}}
    setup.pipe_file(f"{bucket}/llama/model.safetensors.index.json", json.dumps(index).encode())
    url = f"s3://{bucket}/llama"

    def options(rank: int) -> dict[str, Any]:
        return {"key": rank_key(rank), "secret": "x", "endpoint_url": ledger.endpoint,
                "client_kwargs": {"region_name": "us-east-1"}}

    rank0 = Recording()
    model0 = Tiny()
    load_checkpoint(url, model0, comm=rank0, storage_options=options(0))
    model1 = Tiny()
    load_checkpoint(url, model1, comm=Replaying(rank0.sent), storage_options=options(1))
    for model in (model0, model1):
        assert all(torch.equal(model.state_dict()[k], v) for k, v in weights.items())

    first = [(r.method, r.path, r.query, r.range or "") for r in ledger.records(rank_key(0))]
    index_path = f"{bucket}/llama/model.safetensors.index.json"
    assert [r for r in first if r[1] == index_path] == [("GET", index_path, {}, "bytes=0-")], first
    assert not [r for r in first if r[0] == "HEAD"], first
    lists = [r for r in first if r[1] == bucket]
    assert len(lists) == 2, first  # is_hf_checkpoint's and the load's: the sizes come from the listing
    # Each file: one GET of its header (its first bytes), then the rows.
    for name in names:
        got = [r for r in first if r[1] == f"{bucket}/llama/{name}"]
        assert got and all(r[0] == "GET" and r[3].startswith("bytes=") for r in got), got
        assert got[0][3] == f"bytes=0-{len(safetensors_bytes(names[name])) - 1}", got

    second = [(r.method, r.path, r.query, r.range or "") for r in ledger.records(rank_key(1))]
    assert second, "rank 1 read no weights"
    for method, path, query, ranged in second:
        assert method == "GET" and path.endswith(".safetensors") and not query, second
        start = int(ranged.removeprefix("bytes=").split("-")[0])
        header = 8 + int.from_bytes(safetensors_bytes(names[path.rsplit("/", 1)[-1]])[:8], "little")
        assert start >= header, f"rank 1 read a header: {second}"


def test_a_url_is_removed_through_asyncsaves_with_the_strategy_storage_options_alone(s3_server, monkeypatch, tmp_path):
    """``remove_checkpoint`` hands the store with the strategy's options to ``AsyncSaves.remove`` (which built one
    from the environment alone): with no credentials in the environment, the removal still works."""
    from lightning_fsdp.checkpoint.io.one_process import OneProcess
    from lightning_fsdp.checkpoint.io.store import store_for
    from lightning_fsdp.checkpoint.convert import convert
    from lightning_fsdp.checkpoint.save import AsyncSaves

    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    options = {"key": s3_server.env["AWS_ACCESS_KEY_ID"], "secret": s3_server.env["AWS_SECRET_ACCESS_KEY"],
               "endpoint_url": s3_server.endpoint, "client_kwargs": {"region_name": "us-east-1"}}
    url = f"s3://{s3_server.bucket()}/run/step-1.ckpt"
    torch.save({"model": {"w": torch.arange(4.0)}, "step": 1}, tmp_path / "full.pt")
    convert(tmp_path / "full.pt", url, to="sharded", storage_options=options)
    store = store_for(url, options)
    assert store.exists(url)
    saves = AsyncSaves()
    saves.remove(url, store)
    saves.wait(OneProcess())
    assert not store.exists(url) and store.read_commit(url) is None


def _imports_is_url(path: Path) -> bool:
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and any(alias.name == "is_url" for alias in node.names):
            return True
        if isinstance(node, ast.Attribute) and node.attr == "is_url":
            return True
    return False


def test_no_module_above_checkpoint_io_asks_whether_a_path_is_a_url():
    """Everything above ``checkpoint/io`` reaches the disk or a bucket through ``store_for(path).<operation>``; the
    kind of store is its business (``store.remote`` says it where Lightning's own code must take local paths)."""
    io = SRC / "checkpoint" / "io"
    asking = sorted(str(p.relative_to(SRC)) for p in SRC.rglob("*.py") if io not in p.parents and _imports_is_url(p))
    assert asking == [], f"these modules branch on is_url instead of asking their store: {asking}"
    # Inside io, the branch is store_for's alone (urls.py defines it).
    inside = sorted(str(p.relative_to(SRC)) for p in io.glob("*.py") if p.name != "urls.py" and _imports_is_url(p))
    assert inside == ["checkpoint/io/store.py"], inside
    calls = re.findall(r"\bis_url\(", (io / "store.py").read_text())
    assert len(calls) == 1, "store.py calls is_url outside store_for"


def test_the_local_store_answers_the_plain_file_operations_as_the_remote_one(tmp_path):
    from lightning_fsdp.checkpoint.io.readers import UsageError
    from lightning_fsdp.checkpoint.io.store import store_for

    store = store_for(tmp_path)
    (tmp_path / "a.safetensors").write_bytes(b"0123456789")
    (tmp_path / "sub").mkdir()
    assert store.listing(tmp_path) == {"a.safetensors": 10}
    assert store.listing(tmp_path / "a.safetensors") is None and store.listing(tmp_path / "none") is None
    assert store.size(tmp_path / "a.safetensors") == 10 and store.size(tmp_path / "sub") is None
    assert store.read(tmp_path / "a.safetensors", 2, 5) == b"234" and store.read(tmp_path / "a.safetensors", 8) == b"89"
    assert store.read_ranges([tmp_path / "a.safetensors"] * 2, [0, 9], [1, 10]) == [b"0", b"9"]
    with pytest.raises(ValueError, match="outside the checkpoint directory.*HINT"):
        store.index_entries(tmp_path, tmp_path / "index.json", {"w": "../x.safetensors"})
    with pytest.raises(UsageError, match="`clean` takes a checkpoint URL.*HINT"):
        store.clean(tmp_path)


def test_a_slice_read_by_ranges_is_a_view_of_the_bytes_read_not_a_second_copy():
    """The ranged reader holds at most ``range_size`` bytes of ranges; each piece copied into a shard must be a view
    of them (a ``bytearray`` copy held every batch twice: 64 MiB of ranges, then 64 MiB more of copies)."""
    import numpy as np

    from lightning_fsdp.checkpoint.formats.safetensors_stream import RangedFile

    class Bytes:  # what RangedFile asks of a filesystem, from one file's bytes
        def __init__(self, data: bytes) -> None:
            self.data = data

        def size(self, url: str) -> int:
            return len(self.data)

        def cat_file(self, url: str, start: int, end: int) -> bytes:
            return self.data[start:end]

    rows = torch.arange(48.0).reshape(8, 6)
    source = Bytes(safetensors_bytes({"w": rows}))
    file = RangedFile(source, "x.safetensors")
    region = (slice(2, 6), slice(0, 6))
    start, end = file.row_range("w", region)
    data = source.cat_file("", start, end)
    piece = file.piece("w", region, data)
    assert torch.equal(piece, rows[2:6])
    address = np.frombuffer(data, dtype=np.uint8).ctypes.data  # numpy views the bytes object's own buffer
    assert address <= piece.data_ptr() < address + len(data), "the piece is a copy of the bytes read"


def test_a_user_skip_instance_cache_storage_option_is_accepted():
    """Every filesystem is made fresh (``skip_instance_cache=True``); a user's own ``skip_instance_cache`` in
    ``storage_options`` was passed a second time (TypeError: multiple values for the keyword argument)."""
    from lightning_fsdp.checkpoint.io.urls import filesystem

    fs = filesystem("memory://bucket/x", {"skip_instance_cache": False})
    assert fs is not filesystem("memory://bucket/x", {"skip_instance_cache": False})  # fresh all the same
