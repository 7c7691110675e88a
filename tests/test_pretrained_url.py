"""Hugging Face safetensors weights from a URL (issue 38): ``load_pretrained(model, "s3://...")`` reads the files
through fsspec by byte ranges (the header, then the rows each tensor slice needs), with the checks a local load
makes, against the suite's S3 server (``tests/s3server.py``), in this process (no process group: one rank reads
everything; ``workers/hf.py`` holds the sharded loads of local files, which share the planning with these)."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors.torch import save as safetensors_bytes

from lightning_fsdp import load_pretrained
from lightning_fsdp.checkpoint.formats.safetensors_stream import RangedFile
from lightning_fsdp.checkpoint.integrity.agreement import CheckpointError
from lightning_fsdp.checkpoint.io.one_process import OneProcess

pytestmark = pytest.mark.single_process


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(11, 6)
        self.fc = torch.nn.Linear(6, 5)
        self.norm = torch.nn.LayerNorm(5)


def reference() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {k: v.detach().clone() for k, v in Tiny().state_dict().items()}


@pytest.fixture()
def s3(s3_server, monkeypatch):
    s3_server.setenv(monkeypatch)
    return s3_server


def fresh() -> Tiny:
    torch.manual_seed(1)
    return Tiny()


def assert_exact(model: torch.nn.Module, expected: dict[str, torch.Tensor]) -> None:
    got = model.state_dict()
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor.to(got[name].dtype)), name


def test_a_single_file_and_an_indexed_directory_at_a_url_load_exactly(s3):
    bucket, weights = s3.bucket(), reference()
    fs = s3.filesystem()
    fs.pipe_file(f"{bucket}/one/model.safetensors", safetensors_bytes(weights))
    report = load_pretrained(model := fresh(), f"s3://{bucket}/one")
    assert report.missing_keys == [] and report.unexpected_keys == []
    assert_exact(model, weights)
    load_pretrained(model := fresh(), f"s3://{bucket}/one/model.safetensors")
    assert_exact(model, weights)

    first = {k: v for k, v in weights.items() if k.startswith("embed")}
    second = {k: v for k, v in weights.items() if not k.startswith("embed")}
    names = {"model-00001-of-00002.safetensors": first, "model-00002-of-00002.safetensors": second}
    for name, part in names.items():
        fs.pipe_file(f"{bucket}/two/{name}", safetensors_bytes(part))
    index = {"metadata": {}, "weight_map": {k: n for n, part in names.items() for k in part}}
    fs.pipe_file(f"{bucket}/two/model.safetensors.index.json", json.dumps(index).encode())
    load_pretrained(model := fresh(), f"s3://{bucket}/two")
    assert_exact(model, weights)


def test_a_bf16_file_at_a_url_loads_into_fp32_parameters(s3):
    bucket, weights = s3.bucket(), reference()
    halved = {k: v.to(torch.bfloat16) for k, v in weights.items()}
    s3.filesystem().pipe_file(f"{bucket}/bf16/model.safetensors", safetensors_bytes(halved))
    load_pretrained(model := fresh(), f"s3://{bucket}/bf16")
    assert model.fc.weight.dtype == torch.float32
    assert_exact(model, halved)


def test_a_damaged_header_or_an_index_leading_outside_is_refused_naming_the_url(s3):
    bucket, weights = s3.bucket(), reference()
    fs = s3.filesystem()
    data = bytearray(safetensors_bytes(weights))
    data[:8] = struct.pack("<Q", len(data))  # a header length past the end of the file
    fs.pipe_file(f"{bucket}/bad/model.safetensors", bytes(data))
    model = fresh()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError, match=f"s3://{bucket}/bad/model.safetensors.*runs past the end"):
        load_pretrained(model, f"s3://{bucket}/bad")
    assert_exact(model, before)

    fs.pipe_file(f"{bucket}/out/model-1.safetensors", safetensors_bytes(weights))
    index = {"weight_map": {k: "../bad/model.safetensors" for k in weights}}
    fs.pipe_file(f"{bucket}/out/model.safetensors.index.json", json.dumps(index).encode())
    with pytest.raises(ValueError, match="outside"):
        load_pretrained(fresh(), f"s3://{bucket}/out")


def test_ranged_reads_fetch_only_the_rows_a_slice_needs(s3):
    # What a rank holding rows 4..8 of the embedding reads: those rows' bytes, not the tensor, not the file.
    bucket, weights = s3.bucket(), reference()
    fs = s3.filesystem()
    fs.pipe_file(f"{bucket}/r/model.safetensors", safetensors_bytes(weights))
    file = RangedFile(fs, f"{bucket}/r/model.safetensors")
    region = (slice(4, 8), slice(0, 6))
    start, end = file.row_range("embed.weight", region)
    assert end - start == 4 * 6 * 4
    piece = file.piece("embed.weight", region, fs.cat_file(f"{bucket}/r/model.safetensors", start=start, end=end))
    assert torch.equal(piece, weights["embed.weight"][4:8])
    column = (slice(0, 5), slice(2, 4))
    start, end = file.row_range("fc.weight", column)
    piece = file.piece("fc.weight", column, fs.cat_file(f"{bucket}/r/model.safetensors", start=start, end=end))
    assert torch.equal(piece, weights["fc.weight"][:, 2:4])


_OneProcess = OneProcess  # the collectives of one process


def test_load_raw_of_safetensors_at_a_url_reads_them_in_place(s3):
    # `fabric.load_raw(url, model)` is `load_checkpoint(url, model, ...)`: plain safetensors at a URL have no
    # COMMIT object (no save wrote them), and load all the same.
    from lightning_fsdp.checkpoint.load import load_checkpoint

    bucket, weights = s3.bucket(), reference()
    s3.filesystem().pipe_file(f"{bucket}/raw/model.safetensors", safetensors_bytes(weights))
    assert load_checkpoint(f"s3://{bucket}/raw", model := fresh(), comm=_OneProcess()) == {}
    assert_exact(model, weights)
