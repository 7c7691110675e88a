"""A load from a bucket reads an item with block digests in pieces of whole blocks, straight into the destination
(review of issue 43, defect 2; issue 43 item 5: a load holds at most 64 MiB + 0.1x its shard above its start).

The reader held a whole item up to three times (the item assembled from its ranges, a ``BytesIO`` copy for
``torch.load``, the loaded tensor) before copying it into the destination. Where ``checksums.json`` records the
item's block digests, it now checks each block as its piece arrives and copies the piece's elements where the read
wants them (dtype and shape from ``.metadata``): the tests hold that no need handed to the fetch is item-sized, that
every dtype, a 0-d and an empty tensor, destinations that are not contiguous or of another dtype, and resharded
reads (saved in 2 chunks loaded as 1, one chunk loaded in rows or columns) load exactly, that damage is still a
``ChecksumError``, and the memory a load takes.

In process: the checkpoint is written by the streaming writer into a local folder (one file per object) and read by
the ranged fetch through fsspec's local filesystem, so no server and no COMMIT are needed; the chunks of a save in
several processes come from a save planner that cuts a tensor into chunks.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import warnings
from pathlib import Path
from typing import Any, Optional

import pytest
import torch
import torch.distributed.checkpoint as dcp

from streamed import save_streamed

MIB = 2**20

pytestmark = pytest.mark.single_process


def _save(folder: Path, state: dict, cuts: Optional[dict] = None) -> None:
    """Save ``state`` with the streaming writer into ``folder``; ``cuts``: {name: (dim, [sizes])} saves that tensor as
    chunks of those sizes along ``dim``, as ranks of a sharded save would."""
    save_streamed(folder, state, _Chunks(cuts or {}))


def _load(folder: Path, state: dict, boxes: Optional[dict] = None, *, piece: Optional[int] = None,
          window: int = 2, range_size: int = 4 * MIB) -> list[tuple]:
    """Load ``folder`` into ``state`` through the StreamingReader and the ranged fetch; ``boxes``: {name: (offsets,
    sizes)} reads only that box of the saved tensor (its destination has the box's size), as a rank of a resharded
    load does. Returns the (object, start, end) of every need the reader handed to the fetch. A failure raises the
    reader's own error (DCP wraps it)."""
    import fsspec
    from torch.distributed.checkpoint.api import CheckpointException

    from lightning_fsdp.checkpoint.integrity.streaming_read import StreamingReader
    from lightning_fsdp.checkpoint.io import ranged_read
    from lightning_fsdp.checkpoint.io.remote_source import RemoteObjects

    objects = {p.name: (p.stat().st_size, None) for p in folder.iterdir()}
    remote = RemoteObjects(fsspec.filesystem("file"), str(folder), str(folder), "sharded", objects, folder)
    needs: list[tuple] = []

    def fetch(asked: list) -> None:
        needs.extend(n[:3] for n in asked)
        ranged_read.fetch(remote, asked, ranges_in_flight=window, range_size=range_size)

    extra = {} if piece is None else {"piece_size": piece}
    reader = StreamingReader(folder, fetch=fetch, url_of=remote.url, **extra)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(state, storage_reader=reader, planner=_Boxes(boxes or {}), no_dist=True)
    except CheckpointException as err:
        failures = [f[0] for f in err.failures.values() if isinstance(f, tuple) and isinstance(f[0], BaseException)]
        raise (failures[0] if failures else err) from None
    return needs


class _Chunks(dcp.DefaultSavePlanner):
    """DCP's save planner, saving the tensors named in ``cuts`` as several chunks (what several ranks save)."""

    def __init__(self, cuts: dict) -> None:
        super().__init__()
        self.cuts = cuts

    def create_local_plan(self) -> Any:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
        from torch.distributed.checkpoint.planner import WriteItemType

        plan = super().create_local_plan()
        items = []
        for item in plan.items:
            if item.index.fqn not in self.cuts:
                items.append(item)
                continue
            dim, sizes = self.cuts[item.index.fqn]
            shape, at = list(item.tensor_data.size), 0
            for size in sizes:
                offsets = [0] * len(shape)
                offsets[dim] = at
                chunk = ChunkStorageMetadata(offsets=torch.Size(offsets),
                                             sizes=torch.Size(shape[:dim] + [size] + shape[dim + 1:]))
                items.append(dataclasses.replace(item, index=MetadataIndex(item.index.fqn, torch.Size(offsets)),
                                                 type=WriteItemType.SHARD,
                                                 tensor_data=dataclasses.replace(item.tensor_data, chunk=chunk)))
                at += size
        self.plan = dataclasses.replace(plan, items=items)
        return self.plan

    def resolve_data(self, item: Any) -> Any:
        if item.index.fqn not in self.cuts:
            return super().resolve_data(item)
        tensor = self.state_dict[item.index.fqn]
        for dim, (offset, size) in enumerate(zip(item.tensor_data.chunk.offsets, item.tensor_data.chunk.sizes)):
            tensor = tensor.narrow(dim, offset, size)
        return tensor


class _Boxes(dcp.DefaultLoadPlanner):
    """DCP's load planner, reading only a box of the tensors named in ``boxes`` (what a rank of a resharded load
    reads); their destinations have the box's size."""

    def __init__(self, boxes: dict) -> None:
        super().__init__()
        self.boxes = boxes

    def create_local_plan(self) -> Any:
        from torch.distributed.checkpoint.default_planner import create_default_local_load_plan
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
        from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

        others = {name: value for name, value in self.state_dict.items() if name not in self.boxes}
        plan = create_default_local_load_plan(others, self.metadata, True)
        items = list(plan.items)
        for name, (offsets, sizes) in self.boxes.items():
            box = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
            items += create_read_items_for_chunk_list(name, self.metadata.state_dict_metadata[name], [box])
        self.plan = dataclasses.replace(plan, items=items)
        return self.plan

    def resolve_tensor(self, item: Any) -> torch.Tensor:
        if item.dest_index.fqn not in self.boxes:
            return super().resolve_tensor(item)
        return _box(self.state_dict[item.dest_index.fqn], item.dest_offsets, item.lengths)


def _box(tensor: torch.Tensor, offsets: list[int], sizes: list[int]) -> torch.Tensor:
    for dim, (offset, size) in enumerate(zip(offsets, sizes)):
        tensor = tensor.narrow(dim, offset, size)
    return tensor


def _saved() -> dict[str, torch.Tensor]:
    """Tensors of every kind the reader must take apart by blocks (blocks are 64 KiB at these sizes)."""
    generator = torch.Generator().manual_seed(0)
    return {
        "f32": torch.randn(520, 300, generator=generator),                                  # 609 KiB, 10 blocks
        "bf16": torch.randn(700, 130, generator=generator).bfloat16(),
        "bool": torch.rand(333, 517, generator=generator) > 0.5,
        "i64": torch.randint(-2**62, 2**62, (4100, 7), generator=generator),
        "c64": torch.randn(3, 5000, generator=generator, dtype=torch.complex64),
        "f64_3d": torch.randn(9, 70, 33, generator=generator, dtype=torch.float64),
        "scalar": torch.tensor(-2.5),
        "empty": torch.empty(0, 4),
    }


def _check_pieces(folder: Path, needs: list[tuple], piece: Optional[int]) -> None:
    """Every need is at most one piece (or one block, when a block is larger), and the payload of every item with
    block digests is fetched apart from the zip records around it: a need begins at its first byte."""
    payloads = json.loads((folder / "checksums.json").read_bytes())["payloads"]
    limit = max(max((piece or 8 * MIB) // row[3] * row[3], row[3]) for row in payloads)
    longest = max(end - start for _, start, end in needs)
    assert longest <= limit, f"a need of {longest} bytes, where pieces are at most {limit}: an item read whole"
    starts = {(name, start) for name, start, _ in needs}
    whole = [row[:3] for row in payloads if (row[0], row[1] + row[2]) not in starts]
    assert not whole, f"items fetched with their payload in one need with the zip records around it: {whole}"


@pytest.mark.parametrize("piece,range_size", [(128 * 2**10, 100 * 2**10), (None, 4 * MIB)],
                         ids=["pieces-cut-across-ranges", "defaults"])
def test_every_dtype_and_destination_loads_exactly_and_no_need_is_item_sized(tmp_path, piece, range_size):
    from lightning_fsdp.checkpoint.integrity.streaming_read import verified_items

    saved = _saved()
    folder = tmp_path / "ck"
    _save(folder, saved)
    # Destinations as a load finds them: of the saved dtype, not contiguous (a transposed buffer), of another dtype.
    dest: dict[str, torch.Tensor] = {name: torch.zeros_like(t) for name, t in saved.items()}
    dest["f32"] = torch.zeros(300, 520).t()
    dest["bf16"] = torch.zeros(700, 130)  # bf16 saved, loaded into float32: converted as copy_ converts
    dest["c64"] = torch.zeros(5000, 3, dtype=torch.complex64).t()
    dest["f64_3d"] = torch.zeros(33, 70, 9, dtype=torch.float64).permute(2, 1, 0)
    needs = _load(folder, dest, piece=piece, range_size=range_size)
    for name, tensor in saved.items():
        expected = tensor.float() if name == "bf16" else tensor
        assert dest[name].dtype == expected.dtype and torch.equal(dest[name], expected), name
    # The empty tensor has no block digests (no payload): it is read whole, as before; nothing else is.
    _check_pieces(folder, needs, piece)
    # Every item read by blocks counts as checked whole against its digest (the load's part in verifying the
    # checkpoint). (DCP makes no ReadItem for the empty tensor: no load ever reads it.)
    every, checked = verified_items(folder)
    by_blocks = {(row[0], row[1]) for row in json.loads((folder / "checksums.json").read_bytes())["payloads"]}
    assert len(by_blocks) == len(saved) - 1 and by_blocks <= checked, sorted(by_blocks - checked)


@pytest.mark.parametrize("piece,range_size", [(128 * 2**10, 100 * 2**10), (None, 4 * MIB)],
                         ids=["pieces-cut-across-ranges", "defaults"])
def test_resharded_reads_load_exactly_the_box_each_rank_wants(tmp_path, piece, range_size):
    generator = torch.Generator().manual_seed(1)
    w = torch.randn(1000, 96, generator=generator)  # 375 KiB: 6 blocks of 64 KiB, a row is 384 bytes
    v = torch.randint(0, 2**15, (96, 1000), generator=generator, dtype=torch.int16)
    # Saved as 2 ranks save (uneven chunks of rows, and of columns), loaded whole as 1 rank loads.
    _save(tmp_path / "two", {"w": w, "v": v}, cuts={"w": (0, [601, 399]), "v": (1, [500, 500])})
    whole = {"w": torch.zeros(96, 1000).t(), "v": torch.zeros(96, 1000, dtype=torch.int16)}
    needs = _load(tmp_path / "two", whole, piece=piece, range_size=range_size)
    assert torch.equal(whole["w"], w) and torch.equal(whole["v"], v)
    _check_pieces(tmp_path / "two", needs, piece)
    # Saved as 1 rank saves, loaded as ranks of a resharded load: rows cut mid-block, columns (another dimension
    # than the rows the blocks follow), both, and one row.
    _save(tmp_path / "one", {"w": w})
    shard = (tmp_path / "one" / "__0_0.distcp").stat().st_size
    for offsets, sizes in [([0, 0], [500, 96]), ([500, 0], [500, 96]), ([333, 0], [1, 96]), ([0, 40], [1000, 17]),
                           ([171, 5], [700, 90]), ([999, 95], [1, 1])]:
        dest = {"w": torch.full(sizes, float("nan"))}
        needs = _load(tmp_path / "one", dest, boxes={"w": (offsets, sizes)}, piece=piece, range_size=range_size)
        assert torch.equal(dest["w"], _box(w, offsets, sizes)), (offsets, sizes)
        longest = max(end - start for _, start, end in needs)
        assert longest <= max(piece or 8 * MIB, 65536), (offsets, sizes, longest)
        if sizes[0] <= 500:  # rows only: the blocks that hold them, at most one more block at each end
            assert sum(end - start for _, start, end in needs) <= sizes[0] * 384 + 2 * 65536, (offsets, sizes, shard)


class _CachedPlans(dcp.DefaultSavePlanner):
    """DCP's planner with its plan cache on, as the library's sharded save uses it (its own cache key)."""

    def __init__(self) -> None:
        super().__init__(enable_plan_caching=True)


def test_a_dtype_that_metadata_records_wrong_is_loaded_as_the_bytes_hold_it(tmp_path):
    """DCP's plan cache compares shapes, not dtypes: a second save in one process of tensors whose dtype changed
    records the first save's dtypes in .metadata. The bytes are right (the previous reader unpickled them); the
    block read must not reinterpret them as .metadata's dtype (float16 bits as bfloat16: wrong values, no error)."""
    from lightning_fsdp.checkpoint.integrity.digests import new_save_id
    from lightning_fsdp.checkpoint.integrity.streaming_write import StreamingWriter

    generator = torch.Generator().manual_seed(4)
    # float16 -> bfloat16: the same bytes per element. float32 -> bfloat16: a payload of half the length, whose
    # blocks are not where .metadata puts them; the tiny one fits the length and block count .metadata implies.
    first = {"same_size": torch.randn(300, 200, generator=generator).half(), "other_size": torch.randn(300, 200),
             "tiny": torch.randn(10, generator=generator)}
    second = {name: tensor.bfloat16() for name, tensor in first.items()}
    for name, state in (("first", first), ("second", second)):
        folder = tmp_path / name
        folder.mkdir()
        writer = StreamingWriter(folder, save_id=new_save_id(),
                                 open_object=lambda object_name, size_hint=None, f=folder: open(f / object_name, "wb"))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save(state, storage_writer=writer, planner=_CachedPlans(), no_dist=True)
    recorded = dcp.FileSystemReader(tmp_path / "second").read_metadata().state_dict_metadata
    assert recorded["same_size"].properties.dtype == torch.float16, "DCP's plan cache records dtypes now: drop this"
    dest = {name: torch.zeros(tensor.shape) for name, tensor in second.items()}
    _load(tmp_path / "second", dest)
    for name, tensor in second.items():
        assert torch.equal(dest[name], tensor.float()), name


def _flip(folder: Path, at: int) -> None:
    path = folder / "__0_0.distcp"
    data = bytearray(path.read_bytes())
    data[at] ^= 1
    path.write_bytes(bytes(data))


def test_damage_is_a_checksum_error_before_its_block_reaches_the_destination(tmp_path):
    from lightning_fsdp.checkpoint.integrity.digests import ChecksumError

    w = torch.randn(2048, 256, generator=torch.Generator().manual_seed(2))  # 2 MiB: 32 blocks of 64 KiB (1 KiB rows)
    folder = tmp_path / "ck"
    _save(folder, {"w": w})
    payload_at = (folder / "__0_0.distcp").read_bytes().find(w.numpy().tobytes()[:64])
    assert payload_at > 0
    # A byte of the zip records before the payload: only the item digest covers it (checked once the item is in).
    _flip(folder, 40)
    with pytest.raises(ChecksumError, match=r"corrupted: the bytes of the tensor 'w' do not match"):
        _load(folder, {"w": torch.zeros_like(w)})
    _flip(folder, 40)
    # A byte in block 17 (of 32): found by its block's digest, before the piece that holds it is copied.
    _flip(folder, payload_at + 17 * 65536 + 1000)
    dest = torch.full_like(w, float("nan"))
    with pytest.raises(ChecksumError, match=r"corrupted: block 17 \(bytes \d+ to \d+\) of the tensor 'w'"):
        _load(folder, {"w": dest})
    assert dest.isnan().all(), "bytes of the damaged piece reached the destination"
    # In pieces of 2 blocks: the pieces before are in the destination, the damaged block and those after are not.
    with pytest.raises(ChecksumError, match=r"corrupted: block 17 "):
        _load(folder, {"w": dest}, piece=2**17)
    assert torch.equal(dest[:16 * 64], w[:16 * 64]) and dest[17 * 64:].isnan().all()
    # The same block read for some rows of a resharded load.
    with pytest.raises(ChecksumError, match=r"corrupted: block 17 "):
        _load(folder, {"w": torch.zeros(10, 256)}, boxes={"w": ([17 * 64 + 3, 0], [10, 256])})


def _resident_mib(key: str) -> float:
    with open("/proc/self/status") as status:
        return int(status.read().split(key + ":")[1].split()[0]) / 1024


def test_a_load_holds_less_than_one_copy_of_its_largest_tensor_above_its_start(tmp_path):
    """Peak RSS (VmHWM, reset) above the start of a load of one 64 MiB tensor, with a fetch window of 2 x 8 MiB
    (local files: each range is read as bytes and copied into its buffer, so up to 16 MiB more in flight). Before:
    the item, its BytesIO copy and the loaded tensor, 192 MiB and more (201 MiB measured; 33 MiB after)."""
    w = torch.randn(16 * MIB // 1024, 1024, generator=torch.Generator().manual_seed(3))
    folder = tmp_path / "ck"
    _save(folder, {"w": w})
    dest = {"w": torch.ones_like(w)}  # every page touched before the measure
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")  # VmHWM from here
    start = _resident_mib("VmRSS")
    _load(folder, dest, window=2, range_size=8 * MIB)
    peak = _resident_mib("VmHWM") - start
    assert torch.equal(dest["w"], w)
    print(f"peak RSS above start {peak:.1f} MiB")
    assert peak < 64, f"peak RSS {peak:.1f} MiB above the load's start, bound 64 MiB (one copy of the 64 MiB tensor)"
