"""Review of issue 43's full (one-file) reads by ranges (io/remote_full.py): an index larger than the span fetched
with it, a local header that moves a record's bytes out of its span, and the prefetch threads running in the
caller's context (its retry budget). In this process, on ``memory://``."""

from __future__ import annotations

import contextvars
import io
import struct
import uuid
import zipfile

import fsspec
import pytest
import torch

from lightning_fsdp.checkpoint.integrity.digests import ChecksumError
from lightning_fsdp.checkpoint.io.remote_full import RemoteFullFile
from lightning_fsdp.checkpoint.io.remote_source import RemoteObjects

pytestmark = pytest.mark.single_process


def _saved(obj) -> bytearray:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return bytearray(buffer.getvalue())


def _remote(data) -> RemoteFullFile:
    fs = fsspec.filesystem("memory")
    target = f"memory://review-full-{uuid.uuid4().hex[:8]}/ckpt"
    fs.pipe_file(f"{target}/.tok/ckpt", bytes(data))
    return RemoteFullFile(RemoteObjects(fs, target, f"{target}/.tok", "full", {"ckpt": (len(data), None)}))


def test_an_index_larger_than_the_span_fetched_with_it_loads_exactly():
    """~1,000 tensors make data.pkl larger than 64 KiB: the records beside it no longer qualify for its GET, which
    must still cover the index itself (it raised `max() arg is an empty sequence`)."""
    obj = {"model": {f"layers.{i}.mlp.weight": torch.full((2,), float(i)) for i in range(1000)}}
    data = _saved(obj)
    assert zipfile.ZipFile(io.BytesIO(bytes(data))).getinfo("archive/data.pkl").file_size > 64 * 2**10
    file = _remote(data)
    got = file.materialize(file.load(False))
    file.finish()
    assert got["model"].keys() == obj["model"].keys()
    assert all(torch.equal(got["model"][k], v) for k, v in obj["model"].items())


def test_a_local_header_that_moves_a_record_out_of_its_span_is_damage_not_uninitialised_memory():
    """The directory's lengths pass the fits check, the local header's extra length moves the data start past the
    record's span: with no checks recorded nothing else would catch it (the copy left part of `torch.empty`)."""
    t = torch.arange(4096, dtype=torch.float32)
    data = _saved({"w": t})
    info = next(i for i in zipfile.ZipFile(io.BytesIO(bytes(data))).infolist() if i.filename.endswith("data/0"))
    name_length, extra_length = struct.unpack_from("<HH", data, info.header_offset + 26)
    struct.pack_into("<HH", data, info.header_offset + 26, name_length, extra_length + 8000)
    file = _remote(data)
    file._digests = {}  # as a file without checks opens (no CRC-32 written, no checksums record): nothing else
    # would catch this record (a CRC-off torch.save is not used here: zipfile refuses its small records' zero CRCs)
    got = file.materialize(file.load(False))["w"]
    with pytest.raises(ChecksumError, match=r"local header of its record '[^']*data/0'.*outside the record's span"):
        file.finish()
    assert torch.equal(got, torch.zeros_like(t))  # the failed record is given as zeros, never as stale memory


def test_prefetch_threads_run_in_the_callers_context():
    """The ranged GETs run on a pool: each must see the caller's context variables (the load's one retry budget,
    remote_errors.one_budget), not a thread's empty context."""
    marker: contextvars.ContextVar[str] = contextvars.ContextVar("review_full_marker", default="unset")
    file = _remote(_saved({"a": torch.arange(64.0), "b": torch.arange(32.0)}))
    seen: list[str] = []
    plain = file._read

    def read(start: int, end: int) -> bytes:
        seen.append(marker.get())
        return plain(start, end)

    file._read = read
    token = marker.set("caller")
    try:
        got = file.materialize(file.load(False))
    finally:
        marker.reset(token)
    file.finish()
    assert torch.equal(got["a"], torch.arange(64.0)) and torch.equal(got["b"], torch.arange(32.0))
    assert seen and set(seen) == {"caller"}
