"""Offline conversions between checkpoint formats, and their description: pure functions for one process.

Nothing here needs a process group, and nothing holds a whole model in memory. A checkpoint is first opened into
a *tree*: its nested dicts and lists as saved, with every model and optimizer tensor replaced by a
:class:`TensorEntry` (path, shape, dtype). Opening reads only metadata. Tensors are then read a little at a time,
and each is written out and freed before more are read:

- **sharded** sources are read through DCP, one batch (:data:`READ_BATCH_BYTES`) per ``dcp.load(no_dist=True)``;
- **full** sources are memory-mapped afresh for every shard written: the pages a mapping has touched count as
  resident memory until the mapping goes, and it goes only once every tensor taken from it is gone.

Peak memory is therefore about one batch plus what the writer must hold: one tensor for a full file (streamed by
:func:`~lightning_fsdp.checkpoint.full_writer.write_streaming`), one shard for safetensors, one tensor for DCP
(see :class:`_StreamingSavePlanner`). A safetensors export without ``max_shard_size`` is a single shard, so it
holds all model weights at once (not the optimizer state). Measured on a 201 MB model of 4 MiB tensors, extra peak
RSS was 6 MB (full -> sharded) to 21 MB (sharded -> safetensors in 20 MB shards); ``tests/workers/convert_memory.py``
measures it.

Nothing is unpickled freely unless ``allow_pickle`` is given: DCP's ``.metadata`` goes through the allow-list of
:mod:`.safe_pickle`, everything else through ``torch.load(weights_only=True)``. Sharded sources are checked against
their checksums as they are read, full sources before (:mod:`.checksums`), and sharded outputs record checksums.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import math
import mmap
import os
import pickle
import re
import sys
import uuid
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from lightning_fsdp.checkpoint import atomic
from lightning_fsdp.checkpoint.checksums import ChecksumError, ChecksumWriter, VerifyingReader, new_save_id, verify_zip
from lightning_fsdp.checkpoint.full_writer import write_streaming
from lightning_fsdp.checkpoint.layout import METADATA_FILENAME, is_full_checkpoint, is_sharded_checkpoint
from lightning_fsdp.checkpoint.safe_pickle import UnsafeCheckpointError, load_file

__all__ = [
    "UsageError",
    "TensorEntry",
    "Checkpoint",
    "open_checkpoint",
    "describe",
    "convert",
    "parse_size",
    "FORMATS",
    "SAFETENSORS_FILENAME",
    "SAFETENSORS_INDEX_FILENAME",
]

FORMATS = ("full", "sharded", "safetensors")
READ_BATCH_BYTES = 8 * 2**20
"""Tensor bytes read per batch. Far below any useful shard size, yet large enough that a checkpoint full of small
tensors (biases, optimizer step counters) does not pay one DCP read, or one file mapping, each."""

SAFETENSORS_FILENAME = "model.safetensors"
SAFETENSORS_INDEX_FILENAME = "model.safetensors.index.json"
_SHARD_NAME = "model-{index:05d}-of-{count:05d}.safetensors"
_DCP_FILE = re.compile(r"__(\d+)_\d+\.distcp")
_SIZE = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*([kmgt]i?b|b)?", re.IGNORECASE)
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}

Progress = Callable[[int, int], None]
"""Called with (bytes written, bytes in total) as tensors are written."""


class UsageError(ValueError):
    """Input the user can fix (a path, a format, an option). The message names the problem and the fix; the
    command line prints it on one line and exits with status 2."""


@dataclass(frozen=True, eq=False)
class TensorEntry:
    """A tensor of a checkpoint, known by its place and its shape; its data stays on disk until read."""

    path: tuple[Union[str, int], ...]
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def name(self) -> str:
        """The flat name, as DCP stores it: ``optimizer.state.fc.weight.exp_avg``."""
        return ".".join(str(p) for p in self.path)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


# ----------------------------------------------------------------------------------------------------- opening


class Checkpoint:
    """An opened checkpoint: what it holds, and a way to read its tensors a batch at a time."""

    format: str
    world_size: int
    path: Path
    tree: dict[str, Any]  # the models and optimizers, with tensors replaced by TensorEntry
    metadata: dict[str, Any]  # every other entry of the user's state, as saved
    models: list[str]
    optimizers: list[str]

    def tensors(self, keys: Optional[Iterable[str]] = None) -> list[TensorEntry]:
        """The tensors under the given top-level keys (default: all), in the order a full file stores them."""
        chosen = list(self.tree) if keys is None else list(keys)
        return [leaf for key in chosen for leaf in _leaves(self.tree[key]) if isinstance(leaf, TensorEntry)]

    def read(self, entries: Iterable[TensorEntry]) -> Iterator[tuple[TensorEntry, torch.Tensor]]:
        """Yield each entry with its data. Memory stays bounded as long as the caller drops what it is done with:

        - sharded: read a batch at a time (:data:`READ_BATCH_BYTES`) into fresh memory;
        - full: views into one fresh memory mapping per call. Pages become resident as they are touched and stay
          so until every tensor of the call is dropped, so ask for one shard's worth at a time.
        """
        raise NotImplementedError


def open_checkpoint(path: Union[str, Path], *, allow_pickle: bool = False) -> Checkpoint:
    """Open a full or sharded checkpoint for inspection or conversion; reads metadata only.

    ``allow_pickle`` lets entries that are not tensors, numbers, strings or containers be unpickled, which can
    run arbitrary code: only for checkpoints you trust.
    """
    path = Path(path)
    if not path.exists():
        raise UsageError(f"{str(path)!r} does not exist. HINT: pass the path a checkpoint save wrote, e.g."
                         " `checkpoints/step-1000` (sharded) or `checkpoints/step-1000.pt` (full).")
    if is_sharded_checkpoint(path):
        return _ShardedCheckpoint(path, allow_pickle=allow_pickle)
    if is_full_checkpoint(path):
        return _FullCheckpoint(path, allow_pickle=allow_pickle)
    if path.suffix == ".safetensors":
        problem = "is a safetensors export, which holds model weights only and cannot be converted back"
    elif path.is_dir():
        problem = "is a directory without DCP's '.metadata' file, so it is not a sharded checkpoint"
    else:
        problem = "is not a torch.save zip archive, so it is not a full checkpoint (it may be truncated)"
    raise UsageError(f"{str(path)!r} {problem}. HINT: pass a full checkpoint file or a sharded checkpoint"
                     " directory, as written by `fabric.save`.")


class _ShardedCheckpoint(Checkpoint):
    format = "sharded"

    def __init__(self, path: Path, *, allow_pickle: bool) -> None:
        self.path = path
        self._allow_pickle = allow_pickle
        self._reader = _CachedReader(path, allow_pickle=allow_pickle)
        with _reading(path / ".metadata"):
            stored = self._reader.read_metadata()
        self.world_size = len({int(m.group(1)) for m in map(_DCP_FILE.fullmatch, os.listdir(path)) if m})
        # DCP's save planner records the original key path of each flat name ("planner_data"). It is what tells a
        # dotted parameter name from nesting; a checkpoint without it falls back to the layout every writer uses.
        key_paths = stored.planner_data if isinstance(stored.planner_data, dict) else {}
        kinds = stored.state_dict_metadata
        names = [n for n in key_paths if n in kinds] + [n for n in kinds if n not in key_paths]
        objects = self._read_objects([n for n in names if not isinstance(kinds[n], TensorStorageMetadata)])
        tree: dict[str, Any] = {}
        for name in names:
            key_path = tuple(key_paths[name]) if name in key_paths else _path_from_flat_name(name)
            kind = kinds[name]
            if isinstance(kind, TensorStorageMetadata):
                _insert(tree, key_path, TensorEntry(key_path, tuple(kind.size), kind.properties.dtype))
            else:
                _insert(tree, key_path, objects[name])
        self.tree = _lists_from_int_keys(tree)
        meta_file = path / METADATA_FILENAME
        self.metadata = _load_file(meta_file, allow_pickle) if meta_file.is_file() else {}
        if not isinstance(self.metadata, dict):
            raise UsageError(f"{str(meta_file)!r} holds a {type(self.metadata).__name__}, not a dict of entries."
                             " HINT: a checkpoint save did not write it; move it out of the checkpoint directory.")
        # In the sharded layout DCP holds models and optimizers only; everything else went to meta.pt.
        self.optimizers = [k for k, v in self.tree.items() if _is_optimizer(v)]
        self.models = [k for k in self.tree if k not in self.optimizers]
        for key in self.optimizers:
            _restore_parameter_ids(self.tree[key])

    def _read_objects(self, names: list[str]) -> dict[str, Any]:
        """The entries that are not tensors (optimizer hyperparameters, parameter-name lists): small, read at once."""
        if not names:
            return {}
        objects: dict[str, Any] = dict.fromkeys(names)
        planner = _Planner(self._allow_pickle)
        with _reading(self.path), _single_process():
            dcp.load(objects, storage_reader=self._reader, planner=planner, no_dist=True)
        if planner.refused:
            raise UsageError(_needs_pickle(f"The entry {planner.refused[0]!r} of {str(self.path)!r}"))
        return objects

    def read(self, entries: Iterable[TensorEntry]) -> Iterator[tuple[TensorEntry, torch.Tensor]]:
        for batch in _batches(entries, READ_BATCH_BYTES):
            _return_freed_memory()  # the previous batch, written and dropped by now
            buffers = {e.name: torch.empty(e.shape, dtype=e.dtype) for e in batch}
            with _reading(self.path), _single_process():
                dcp.load(buffers, storage_reader=self._reader, planner=_Planner(self._allow_pickle), no_dist=True)
            for entry in batch:
                yield entry, buffers.pop(entry.name)


class _FullCheckpoint(Checkpoint):
    format = "full"
    world_size = 1

    def __init__(self, path: Path, *, allow_pickle: bool) -> None:
        self.path = path
        self._allow_pickle = allow_pickle
        contents = self.load()
        if not isinstance(contents, dict):
            raise UsageError(f"{str(path)!r} holds a {type(contents).__name__}, not a dict of checkpoint entries."
                             " HINT: convert a file written by a checkpoint save or by `torch.save(state_dict)`.")
        # A file of just `model.state_dict()` is one model, under the key our loader gives it.
        self.bare = bool(contents) and all(torch.is_tensor(v) for v in contents.values())
        if self.bare:
            contents = {"model": contents}
        self.optimizers = [k for k, v in contents.items() if _is_optimizer(v)]
        self.models = [k for k, v in contents.items() if k not in self.optimizers and _is_model(v)]
        # The tree holds no tensor, so no page of this mapping stays touched; metadata is kept as loaded.
        self.tree = {k: _entries(contents[k], (k,)) for k in [*self.models, *self.optimizers]}
        self.metadata = {k: v for k, v in contents.items() if k not in self.tree}

    def load(self) -> Any:
        """Map the file anew: only pages touched through this mapping become resident, until it goes."""
        return _load_file(self.path, self._allow_pickle)

    def read(self, entries: Iterable[TensorEntry]) -> Iterator[tuple[TensorEntry, torch.Tensor]]:
        # One mapping per call, not per batch: mapping means unpickling the file's index with `weights_only`,
        # 0.3 s for 4,000 tensors, which per 8 MiB batch would cost minutes on a 7B model.
        contents = self.load()
        for entry in entries:
            yield entry, _get(contents, entry.path[1:] if self.bare else entry.path)


class _CachedReader(VerifyingReader):
    """DCP re-reads ``.metadata`` on every ``load``; we load one small batch at a time, so read it once."""

    def __init__(self, path: Path, *, allow_pickle: bool) -> None:
        super().__init__(path, allow_pickle=allow_pickle)
        self._metadata: Any = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        if args or kwargs:
            return super().read_metadata(*args, **kwargs)
        if self._metadata is None:
            self._metadata = super().read_metadata()
        return self._metadata


class _Planner(dcp.DefaultLoadPlanner):
    """Loads into the flat names we pass, as they are. DCP's default unpickles non-tensor entries without
    ``weights_only`` (any object, any code); this one refuses what ``weights_only`` refuses, unless allowed."""

    def __init__(self, allow_pickle: bool) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.allow_pickle = allow_pickle
        self.refused: list[str] = []

    def load_bytes(self, read_item: Any, value: Any) -> None:
        name = read_item.dest_index.fqn
        try:
            self.original_state_dict[name] = torch.load(value, weights_only=not self.allow_pickle)
        except pickle.UnpicklingError:
            self.refused.append(name)  # raised after the load: DCP would bury it in a multi-line report


def _return_freed_memory() -> None:
    """Give freed heap memory back to the OS (glibc only; elsewhere a no-op).

    glibc serves large blocks from mmap at first, but after the first such block is freed it raises its mmap
    threshold (up to 32 MiB), and later tensors of a few MiB come from the heap. Freed heap memory stays resident,
    fragmented across batches of different sizes: converting a 200 MB model in 8 MiB batches peaked 130 to 230 MB
    above the start without this. ``malloc_trim`` releases free pages and changes no allocation policy, so it is
    safe in a library.
    """
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def _drop_file_pages(tensor: torch.Tensor) -> None:
    """Unmap the resident pages of a tensor memory-mapped from a file (Linux; elsewhere a no-op).

    Safe at any moment, even while the tensor is still in use: its pages are file pages nobody wrote to, so the
    kernel maps them again from the file (or its cache) if they are touched again. The range is widened to whole
    pages, which may drop a neighbour's pages too, with the same guarantee.
    """
    advice = getattr(mmap, "MADV_DONTNEED", None)
    if _LIBC is None or advice is None or not sys.platform.startswith("linux"):
        return
    storage = tensor.untyped_storage()
    start = storage.data_ptr() - storage.data_ptr() % mmap.PAGESIZE
    length = storage.data_ptr() + storage.nbytes() - start
    if storage.nbytes():
        _LIBC.madvise(ctypes.c_void_p(start), ctypes.c_size_t(length), ctypes.c_int(advice))


def _find_libc() -> Any:
    try:
        libc = ctypes.CDLL(None)
    except OSError:
        return None
    return libc if hasattr(libc, "malloc_trim") and hasattr(libc, "madvise") else None


_LIBC = _find_libc()


@contextlib.contextmanager
def _single_process() -> Iterator[None]:
    """Around every DCP call: silence the warning that it "assumes" one process (``no_dist=True`` is our intent),
    and raise the original error. DCP wraps every exception, Ctrl-C included, in a ``CheckpointException`` with a
    multi-line report, which would turn an interrupt or a full disk into a traceback."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        try:
            yield
        except CheckpointException as err:
            failures = [f[0] for f in err.failures.values() if isinstance(f, tuple) and isinstance(f[0], BaseException)]
            if not failures:
                raise
            raise failures[0] from err


def _load_file(path: Path, allow_pickle: bool) -> Any:
    with _reading(path):
        try:
            return load_file(path, allow_pickle=allow_pickle)
        except pickle.UnpicklingError as err:  # what `weights_only` raises for objects it refuses
            raise UsageError(_needs_pickle(repr(str(path)))) from err


@contextlib.contextmanager
def _reading(path: Path) -> Iterator[None]:
    """A checkpoint that does not parse is the user's problem to fix (exit 2), not a traceback."""
    try:
        yield
    except UsageError:
        raise
    except (UnsafeCheckpointError, ChecksumError) as err:  # their messages name the file and the fix already
        raise UsageError(str(err)) from err
    except (RuntimeError, ValueError, EOFError, AssertionError, pickle.UnpicklingError) as err:
        lines = str(err).strip().splitlines()
        cause = lines[0] if lines else type(err).__name__
        raise UsageError(f"{str(path)!r} could not be read ({cause}). HINT: it may be truncated or corrupted; use an"
                         " earlier checkpoint, or save this one again.") from err


def _needs_pickle(what: str) -> str:
    return (f"{what} holds objects that only full unpickling can restore, and unpickling can run arbitrary code."
            " HINT: if you trust this checkpoint, allow it with `--allow-pickle` (Python: `allow_pickle=True`).")


# -------------------------------------------------------------------------------------------------- inspecting


def describe(checkpoint: Checkpoint, *, tensors: bool = False) -> dict[str, Any]:
    """What ``lightning-fsdp inspect`` shows, as plain JSON-ready data."""
    models = {}
    for key in checkpoint.models:
        by_dtype: dict[str, dict[str, int]] = {}
        for entry in checkpoint.tensors([key]):
            counts = by_dtype.setdefault(_dtype_name(entry.dtype), {"parameters": 0, "bytes": 0})
            counts["parameters"] += entry.numel
            counts["bytes"] += entry.nbytes
        models[key] = {
            "parameters": sum(c["parameters"] for c in by_dtype.values()),
            "bytes": sum(c["bytes"] for c in by_dtype.values()),
            "dtypes": by_dtype,
        }
    optimizers = {}
    for key in checkpoint.optimizers:
        entries = checkpoint.tensors([key])
        groups = checkpoint.tree[key].get("param_groups", [])
        optimizers[key] = {
            "state_tensors": len(entries),
            "bytes": sum(e.nbytes for e in entries),
            "param_groups": len(groups) if isinstance(groups, list) else 0,
        }
    info: dict[str, Any] = {
        "path": str(checkpoint.path),
        "format": checkpoint.format,
        "world_size": checkpoint.world_size,
        "models": models,
        "optimizers": optimizers,
        "metadata_keys": [str(k) for k in checkpoint.metadata],
    }
    if tensors:
        info["tensors"] = [
            {"name": e.name, "shape": list(e.shape), "dtype": _dtype_name(e.dtype)} for e in checkpoint.tensors()
        ]
    return info


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# -------------------------------------------------------------------------------------------------- converting


def convert(
    source: Union[str, Path, Checkpoint],
    destination: Union[str, Path],
    *,
    to: str,
    max_shard_size: Optional[int] = None,
    model: Optional[str] = None,
    overwrite: bool = False,
    allow_pickle: bool = False,
    progress: Optional[Progress] = None,
) -> Path:
    """Write ``source`` in another format at ``destination``, atomically; returns ``destination``.

    - ``to="full"``: one ``torch.save`` file, the layout a full save writes (``torch.load(weights_only=True)``
      reads it); the entries of ``meta.pt`` go to its top level.
    - ``to="sharded"``: a DCP directory plus ``meta.pt``, the layout a sharded save writes.
    - ``to="safetensors"``: model weights only. ``destination`` ending in ``.safetensors`` is that one file;
      anything else is a directory with ``model.safetensors``, or with ``max_shard_size`` (bytes) shards
      ``model-00001-of-0000N.safetensors`` and ``model.safetensors.index.json``, as Hugging Face writes them.
      Several models are exported together with their key prefixed to each name (``model.fc.weight``,
      ``ema.fc.weight``); ``model="ema"`` exports one model, unprefixed.
    """
    if to not in FORMATS:
        raise UsageError(f"Unknown target format {to!r}. Allowed: {', '.join(FORMATS)}. HINT: e.g. `--to full`.")
    if to != "safetensors" and (max_shard_size is not None or model is not None):
        option = "--max-shard-size" if max_shard_size is not None else "--model"
        raise UsageError(f"`{option}` applies to `--to safetensors` only, not `--to {to}`. HINT: drop `{option}`,"
                         " or export weights with `--to safetensors`.")
    if max_shard_size is not None and max_shard_size <= 0:
        raise UsageError(f"Invalid max_shard_size={max_shard_size!r}. Allowed: a positive number of bytes."
                         " HINT: e.g. `--max-shard-size 500MB`.")
    checkpoint = source if isinstance(source, Checkpoint) else open_checkpoint(source, allow_pickle=allow_pickle)
    target = Path(destination)
    if checkpoint.format == to:
        others = " or ".join(f"`--to {f}`" for f in FORMATS if f != to)
        raise UsageError(f"{str(checkpoint.path)!r} is already a {to} checkpoint, so there is nothing to convert."
                         f" HINT: choose {others}.")
    _check_destination(checkpoint.path, target, overwrite, to)
    if checkpoint.format == "full":
        with _reading(checkpoint.path):  # sharded sources are checked as they are read
            verify_zip(checkpoint.path)
    if to == "full":
        writer: Callable[[Path], None] = lambda staged: _write_full(checkpoint, staged, progress)
    elif to == "sharded":
        writer = lambda staged: _write_sharded(checkpoint, staged, progress)  # noqa: E731
    else:
        keys = _export_models(checkpoint, model)
        single_file = target.suffix == ".safetensors"
        if single_file and max_shard_size is not None:
            raise UsageError(f"Sharded safetensors go into a directory, but DST {str(target)!r} names a file."
                             f" HINT: pass a directory, e.g. `{target.with_suffix('')}`, or drop --max-shard-size.")
        writer = lambda staged: _write_safetensors(  # noqa: E731
            checkpoint, keys, staged, single_file=single_file, max_shard_size=max_shard_size, progress=progress
        )
    _write_atomically(target, writer)
    return target


def _check_destination(source: Path, target: Path, overwrite: bool, to: str) -> None:
    src, dst = source.resolve(), target.resolve()
    if dst == src or src in dst.parents or dst in src.parents:
        raise UsageError(f"DST {str(target)!r} overlaps SRC {str(source)!r}, and writing it would destroy the"
                         " source. HINT: choose a DST outside the source checkpoint.")
    if not (target.exists() or target.is_symlink()):
        return
    if not overwrite:
        raise UsageError(f"DST {str(target)!r} already exists. HINT: pass --overwrite to replace it, or choose"
                         " another DST.")
    if to == "safetensors" and _is_safetensors_export(target):
        return
    try:
        atomic.check_replaceable(target)  # never replaces what is not a checkpoint (a user's files)
    except (IsADirectoryError, FileExistsError) as err:
        raise UsageError(str(err)) from err


def _is_safetensors_export(path: Path) -> bool:
    """A file or directory this module could have written as a safetensors export."""
    if path.is_file():
        return path.suffix == ".safetensors"
    names = [p.name for p in path.iterdir()] if path.is_dir() else []
    return bool(names) and all(n.endswith(".safetensors") or n == SAFETENSORS_INDEX_FILENAME for n in names)


def _write_atomically(target: Path, write: Callable[[Path], None]) -> None:
    """Write into a staging path beside ``target`` and move it into place only when complete."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staged = atomic.staging_path(target, uuid.uuid4().hex[:12])
    try:
        write(staged)
        atomic.fsync_tree(staged)
        atomic.commit(staged, target)
    except BaseException:
        atomic.discard(staged)
        raise


def _write_full(checkpoint: Checkpoint, staged: Path, progress: Optional[Progress]) -> None:
    """Stream tensors into one torch.save file: the skeleton holds meta-device stand-ins, and each one is read
    from the source only when the writer reaches it."""
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

    write_streaming(staged, {**skeleton, **checkpoint.metadata}, materialize)


def _write_sharded(checkpoint: Checkpoint, staged: Path, progress: Optional[Progress]) -> None:
    assert isinstance(checkpoint, _FullCheckpoint)  # the only other format, checked by `convert`
    contents = checkpoint.load()  # memory-mapped: DCP touches each tensor only as it writes it
    if checkpoint.bare:
        contents = {"model": contents}
    state = {key: contents[key] for key in checkpoint.tree}
    meter = _Meter(checkpoint.tensors(), progress)
    staged.mkdir(parents=True)
    planner = _StreamingSavePlanner(meter)
    with _single_process():
        dcp.save(state, storage_writer=ChecksumWriter(staged, save_id=new_save_id()), planner=planner, no_dist=True)
    torch.save(checkpoint.metadata, staged / METADATA_FILENAME)


class _StreamingSavePlanner(dcp.DefaultSavePlanner):
    """DCP's default save planner for memory-mapped tensors, counting bytes as the writer asks for each one.

    DCP's writer keeps a reference to every tensor it wrote until its file is complete, which keeps every page of
    the source it touched mapped: the whole model. So each call drops the pages of the tensor handed out before,
    which the writer has written by then (see :func:`_drop_file_pages` for why this is safe at any time).
    """

    def __init__(self, meter: _Meter) -> None:
        super().__init__()
        self.meter = meter
        self.previous: Optional[torch.Tensor] = None

    def resolve_data(self, write_item: Any) -> Any:
        if self.previous is not None:
            _drop_file_pages(self.previous)
            self.previous = None
        data = super().resolve_data(write_item)
        if isinstance(data, torch.Tensor):
            self.meter.add_bytes(data.numel() * data.element_size())
            self.previous = data
        return data


def _export_models(checkpoint: Checkpoint, model: Optional[str]) -> list[str]:
    if not checkpoint.models:
        raise UsageError(f"{str(checkpoint.path)!r} holds no model weights to export (entries:"
                         f" {sorted(map(str, checkpoint.tree))}). HINT: pass a checkpoint saved with its model.")
    if model is None:
        return checkpoint.models
    if model not in checkpoint.models:
        raise UsageError(f"Invalid `--model {model}`: no such model in {str(checkpoint.path)!r}. Allowed:"
                         f" {', '.join(checkpoint.models)}. HINT: e.g. `--model {checkpoint.models[0]}`.")
    return [model]


def _write_safetensors(checkpoint: Checkpoint, keys: list[str], staged: Path, *, single_file: bool,
                       max_shard_size: Optional[int], progress: Optional[Progress]) -> None:
    from safetensors.torch import save_file

    prefixed = len(keys) > 1
    entries = checkpoint.tensors(keys)
    names = {id(e): ".".join(str(p) for p in (e.path if prefixed else e.path[1:])) for e in entries}
    shards = list(_batches(entries, max_shard_size)) if max_shard_size else [entries]
    if single_file:
        files = [staged]
    else:
        staged.mkdir(parents=True)
        single = len(shards) == 1  # like Hugging Face: one shard is a plain model.safetensors, without an index
        files = [staged / (SAFETENSORS_FILENAME if single else _SHARD_NAME.format(index=i + 1, count=len(shards)))
                 for i in range(len(shards))]
    meter = _Meter(entries, progress)
    weight_map: dict[str, str] = {}
    for shard, file in zip(shards, files):
        tensors: dict[str, torch.Tensor] = {}
        storages: set[int] = set()
        for entry, tensor in checkpoint.read(shard):
            # safetensors writes exactly a tensor's elements, but refuses tensors that overlap in memory: tied
            # weights, or views of one storage that torch.save kept shared (`a = w[:6]; b = w[4:]`). A tensor gets
            # its own copy when it is not contiguous or when an earlier one of this shard used its storage.
            storage = tensor.untyped_storage().data_ptr()
            if storage in storages or not tensor.is_contiguous():
                tensor = tensor.clone(memory_format=torch.contiguous_format)
            storages.add(tensor.untyped_storage().data_ptr())
            tensors[names[id(entry)]] = tensor
            weight_map[names[id(entry)]] = file.name
        save_file(tensors, str(file), metadata={"format": "pt"})  # "pt": what transformers checks before loading
        _umask_mode(file)
        for entry in shard:
            meter.add(entry)
        del tensors  # written: free the shard before reading the next one
    if len(files) > 1:
        index = {"metadata": {"total_size": sum(e.nbytes for e in entries)}, "weight_map": weight_map}
        (staged / SAFETENSORS_INDEX_FILENAME).write_text(json.dumps(index, indent=2) + "\n")


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


def parse_size(text: str) -> int:
    """``"500MB"`` -> 500_000_000. Units as Hugging Face reads them: KB, MB, GB, TB are powers of 1000, KiB, MiB,
    GiB, TiB powers of 1024; a bare number is bytes."""
    match = _SIZE.fullmatch(text.strip())
    size = float(match.group(1)) * _UNITS[(match.group(2) or "b").lower()] if match else 0
    if not match or size < 1:
        raise UsageError(f"Invalid size {text!r}. Allowed: a positive number with an optional unit B, KB, MB, GB,"
                         " TB (powers of 1000) or KiB, MiB, GiB, TiB (powers of 1024). HINT: e.g. `500MB` or `2GiB`.")
    return int(size)


# ----------------------------------------------------------------------------------------------- tree helpers


def _is_optimizer(value: Any) -> bool:
    return isinstance(value, dict) and ("state" in value or "param_groups" in value)


def _is_model(value: Any) -> bool:
    return isinstance(value, dict) and bool(value) and all(torch.is_tensor(v) for v in value.values())


def _path_from_flat_name(name: str) -> tuple[Union[str, int], ...]:
    """Split a DCP flat name without the planner's record: parameter names keep their dots, and optimizer
    entries are ``<key>.state.<param>.<state name>`` or ``<key>.param_groups.<index>.<hyperparameter>``."""
    top, _, rest = name.partition(".")
    if rest.startswith("state."):
        param, _, state_name = rest[len("state."):].rpartition(".")
        return (top, "state", param, state_name)
    if rest.startswith("param_groups."):
        index, _, field = rest[len("param_groups."):].partition(".")
        return (top, "param_groups", int(index), field) if index.isdigit() else (top, "param_groups", rest)
    return (top, rest) if rest else (top,)


def _insert(root: dict, path: tuple, value: Any) -> None:
    node = root
    for key in path[:-1]:
        node = node.setdefault(key, {})
    node[path[-1]] = value


def _lists_from_int_keys(node: Any) -> Any:
    """DCP's key paths hold a dict key as a string and a list item as its int index: nodes keyed 0..n-1 were lists."""
    if not isinstance(node, dict):
        return node
    node = {k: _lists_from_int_keys(v) for k, v in node.items()}
    if node and all(isinstance(k, int) for k in node) and sorted(node) == list(range(len(node))):
        return [node[i] for i in range(len(node))]
    return node


def _restore_parameter_ids(optimizer: Any) -> None:
    """A plain ``optimizer.state_dict()`` keys its state by the int ids listed in ``param_groups[i]["params"]``;
    DCP turned those keys into strings. Put back the ones the param groups name."""
    if not isinstance(optimizer, dict) or not isinstance(optimizer.get("state"), dict):
        return
    groups = optimizer.get("param_groups")
    ids = {str(p): p for g in groups if isinstance(g, dict) for p in g.get("params", []) if type(p) is int} \
        if isinstance(groups, list) else {}
    optimizer["state"] = {ids.get(k, k): v for k, v in optimizer["state"].items()}


def _entries(value: Any, path: tuple) -> Any:
    """Replace every tensor under ``value`` with its TensorEntry."""
    if torch.is_tensor(value):
        return TensorEntry(path, tuple(value.shape), value.dtype)
    if isinstance(value, dict):
        return {k: _entries(v, (*path, k)) for k, v in value.items()}
    if type(value) in (list, tuple):
        return type(value)(_entries(v, (*path, i)) for i, v in enumerate(value))
    return value


def _map_leaves(value: Any, fn: Callable[[Any], Any]) -> Any:
    if isinstance(value, dict):
        return {k: _map_leaves(v, fn) for k, v in value.items()}
    if type(value) in (list, tuple):
        return type(value)(_map_leaves(v, fn) for v in value)
    return fn(value)


def _leaves(value: Any) -> Iterator[Any]:
    if isinstance(value, dict):
        for v in value.values():
            yield from _leaves(v)
    elif type(value) in (list, tuple):
        for v in value:
            yield from _leaves(v)
    else:
        yield value


def _get(root: Any, path: tuple) -> Any:
    for key in path:
        root = root[key]
    return root


def _batches(entries: Iterable[TensorEntry], budget: int) -> Iterator[list[TensorEntry]]:
    """Consecutive entries up to ``budget`` bytes each; an entry larger than the budget goes alone."""
    batch: list[TensorEntry] = []
    size = 0
    for entry in entries:
        if batch and size + entry.nbytes > budget:
            yield batch
            batch, size = [], 0
        batch.append(entry)
        size += entry.nbytes
    if batch:
        yield batch
