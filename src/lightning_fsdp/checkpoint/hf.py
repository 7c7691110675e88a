"""Loading Hugging Face safetensors weights (``save_pretrained`` output) straight into a sharded model.

The usual start of a fine-tune: build the model on the meta device, shard it, then read the pretrained weights.
The source is one ``.safetensors`` file, or a directory holding ``model.safetensors.index.json`` (several files)
or a single ``model.safetensors``; either may be a URL (``s3://bucket/llama``, any fsspec protocol), read through
fsspec by byte ranges: the headers, then each rank's rows of each tensor, several ranges in flight at once. The
same checks run on the same bytes as for local files.

Each rank reads only the slices of its own shards, through DCP with torch's Hugging Face storage reader: DCP plans
which slice of which file lands in which local shard, and the reader copies each slice into place, converting the
dtype on the way (a bf16 file into fp32 parameters, and back). Peak host memory per rank is therefore its shards
plus about one tensor's slice, never the whole model.

Parameter names are compared the way ``from_pretrained`` compares them: a weight of the model that the files lack
is *missing*, a tensor of the files the model lacks is *unexpected*, and tied parameters (an ``lm_head`` sharing
the input embedding) count as present when any of their names is in the files. ``strict=True`` makes missing or
unexpected names an error that lists them; otherwise they are reported as a warning on rank 0, like
``from_pretrained``'s load report. A load that cannot be exact is always an error, raised on every rank before any
weight is read (see ``hf_checks``): a shape that differs, chunks that do not tile a weight, a dtype of another kind,
an index entry outside the directory.
"""

from __future__ import annotations

import contextlib
import json
import re
import warnings
from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.fsdp import FSDPModule
from torch.futures import Future
from torch.nn import Module

from lightning_fsdp.checkpoint.formats import hf_checks
from lightning_fsdp.checkpoint.formats.safetensors_stream import RangedFile
from lightning_fsdp.checkpoint.integrity.agreement import CheckpointError, Communicator, together, unreadable
from lightning_fsdp.checkpoint.io.store import store_for
from lightning_fsdp.checkpoint.io.transfers import transfers

__all__ = ["LoadReport", "is_hf_checkpoint", "safetensors_files", "load_pretrained_weights"]

INDEX_FILENAME = "model.safetensors.index.json"
SINGLE_FILENAME = "model.safetensors"
_SUFFIX = ".safetensors"
# Module wrappers that add a segment to parameter names but not to state-dict keys (activation checkpointing,
# torch.compile); state-dict keys are what the files use.
_WRAPPER_SEGMENTS = ("_checkpoint_wrapped_module", "_orig_mod")


@dataclass
class LoadReport:
    """What a pretrained load matched, as ``from_pretrained(..., output_loading_info=True)`` reports it."""

    missing_keys: list[str] = field(default_factory=list)
    unexpected_keys: list[str] = field(default_factory=list)
    loaded_keys: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, list[str]]:
        return {"missing_keys": self.missing_keys, "unexpected_keys": self.unexpected_keys}

    def render(self, model: Module, path: Path) -> str:
        """The warning text: one line per group of names, layer indices folded (``layers.{0, 1}.mlp.up.weight``)."""
        lines = [f"{_class_name(model)} LOAD REPORT from: {path}"]
        lines += [f"  MISSING     {name}" for name in _fold(self.missing_keys)]
        lines += [f"  UNEXPECTED  {name}" for name in _fold(self.unexpected_keys)]
        if self.missing_keys:
            lines.append("MISSING: these weights were not in the files and keep their initial values.")
        if self.unexpected_keys:
            lines.append("UNEXPECTED: these tensors of the files match no weight of the model and were not read.")
        return "\n".join(lines)


def is_hf_checkpoint(path: Union[str, Path], storage_options: Optional[dict[str, Any]] = None, *,
                     comm: Optional[Communicator] = None) -> bool:
    """A ``.safetensors`` file, or a directory with ``model.safetensors.index.json`` or ``model.safetensors``; at a
    URL, the same objects. With ``comm`` (collective), rank 0 alone asks the store (one LIST of a directory, one
    HEAD of a file) and every rank gets its answer: no request per rank."""
    store = store_for(path, storage_options)

    def probe() -> bool:
        target = store.target(path)
        if store.name(target).endswith(_SUFFIX) and store.size(target) is not None:
            return True
        listing = store.listing(target) or {}
        return INDEX_FILENAME in listing or SINGLE_FILENAME in listing

    if comm is None:
        return probe()
    return comm.broadcast(together(comm, f"Looking for Hugging Face weights at {str(path)!r}",
                                   lambda: probe() if comm.global_rank == 0 else None))


def safetensors_files(path: Union[str, Path], storage_options: Optional[dict[str, Any]] = None) -> list[Any]:
    """The files of a safetensors checkpoint: the file itself, those its index names, or ``model.safetensors``
    (URLs for a checkpoint at a URL)."""
    store = store_for(path, storage_options)
    return [file for file, _ in _files(store, store.target(path))]


def _files(store: Any, target: Any) -> list[tuple[Any, int]]:
    """The files of the safetensors checkpoint at ``target`` with their sizes: one listing of the directory (a
    HEAD for a single file, and for an index entry in a subdirectory), and one read of the index."""
    if store.name(target).endswith(_SUFFIX):
        size = store.size(target)
        if size is not None:
            return [(target, size)]
    listing = store.listing(target)
    if listing is None:
        raise FileNotFoundError(f"{str(target)!r} is neither a '{_SUFFIX}' file nor a directory. HINT: pass the"
                                " directory `save_pretrained` wrote, or one of its '.safetensors' files.")
    index = store.child(target, INDEX_FILENAME)
    if INDEX_FILENAME not in listing:
        if SINGLE_FILENAME not in listing:
            raise FileNotFoundError(f"{str(target)!r} holds neither {INDEX_FILENAME} nor {SINGLE_FILENAME}. HINT:"
                                    " pass the directory `save_pretrained` wrote.")
        return [(store.child(target, SINGLE_FILENAME), listing[SINGLE_FILENAME])]
    try:
        weight_map = json.loads(store.read(index))["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError(f"'weight_map' is a {type(weight_map).__name__}")
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(
            f"{str(index)!r} is not a safetensors index (expected JSON with a 'weight_map' of tensor name to file"
            f" name): {err}. HINT: re-create it with `save_pretrained`, or delete it to load {SINGLE_FILENAME}."
        ) from err
    files = store.index_entries(target, index, weight_map)
    # Plain names come from the listing; a name in a subdirectory (rare: `save_pretrained` writes none) is asked for.
    sizes = [listing.get(store.name(f)) if str(store.parent(f)) == str(target) else store.size(f) for f in files]
    absent = [str(f) for f, size in zip(files, sizes) if size is None]
    if absent:
        raise FileNotFoundError(f"the index {str(index)!r} names files that are not there: {absent}. HINT: the"
                                " download or upload is incomplete; fetch or upload the missing files.")
    return list(zip(files, sizes))  # type: ignore[arg-type]


def _snapshot(store: Any, source: Any) -> list[tuple[str, int, bytes]]:
    """What every rank needs to plan its reads, read by rank 0 alone: each file, its size and the bytes of its
    header (one ranged GET each, a second only for a header longer than ``_HEAD``)."""
    out = []
    for file, size in _files(store, store.target(source)):
        head = store.read(file, 0, min(size, _HEAD))
        if len(head) >= 8:
            want = 8 + int.from_bytes(head[:8], "little")
            if len(head) < want <= min(size, _MAX_HEADER):
                head += store.read(file, len(head), want)
        out.append((str(file), size, head))
    return out


_HEAD = 256 * 2**10  # the first read of a file: its header, for all but the largest checkpoints
_MAX_HEADER = 100_000_000  # the safetensors library refuses a longer header; a longer one is never fetched


def load_pretrained_weights(path: Union[str, Path], module: Module, *, strict: bool, comm: Communicator,
                            storage_options: Optional[dict[str, Any]] = None) -> LoadReport:
    """Read the safetensors weights at ``path`` into ``module`` (sharded or not), each rank its own slices.

    Rank 0 lists the files, reads the index and every file's header (a few requests, whatever the world size) and
    broadcasts them; every rank plans from them and reads only its own rows. Returns the :class:`LoadReport` on
    every rank. Raises on every rank alike when a file cannot be read, a shape differs, chunks do not tile a weight,
    a dtype is of another kind, or (``strict=True``) a name is missing or unexpected. Every check runs before the
    first weight is read, so a refused load leaves the model as it was.
    """
    source: Any = comm.broadcast(str(path))
    store = store_for(source, storage_options)
    source = store.target(source)
    snapshot = comm.broadcast(together(comm, f"Finding the safetensors files of {str(source)!r}",
                                       lambda: _snapshot(store, source) if comm.global_rank == 0 else None))
    reader = _RangedReader(snapshot, progress=comm.global_rank == 0, store=store)
    # Every rank parses the headers it was sent, so every rank can plan its own reads.
    metadata: Metadata = together(comm, f"Reading the safetensors headers of {str(source)!r}", reader.read_metadata)
    state = get_model_state_dict(module)

    def check() -> tuple[LoadReport, list[str]]:
        report, load_names = _match(state, metadata, _tied_names(module))
        hf_checks.check_weights(state, metadata, report.loaded_keys, reader.holders, reader.placed)
        if strict and (report.missing_keys or report.unexpected_keys):
            raise KeyError(
                f"Loading {str(source)!r} into {_class_name(module)} with `strict=True`: missing keys"
                f" {report.missing_keys}, unexpected keys {report.unexpected_keys}. HINT: pass `strict=False` to"
                " load the weights that match and keep the initial values of the rest (the names are reported as a"
                " warning)."
            )
        return report, load_names

    report, load_names = together(comm, f"Checking the weights of {str(source)!r}", check)
    chosen = {name: state[name] for name in load_names}
    planner = dcp.DefaultLoadPlanner(allow_partial_load=True)
    together(comm, f"Reading the weights of {str(source)!r}",
             lambda: dcp.load(chosen, storage_reader=reader, planner=planner))
    # DCP wrote into the local shards in place; this also fills the tied names from the one that was read.
    set_model_state_dict(module, {**state, **chosen}, options=StateDictOptions(strict=False))
    if comm.global_rank == 0 and (report.missing_keys or report.unexpected_keys):
        warnings.warn(report.render(module, source), stacklevel=3)
    return report


class _RangedReader(HuggingFaceStorageReader):
    """torch's Hugging Face reader, for files in any store (local or at a URL), read by byte ranges through the store
    (:class:`RangedFile`): the headers rank 0 read, then only the rows of each tensor this rank's shards need.

    - torch's reader lists every ``.safetensors`` file in the directory; a directory may hold more than one
      checkpoint (``model.safetensors`` beside an indexed set, or a single file chosen among others). Here: the
      checkpoint's own files, as the index names them.
    - torch's reader keeps each file mapped while it reads all of this rank's slices from it, and every page a
      mapping touched stays resident until it closes. Here a rank holds at most ``range_size`` bytes of ranges at a
      time (:func:`~lightning_fsdp.checkpoint.io.transfers.transfers`; a remote store keeps them in flight
      together), each copied into its shard straight from the bytes read, then dropped.

    The metadata is built as torch's reader builds it, with the same checks before it (``hf_checks``).
    """

    def __init__(self, snapshot: list[tuple[str, int, bytes]], *, progress: bool, store: Any) -> None:
        super().__init__(snapshot[0][0].rsplit("/", 1)[0] if "/" in snapshot[0][0] else ".")
        self._snapshot, self._store, self._progress = snapshot, store, progress
        self._opened: dict[str, RangedFile] = {}
        self.placed: set[str] = set()  # the files whose header places their chunks (DCP_SHARDING_INFO)
        self.holders: dict[str, dict[str, torch.dtype]] = defaultdict(dict)  # tensor -> file -> stored dtype

    def read_metadata(self) -> Metadata:
        from torch.distributed.checkpoint.metadata import (
            ChunkStorageMetadata, MetadataIndex, StorageMeta, TensorProperties, TensorStorageMetadata,
        )

        stored: dict[str, TensorStorageMetadata] = {}
        storage: dict[MetadataIndex, _RangedInfo] = {}
        for url, size, head in self._snapshot:
            with _header_of(url):
                file = self._opened[url] = RangedFile(_Head(size, head), url)
            shapes = {key: list(entry[1]) for key, entry in file.entries.items()}
            hf_checks.check_sharding_info(url, file.header_metadata, shapes)
            info = (file.header_metadata or {}).get(hf_checks.SHARDING_INFO_KEY)
            if info:
                self.placed.add(url)
            offsets_of = json.loads(info) if info else {}
            for key, (dtype, shape, _, _) in file.entries.items():
                self.holders[key][url] = dtype
                offset = list(offsets_of[key]["saved_offsets"]) if key in offsets_of else [0] * len(shape)
                chunk = ChunkStorageMetadata(offsets=torch.Size(offset), sizes=torch.Size(shape))
                if key not in stored:
                    stored[key] = TensorStorageMetadata(properties=TensorProperties(dtype=dtype), chunks=[chunk],
                                                        size=torch.Size([s + o for s, o in zip(shape, offset)]))
                else:
                    stored[key].chunks.append(chunk)
                    stored[key].size = torch.Size([max(a, s + o) for a, s, o in zip(stored[key].size, shape, offset)])
                storage[MetadataIndex(fqn=key, offset=offset)] = _RangedInfo(relative_path=url)
        metadata = Metadata(state_dict_metadata=stored, storage_data=storage)  # type: ignore[arg-type]
        metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: Any, planner: Any) -> Future:
        from tqdm import tqdm  # Lightning depends on tqdm

        # Rank 0's share stands for all; shown only when the load takes more than a couple of seconds.
        items = tqdm(plan.items, desc="Loading pretrained weights", unit="tensor", delay=2.0,
                     disable=not self._progress, leave=False)
        window = transfers().range_size
        batch: list[tuple[Any, RangedFile, tuple[slice, ...], int, int]] = []
        held = 0
        for item in items:
            file = self._opened[self.storage_data[item.storage_index].relative_path]
            region = tuple(slice(start, start + length) for start, length in zip(item.storage_offsets, item.lengths))
            start, end = file.row_range(item.storage_index.fqn, region)
            if batch and held + end - start > window:
                self._read(batch, planner)
                batch, held = [], 0
            batch.append((item, file, region, start, end))
            held += end - start
        self._read(batch, planner)
        done: Future = Future()
        done.set_result(None)
        return done

    def _read(self, batch: list, planner: Any) -> None:
        if not batch:
            return
        datas: list[Any] = self._store.read_ranges([b[1].url for b in batch], [b[3] for b in batch],
                                                   [b[4] for b in batch])
        for i, (item, file, region, _, _) in enumerate(batch):
            piece = file.piece(item.storage_index.fqn, region, datas[i])
            target = planner.resolve_tensor(item).detach()
            if target.shape != piece.shape:  # copy_ would broadcast a smaller piece silently
                raise RuntimeError(f"internal error: {item.storage_index.fqn!r} read {list(piece.shape)} from"
                                   f" {file.url!r} for a slice of {list(target.shape)}")
            target.copy_(piece)  # converts the dtype too: a bf16 file into fp32 parameters, or back
            planner.commit_tensor(item, target)
            datas[i] = piece = None  # the range's bytes go now, not with the batch


@dataclass(frozen=True)
class _RangedInfo:
    """Where a stored tensor is (what ``read_data`` needs of ``Metadata.storage_data``)."""

    relative_path: str


class _Head:
    """What :class:`RangedFile` asks of a filesystem to parse a header, answered from the bytes rank 0 read."""

    def __init__(self, size: int, head: bytes) -> None:
        self._size, self._head = size, head

    def size(self, url: str) -> int:
        return self._size

    def cat_file(self, url: str, start: int, end: int) -> bytes:
        if end > len(self._head):
            raise ValueError(f"its header length {end - 8} is more than the {_MAX_HEADER} bytes a safetensors header"
                             " may have. HINT: the file is damaged or not a safetensors file; download it again.")
        return self._head[start:end]


@contextlib.contextmanager
def _header_of(path: Any) -> Iterator[None]:
    """A safetensors header that does not parse (the safetensors library's ``SafetensorError``, or torch's own
    parse failing) is one ``CheckpointError`` naming the file."""
    try:
        yield
    except (OSError, CheckpointError):
        raise
    except Exception as err:  # noqa: BLE001 - SafetensorError, json's and struct's errors, ...
        raise unreadable(path, err) from err


def _match(state: dict[str, Any], metadata: Metadata, tied: list[set[str]]) -> tuple[LoadReport, list[str]]:
    """Compare the model's names with the files'; return the report and the names to read."""
    stored = metadata.state_dict_metadata
    group_of = {name: group for group in tied for name in group}
    loaded = [name for name in state if name in stored]
    covered = set(loaded) | {other for name in loaded for other in group_of.get(name, ())}
    # Of a tied group, read one name only: they share one tensor, and two reads into it would be redundant.
    reading: list[str] = []
    seen: set[str] = set()
    for name in loaded:
        if name not in seen:
            reading.append(name)
            seen.update(group_of.get(name, {name}))
    report = LoadReport(
        missing_keys=[name for name in state if name not in covered],
        unexpected_keys=sorted(name for name in stored if name not in state),
        loaded_keys=loaded,
    )
    return report, reading


def _tied_names(module: Module) -> list[set[str]]:
    """Groups of state-dict names that are one parameter (tied weights), with wrapper segments removed."""
    by_param: dict[int, set[str]] = defaultdict(set)
    for name, param in module.named_parameters(remove_duplicate=False):
        by_param[id(param)].add(_clean(name))
    return [names for names in by_param.values() if len(names) > 1]


def _class_name(module: Module) -> str:
    """The user's class name: ``fully_shard`` swaps in a subclass named ``FSDP<name>``."""
    cls = type(module)
    return cls.__bases__[0].__name__ if isinstance(module, FSDPModule) and cls.__bases__ else cls.__name__


def _clean(name: str) -> str:
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_SEGMENTS)


_INDEX = re.compile(r"\.(\d+)\.")


def _fold(names: Iterable[str]) -> list[str]:
    """``layers.0.x``, ``layers.1.x`` -> ``layers.{0, 1}.x``, as ``from_pretrained``'s report writes them."""
    groups: dict[str, list[int]] = defaultdict(list)
    order: list[str] = []
    for name in names:
        match = _INDEX.search(name)
        key = _INDEX.sub(".*.", name, count=1) if match else name
        if key not in groups:
            order.append(key)
        if match:
            groups[key].append(int(match.group(1)))
    return [key.replace(".*.", "." + (str(groups[key][0]) if len(groups[key]) == 1 else
                                      "{" + ", ".join(map(str, groups[key])) + "}") + ".", 1) for key in order]
