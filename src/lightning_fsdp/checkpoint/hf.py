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
from lightning_fsdp.checkpoint.formats.safetensors_stream import DTYPE_NAMES, RangedFile
from lightning_fsdp.checkpoint.integrity.agreement import CheckpointError, Communicator, together, unreadable
from lightning_fsdp.checkpoint.io.urls import filesystem, is_url, join

__all__ = ["LoadReport", "is_hf_checkpoint", "safetensors_files", "load_pretrained_weights"]

INDEX_FILENAME = "model.safetensors.index.json"
SINGLE_FILENAME = "model.safetensors"
_SUFFIX = ".safetensors"
# Module wrappers that add a segment to parameter names but not to state-dict keys (activation checkpointing,
# torch.compile); state-dict keys are what the files use.
_WRAPPER_SEGMENTS = ("_checkpoint_wrapped_module", "_orig_mod")
_DTYPES = {name: dtype for dtype, name in DTYPE_NAMES.items()}  # a safetensors header's dtype name -> torch's


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


def is_hf_checkpoint(path: Union[str, Path], storage_options: Optional[dict[str, Any]] = None) -> bool:
    """A ``.safetensors`` file, or a directory with ``model.safetensors.index.json`` or ``model.safetensors``; at a
    URL, the same objects."""
    if is_url(path):
        fs, url = filesystem(str(path), storage_options), str(path).rstrip("/")
        if url.endswith(_SUFFIX):
            return fs.isfile(url)
        return fs.isfile(join(url, INDEX_FILENAME)) or fs.isfile(join(url, SINGLE_FILENAME))
    path = Path(path)
    if path.is_file():
        return path.suffix == _SUFFIX
    return path.is_dir() and ((path / INDEX_FILENAME).is_file() or (path / SINGLE_FILENAME).is_file())


def safetensors_files(path: Union[str, Path], storage_options: Optional[dict[str, Any]] = None) -> list[Any]:
    """The files of a safetensors checkpoint: the file itself, those its index names, or ``model.safetensors``
    (URLs for a checkpoint at a URL)."""
    if is_url(path):
        return _url_files(str(path).rstrip("/"), filesystem(str(path), storage_options))
    path = Path(path)
    if path.is_file():
        return [path]
    index = path / INDEX_FILENAME
    if not index.is_file():
        return [path / SINGLE_FILENAME]
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError(f"'weight_map' is a {type(weight_map).__name__}")
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(
            f"{str(index)!r} is not a safetensors index (expected JSON with a 'weight_map' of tensor name to file"
            f" name): {err}. HINT: re-create it with `save_pretrained`, or delete it to load {SINGLE_FILENAME}."
        ) from err
    files = hf_checks.index_files(path, index, weight_map)
    absent = [str(f) for f in files if not f.is_file()]
    if absent:
        raise FileNotFoundError(
            f"the index {str(index)!r} names files that are not there: {absent}. HINT: the download or copy is"
            " incomplete; fetch the missing files."
        )
    return files


def _url_files(url: str, fs: Any) -> list[str]:
    """:func:`safetensors_files` at a URL. An index entry must be a plain relative name of a ``.safetensors`` object
    under the URL (no scheme, no leading ``/``, no ``..``), as ``save_pretrained`` writes them."""
    if url.endswith(_SUFFIX):
        return [url]
    index = join(url, INDEX_FILENAME)
    if not fs.isfile(index):
        return [join(url, SINGLE_FILENAME)]
    try:
        weight_map = json.loads(fs.cat_file(index))["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError(f"'weight_map' is a {type(weight_map).__name__}")
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(
            f"{index!r} is not a safetensors index (expected JSON with a 'weight_map' of tensor name to file name):"
            f" {err}. HINT: re-create it with `save_pretrained`, or delete it to load {SINGLE_FILENAME}."
        ) from err
    names = sorted({str(name) for name in weight_map.values()})
    bad = [n for n in names if not isinstance(n, str) or not n.endswith(_SUFFIX) or n.startswith("/") or "://" in n
           or ".." in n.split("/")]
    if bad:
        raise ValueError(
            f"the index {index!r} names objects outside {url!r} or not safetensors files: {bad[:5]}. Allowed: a"
            f" '{_SUFFIX}' name relative to the checkpoint URL that stays under it. HINT: name the files by their"
            " plain file names in 'weight_map', as `save_pretrained` writes them."
        )
    files = [join(url, n) for n in names]
    absent = [f for f in files if not fs.isfile(f)]
    if absent:
        raise FileNotFoundError(f"the index {index!r} names objects that are not there: {absent}. HINT: the upload"
                                " is incomplete; upload the missing files.")
    return files


def load_pretrained_weights(path: Union[str, Path], module: Module, *, strict: bool, comm: Communicator,
                            storage_options: Optional[dict[str, Any]] = None) -> LoadReport:
    """Read the safetensors weights at ``path`` into ``module`` (sharded or not), each rank its own slices.

    Returns the :class:`LoadReport` on every rank. Raises on every rank alike when a file cannot be read, a shape
    differs, chunks do not tile a weight, a dtype is of another kind, or (``strict=True``) a name is missing or
    unexpected. Every check runs before the first weight is read, so a refused load leaves the model as it was.
    """
    source: Any = comm.broadcast(str(path))
    fs = filesystem(source, storage_options) if is_url(source) else None
    source = source.rstrip("/") if fs is not None else Path(source)
    files = together(comm, f"Finding the safetensors files of {str(source)!r}",
                     lambda: safetensors_files(source, storage_options))
    reader = _SafetensorsReader(files, progress=comm.global_rank == 0) if fs is None else \
        _RangedReader(files, progress=comm.global_rank == 0, fs=fs)
    # Every rank reads the headers itself (a few kB each), so every rank can plan its own reads.
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


class _SafetensorsReader(HuggingFaceStorageReader):
    """torch's Hugging Face reader, restricted to the checkpoint's own files and holding one slice at a time.

    - torch's reader lists every ``.safetensors`` file in the directory; a directory may hold more than one
      checkpoint (``model.safetensors`` beside an indexed set, or a single file chosen among others).
    - torch's reader keeps each file open while it reads all of this rank's slices from it. A file is mapped, and
      every page a mapping touched stays resident until it closes, so a 10 GB file would cost this rank its whole
      share of those 10 GB on top of its shards. Here each slice opens the file anew: the header costs a few kB
      per read, and at most one slice is resident at a time.
    """

    def __init__(self, files: list[Path], *, progress: bool) -> None:
        super().__init__(str(files[0].parent))
        self.fs = _Listing(self.fs, files)
        self._progress = progress
        self.placed: set[str] = set()  # the files whose header places their chunks (DCP_SHARDING_INFO)
        self.holders: dict[str, dict[str, torch.dtype]] = defaultdict(dict)  # tensor -> file -> stored dtype

    def read_metadata(self) -> Metadata:
        from safetensors import safe_open

        # torch's reader trusts the sharding info; check it first, so a bad one is an error naming the file.
        for name in self.fs.ls(self.path):
            with _header_of(name):  # safetensors checks the header's length, JSON and offsets against the file
                with safe_open(name, framework="pt") as file:
                    header = file.metadata()
                    slices = {key: file.get_slice(key) for key in file.keys()}
                    shapes = {key: s.get_shape() for key, s in slices.items()}
                    dtypes = {key: piece.get_dtype() for key, piece in slices.items()}
            hf_checks.check_sharding_info(name, header, shapes)
            for key, dtype in dtypes.items():
                self.holders[key][name] = _stored_dtype(name, key, dtype)
            if header and header.get(hf_checks.SHARDING_INFO_KEY):
                self.placed.add(name)
        with _header_of(self.path):  # torch parses the headers again, once safetensors has found them sound
            return super().read_metadata()

    def read_data(self, plan: Any, planner: Any) -> Future:
        from safetensors import safe_open
        from tqdm import tqdm  # Lightning depends on tqdm

        # Rank 0's share stands for all; shown only when the load takes more than a couple of seconds.
        items = tqdm(plan.items, desc="Loading pretrained weights", unit="tensor", delay=2.0,
                     disable=not self._progress, leave=False)
        for item in items:
            info = self.storage_data[item.storage_index]
            region = tuple(slice(start, start + length) for start, length in zip(item.storage_offsets, item.lengths))
            with safe_open(info.relative_path, framework="pt") as file:
                piece = file.get_slice(item.storage_index.fqn)[region]
            target = planner.resolve_tensor(item).detach()
            if target.shape != piece.shape:  # copy_ would broadcast a smaller piece silently
                raise RuntimeError(f"internal error: {item.storage_index.fqn!r} read {list(piece.shape)} from"
                                   f" {info.relative_path!r} for a slice of {list(target.shape)}")
            target.copy_(piece)  # converts the dtype too: a bf16 file into fp32 parameters, or back
            planner.commit_tensor(item, target)
            del piece
        done: Future = Future()
        done.set_result(None)
        return done


@dataclass(frozen=True)
class _RangedInfo:
    """Where a stored tensor is (what ``read_data`` needs of ``Metadata.storage_data``)."""

    relative_path: str


class _RangedReader(_SafetensorsReader):
    """The same reader for files at a URL, read through fsspec by byte ranges (:class:`RangedFile`): every rank
    reads the headers, then only the rows of each tensor that its shards need, ``_RANGES_IN_FLIGHT`` bytes of
    ranges at a time in one ``cat_ranges`` call (s3fs sends them concurrently). The metadata is built as torch's
    reader builds it from local files, with the same checks before it."""

    def __init__(self, files: list[str], *, progress: bool, fs: Any) -> None:
        HuggingFaceStorageReader.__init__(self, files[0].rsplit("/", 1)[0])
        self._files, self._remote_fs, self._progress = files, fs, progress
        self._opened: dict[str, RangedFile] = {}
        self.placed = set()
        self.holders = defaultdict(dict)

    def read_metadata(self) -> Metadata:
        from torch.distributed.checkpoint.metadata import (
            ChunkStorageMetadata, MetadataIndex, StorageMeta, TensorProperties, TensorStorageMetadata,
        )

        stored: dict[str, TensorStorageMetadata] = {}
        storage: dict[MetadataIndex, _RangedInfo] = {}
        for url in self._files:
            with _header_of(url):
                file = self._opened[url] = RangedFile(self._remote_fs, url)
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
        batch: list[tuple[Any, RangedFile, tuple[slice, ...], int, int]] = []
        held = 0
        for item in plan.items:
            file = self._opened[self.storage_data[item.storage_index].relative_path]
            region = tuple(slice(start, start + length) for start, length in zip(item.storage_offsets, item.lengths))
            start, end = file.row_range(item.storage_index.fqn, region)
            batch.append((item, file, region, start, end))
            held += end - start
            if held >= _RANGES_IN_FLIGHT:
                self._read(batch, planner)
                batch, held = [], 0
        self._read(batch, planner)
        done: Future = Future()
        done.set_result(None)
        return done

    def _read(self, batch: list, planner: Any) -> None:
        if not batch:
            return
        datas = self._remote_fs.cat_ranges([file.url for _, file, _, _, _ in batch], [b[3] for b in batch],
                                           [b[4] for b in batch], on_error="return")
        for (item, file, region, start, end), data in zip(batch, datas):
            if isinstance(data, BaseException) or len(data) != end - start:
                why = data if isinstance(data, BaseException) else f"{len(data)} bytes of {end - start}"
                raise unreadable(file.url, OSError(f"bytes {start}-{end} could not be read ({why})"))
            piece = file.piece(item.storage_index.fqn, region, data)
            target = planner.resolve_tensor(item).detach()
            if target.shape != piece.shape:
                raise RuntimeError(f"internal error: {item.storage_index.fqn!r} read {list(piece.shape)} from"
                                   f" {file.url!r} for a slice of {list(target.shape)}")
            target.copy_(piece)
            planner.commit_tensor(item, target)


_RANGES_IN_FLIGHT = 64 * 2**20  # bytes of ranges requested together (s3fs keeps them in flight concurrently)


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


def _stored_dtype(file: str, tensor: str, name: str) -> torch.dtype:
    if name not in _DTYPES:
        raise TypeError(f"{file!r} stores {tensor!r} as {name}, a dtype torch cannot load. Allowed:"
                        f" {', '.join(_DTYPES)}. HINT: convert the file with the library that wrote it.")
    return _DTYPES[name]


class _Listing:
    """DCP's file system object, except that listing the directory yields only the chosen files."""

    def __init__(self, fs: Any, files: list[Path]) -> None:
        self._fs = fs
        self._files = [str(f) for f in files]

    def ls(self, path: Any) -> list[str]:
        return list(self._files)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fs, name)


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
