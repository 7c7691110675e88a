"""Writing an opened checkpoint (:mod:`~lightning_fsdp.checkpoint.io.readers`) as a full file, a sharded directory or a safetensors export.

Each writer reads tensors from the source a little at a time and writes and frees each before more are read, so
peak memory is about one read batch plus what the writer must hold: one tensor for a full file (streamed by
:func:`~lightning_fsdp.checkpoint.io.full_writer.write_streaming`) and for safetensors (:mod:`~lightning_fsdp.checkpoint.formats.safetensors_stream`),
one tensor for DCP (see :class:`_StreamingSavePlanner`). Each writes into a staging path that the caller moves
into place.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch
import torch.distributed.checkpoint as dcp

from lightning_fsdp.checkpoint.formats.commit_order import NEW
from lightning_fsdp.checkpoint.formats.layout import METADATA_FILENAME
from lightning_fsdp.checkpoint.formats.safetensors_stream import SafetensorsItem, ordered, write_file
from lightning_fsdp.checkpoint.integrity.digests import new_save_id
from lightning_fsdp.checkpoint.integrity.sharded_write import ChecksumWriter
from lightning_fsdp.checkpoint.io.full_writer import save_file, write_streaming
from lightning_fsdp.checkpoint.io.memory import drop_file_pages, return_freed_memory
from lightning_fsdp.checkpoint.io.readers import (
    Checkpoint,
    TensorEntry,
    UsageError,
    _batches,
    _FullCheckpoint,
    _map_leaves,
    _single_process,
)

__all__ = ["write_full", "write_sharded", "write_safetensors", "export_name", "Progress", "SAFETENSORS_FILENAME",
           "SAFETENSORS_INDEX_FILENAME"]

SAFETENSORS_FILENAME = "model.safetensors"
SAFETENSORS_INDEX_FILENAME = "model.safetensors.index.json"
_SHARD_NAME = "model-{index:05d}-of-{count:05d}.safetensors"

Progress = Callable[[int, int], None]
"""Called with (bytes written, bytes in total) as tensors are written."""


def write_full(checkpoint: Checkpoint, staged: Path, progress: Optional[Progress],
               commit_order: Union[int, None, str] = NEW) -> None:
    """Stream tensors into one torch.save file: the skeleton holds meta-device stand-ins, and each one is read
    from the source only when the writer reaches it. ``commit_order``: what the file records (a convert passes its
    source's, :data:`~lightning_fsdp.checkpoint.formats.commit_order.NEW`)."""
    entries = checkpoint.tensors()
    stand_ins: dict[int, TensorEntry] = {}

    def stand_in(entry: TensorEntry) -> torch.Tensor:
        tensor = torch.empty(entry.shape, dtype=entry.dtype, device="meta")
        stand_ins[id(tensor)] = entry
        return tensor

    skeleton = _map_leaves(checkpoint.tree, lambda leaf: stand_in(leaf) if isinstance(leaf, TensorEntry) else leaf)
    overlap = sorted(set(skeleton) & set(checkpoint.metadata), key=str)
    if overlap:
        raise UsageError(f"{str(checkpoint.path)!r} has the key {overlap[0]!r} both in its shards and in"
                         f" {METADATA_FILENAME}, and a full file can hold only one. HINT: rename one of them.")
    reading = checkpoint.read(entries)
    meter = _Meter(entries, progress)

    def materialize(tensor: torch.Tensor) -> torch.Tensor:
        if id(tensor) not in stand_ins:
            return tensor  # a tensor among the metadata entries, already loaded
        entry, value = next(reading)
        if stand_ins[id(tensor)] is not entry:  # the writer walks the skeleton in the order `tensors()` lists
            raise RuntimeError(f"internal error: expected {entry.name}, the writer asked for another tensor")
        meter.add(entry)
        return value

    write_streaming(staged, {**skeleton, **checkpoint.metadata}, materialize, commit_order)


def write_sharded(checkpoint: Checkpoint, staged: Path, progress: Optional[Progress],
                  commit_order: Union[int, None, str] = NEW) -> None:
    assert isinstance(checkpoint, _FullCheckpoint)  # the only other format, checked by `convert`
    contents = checkpoint.load()  # memory-mapped: DCP touches each tensor only as it writes it
    if checkpoint.bare:
        contents = {"model": contents}
    state = {key: contents[key] for key in checkpoint.tree}
    meter = _Meter(checkpoint.tensors(), progress)
    staged.mkdir(parents=True)
    save_file(checkpoint.metadata, staged / METADATA_FILENAME)  # first: DCP's last step binds it to the save
    planner = _StreamingSavePlanner(meter)
    with _single_process():
        dcp.save(state, storage_writer=ChecksumWriter(staged, save_id=new_save_id(), commit_order=commit_order),
                 planner=planner, no_dist=True)


class _StreamingSavePlanner(dcp.DefaultSavePlanner):
    """DCP's default save planner for memory-mapped tensors, counting bytes as the writer asks for each one.

    DCP's writer keeps a reference to every tensor it wrote until its file is complete, which keeps every page of
    the source it touched mapped: the whole model. So each call drops the pages of the tensor handed out before,
    which the writer has written by then (see :func:`drop_file_pages` for why this is safe at any time).
    """

    def __init__(self, meter: _Meter) -> None:
        super().__init__()
        self.meter = meter
        self.previous: Optional[torch.Tensor] = None

    def resolve_data(self, write_item: Any) -> Any:
        if self.previous is not None:
            drop_file_pages(self.previous)
            self.previous = None
        data = super().resolve_data(write_item)
        if isinstance(data, torch.Tensor):
            self.meter.add_bytes(data.numel() * data.element_size())
            self.previous = data
        return data


def write_safetensors(checkpoint: Checkpoint, keys: list[str], staged: Path, *, single_file: bool,
                       max_shard_size: Optional[int], progress: Optional[Progress], strip_prefix: str = "") -> None:
    """Write the weights of the models ``keys``; one model's names lose ``strip_prefix`` (checked by the caller).

    Streamed (:mod:`~lightning_fsdp.checkpoint.formats.safetensors_stream`): each file's header comes from shapes and dtypes alone, then each tensor
    is read, written and freed in turn, so the extra memory is about one read batch, whatever the file's size.
    Every name gets its own bytes, as ``safetensors.torch.save_file`` requires: tied weights, and views that
    ``torch.save`` kept sharing one storage, are each written in full.
    """
    prefixed = len(keys) > 1
    entries = checkpoint.tensors(keys)
    items = {id(e): SafetensorsItem(export_name(e, prefixed)[len(strip_prefix):], e.shape, e.dtype) for e in entries}
    shards = list(_batches(entries, max_shard_size)) if max_shard_size else [entries]
    if single_file:
        files = [staged]
    else:
        staged.mkdir(parents=True)
        single = len(shards) == 1  # like Hugging Face: one shard is a plain model.safetensors, without an index
        files = [staged / (SAFETENSORS_FILENAME if single else _SHARD_NAME.format(index=i + 1, count=len(shards)))
                 for i in range(len(shards))]
    meter = _Meter(entries, progress)
    # Only a full source's tensors are file mappings. A sharded source's are fresh heap memory, whose pages must
    # never be dropped: the kernel would zero them, neighbours and allocator bookkeeping included.
    mapped = isinstance(checkpoint, _FullCheckpoint)
    weight_map: dict[str, str] = {}
    for shard, file in zip(shards, files):
        entry_of = {items[id(e)].name: e for e in shard}
        try:
            layout = ordered(items[id(e)] for e in shard)
        except TypeError as err:  # a dtype safetensors lacks: the user's to fix, in one line
            raise UsageError(str(err)) from err
        in_file_order = [entry_of[item.name] for item in layout]

        def written(item: SafetensorsItem, tensor: torch.Tensor) -> None:
            if mapped:  # a memory-mapped source's pages stay resident until dropped
                drop_file_pages(tensor)
            meter.add(entry_of[item.name])

        reading = (tensor for _, tensor in checkpoint.read(in_file_order))
        # "pt": what transformers checks before loading
        write_file(file, layout, reading, metadata={"format": "pt"}, written=written)
        reading.close()
        return_freed_memory()
        _umask_mode(file)
        weight_map.update((item.name, file.name) for item in layout)
    if len(files) > 1:
        index = {"metadata": {"total_size": sum(e.nbytes for e in entries)},
                 "weight_map": {items[id(e)].name: weight_map[items[id(e)].name] for e in entries}}
        (staged / SAFETENSORS_INDEX_FILENAME).write_text(json.dumps(index, indent=2) + "\n")


def export_name(entry: TensorEntry, prefixed: bool) -> str:
    """The name a weight gets in a safetensors export: its flat name, without the model's key unless several
    models are exported together."""
    return ".".join(str(p) for p in (entry.path if prefixed else entry.path[1:]))


def _umask_mode(file: Path) -> None:
    """safetensors (0.8) creates its files readable by their owner only; give them the mode any new file gets."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(file, 0o666 & ~umask)


class _Meter:
    """Counts written bytes for a progress callback."""

    def __init__(self, entries: list[TensorEntry], progress: Optional[Progress]) -> None:
        self.total = sum(e.nbytes for e in entries)
        self.done = 0
        self.progress = progress
        self.add_bytes(0)

    def add(self, entry: TensorEntry) -> None:
        self.add_bytes(entry.nbytes)

    def add_bytes(self, count: int) -> None:
        self.done += count
        if self.progress is not None:
            self.progress(self.done, self.total)
