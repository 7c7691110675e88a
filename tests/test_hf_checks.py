"""The checks a safetensors checkpoint must pass before a load (``checkpoint/formats/hf_checks.py``), in one process: chunk
geometry on odd shapes (3-D, scalars, empty dims), sharding info, and which index entries count as inside the
directory, including the Hugging Face hub cache's symlinks. The two-rank loads are in ``test_hf_safety.py``."""

import json
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, TensorProperties,
                                                   TensorStorageMetadata)

from lightning_fsdp.checkpoint.formats.hf_checks import check_sharding_info, check_weights, index_files


def metadata(chunks: dict[str, list[tuple[list[int], list[int]]]]) -> Metadata:
    return Metadata(state_dict_metadata={
        name: TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([1]),
                                    [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in pieces])
        for name, pieces in chunks.items()})


def check(shape, pieces, dtype=torch.float32, stored=torch.float32, placed=True):
    state = {"w": torch.zeros(shape, dtype=dtype)}
    files = {"w": {f"/ckpt/f{i}.safetensors": stored for i in range(len(pieces))}}
    check_weights(state, metadata({"w": pieces}), ["w"], files, set(files["w"]) if placed else set())


@pytest.mark.parametrize("shape, pieces", [
    ((3, 5, 7), [([0, 0, 0], [3, 5, 4]), ([0, 0, 4], [3, 2, 3]), ([0, 2, 4], [3, 3, 3])]),  # 3-D, odd splits
    ((), [([], [])]),  # a scalar, placed
    ((0, 4), [([0, 0], [0, 4])]),  # an empty weight
    ((7,), [([4], [3]), ([0], [4])]),  # chunks out of order
])
def test_chunks_that_tile_the_weight_pass(shape, pieces):
    check(shape, pieces)


@pytest.mark.parametrize("shape, pieces, needle", [
    ((3, 5, 7), [([0, 0, 0], [3, 5, 4]), ([0, 0, 4], [3, 2, 3])], "cover 78 of its 105 elements"),
    ((3, 5, 7), [([0, 0, 0], [3, 5, 5]), ([0, 0, 4], [3, 5, 3])], "overlap"),
    ((7,), [([0], [4]), ([4], [4])], "shape [4] at offset [4] reaches outside"),
    ((8, 8), [([4, 0], [4, 8])], "cover 32 of its 64 elements"),  # the example, one file
    ((8, 8), [([0, 0], [8, 8]), ([0, 0], [8, 8])], "is stored twice"),
    ((8, 8), [([0], [8]), ([0, 0], [8, 8])], "has 1 dims, the weight 2"),
])
def test_chunks_that_do_not_tile_the_weight_name_it(shape, pieces, needle):
    with pytest.raises(ValueError, match="do not make up these weights exactly") as err:
        check(shape, pieces)
    assert needle in str(err.value) and "w (model" in str(err.value) and "HINT" in str(err.value), str(err.value)


def test_one_whole_tensor_without_sharding_info_is_compared_by_shape():
    check((8, 8), [([0, 0], [8, 8])], placed=False)
    with pytest.raises(ValueError, match=r"w: file \(4, 8\), model \(8, 8\)"):
        check((8, 8), [([0, 0], [4, 8])], placed=False)


@pytest.mark.parametrize("dtype, stored", [
    (torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32), (torch.float32, torch.float8_e4m3fn),
    (torch.int64, torch.int32), (torch.bool, torch.bool), (torch.complex64, torch.complex128),
])
def test_precision_within_a_kind_passes(dtype, stored):
    check((2, 3), [([0, 0], [2, 3])], dtype=dtype, stored=stored, placed=False)


@pytest.mark.parametrize("dtype, stored", [
    (torch.float32, torch.int32), (torch.float32, torch.bool), (torch.float32, torch.complex64),
    (torch.int64, torch.float32), (torch.bool, torch.uint8), (torch.bfloat16, torch.uint8),
])
def test_a_change_of_kind_names_the_tensor_and_both_dtypes(dtype, stored):
    with pytest.raises(TypeError, match="dtype of another kind") as err:
        check((2, 3), [([0, 0], [2, 3])], dtype=dtype, stored=stored, placed=False)
    text = str(err.value)
    assert "w: f0.safetensors holds " + str(stored).removeprefix("torch.") in text and "HINT" in text, text


@pytest.mark.parametrize("info, needle", [
    ({"w": {"saved_offsets": [0, -1]}}, "saved_offsets=[0, -1]"),
    ({"w": {"saved_offsets": [2]}}, "saved_offsets=[2] for a chunk of shape [4, 8]"),
    ({"w": {"saved_offsets": [0.0, 0]}}, "saved_offsets=[0.0, 0]"),
    ({"w": {}}, "saved_offsets=None"),
    ({"other": {"saved_offsets": [0, 0]}}, "'w': no entry"),
])
def test_sharding_info_that_does_not_place_a_tensor_names_the_file_and_tensor(info, needle):
    with pytest.raises(ValueError, match="does not place every tensor") as err:
        check_sharding_info("/ckpt/a.safetensors", {"DCP_SHARDING_INFO": json.dumps(info)}, {"w": [4, 8]})
    assert needle in str(err.value) and "'/ckpt/a.safetensors'" in str(err.value), str(err.value)
    with pytest.raises(ValueError, match="is not JSON"):
        check_sharding_info("/ckpt/a.safetensors", {"DCP_SHARDING_INFO": "{"}, {"w": [4, 8]})
    check_sharding_info("/ckpt/a.safetensors", {"format": "pt"}, {"w": [4, 8]})  # no sharding info: whole tensors


def entries(directory: Path, **weight_map: str) -> list[Path]:
    return index_files(directory, directory / "model.safetensors.index.json", weight_map)


def test_entries_inside_the_directory_are_normalized_and_read_once(tmp_path):
    assert entries(tmp_path, a="x.safetensors", b="./x.safetensors", c="sub/../y.safetensors") == [
        tmp_path / "x.safetensors", tmp_path / "y.safetensors"]


@pytest.mark.parametrize("entry, reason", [
    ("../x.safetensors", "leads out of the directory"),
    ("sub/../../x.safetensors", "leads out of the directory"),
    ("/etc/x.safetensors", "an absolute path"),
    ("weights.bin", "not a '.safetensors' file"),
    ("", "not a file name"),
])
def test_entries_outside_the_directory_are_named(tmp_path, entry, reason):
    with pytest.raises(ValueError, match="outside the checkpoint directory") as err:
        entries(tmp_path, good="x.safetensors", bad=entry)
    assert f"'bad' -> {entry!r} ({reason})" in str(err.value) and "'good'" not in str(err.value), str(err.value)


def test_symlinks_may_leave_the_directory_only_into_a_hub_snapshots_own_blobs(tmp_path):
    repo = tmp_path / "models--org--name"
    (repo / "blobs").mkdir(parents=True)
    (repo / "blobs" / "0a1b").write_bytes(b"")
    (tmp_path / "elsewhere.safetensors").write_bytes(b"")
    snapshot = repo / "snapshots" / "rev"
    snapshot.mkdir(parents=True)
    (snapshot / "model.safetensors").symlink_to("../../blobs/0a1b")
    (snapshot / "other.safetensors").symlink_to(tmp_path / "elsewhere.safetensors")
    assert entries(snapshot, w="model.safetensors") == [snapshot / "model.safetensors"]
    with pytest.raises(ValueError, match="'v' -> 'other.safetensors' \\(a symlink to"):
        entries(snapshot, w="model.safetensors", v="other.safetensors")
    # The same link from a directory that is not a snapshot leaves the checkpoint.
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "model.safetensors").symlink_to(repo / "blobs" / "0a1b")
    with pytest.raises(ValueError, match="'w' -> 'model.safetensors' \\(a symlink to"):
        entries(plain, w="model.safetensors")
