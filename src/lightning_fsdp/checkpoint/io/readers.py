"""Opening checkpoints for offline conversion and description, and reading their tensors a batch at a time.

A checkpoint is opened into a *tree*: its nested dicts and lists as saved, with every model and optimizer tensor
replaced by a :class:`TensorEntry` (path, shape, dtype). Opening reads only metadata. Tensors are then read a
little at a time:

- **sharded** sources are read through DCP, one batch (:data:`READ_BATCH_BYTES`) per ``dcp.load(no_dist=True)``;
- **full** sources are memory-mapped afresh for every call of :meth:`Checkpoint.read`: the pages a mapping has
  touched count as resident memory until the mapping goes, and it goes only once every tensor taken from it is gone.

Nothing is unpickled freely unless ``allow_pickle`` is given: DCP's ``.metadata`` goes through the allow-list of
:mod:`~lightning_fsdp.checkpoint.integrity.safe_pickle`, everything else through ``torch.load(weights_only=True)``. Sharded sources are checked against
their checksums as they are read.
"""

from __future__ import annotations

import contextlib
import math
import os
import pickle
import re
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from lightning_fsdp.checkpoint.formats.layout import METADATA_FILENAME, is_full_checkpoint, is_sharded_checkpoint
from lightning_fsdp.checkpoint.formats.torch_versions import NewerTorchFormatError
from lightning_fsdp.checkpoint.integrity.agreement import CheckpointError
from lightning_fsdp.checkpoint.integrity.safe_pickle import load_file
from lightning_fsdp.checkpoint.integrity.sharded_read import VerifyingReader, check_files
from lightning_fsdp.checkpoint.integrity.tree import MAX_DEPTH, TreeLimitError, leaves, map_leaves
from lightning_fsdp.checkpoint.io.memory import return_freed_memory

__all__ = ["UsageError", "TensorEntry", "Checkpoint", "open_checkpoint", "READ_BATCH_BYTES"]

READ_BATCH_BYTES = 8 * 2**20
"""Tensor bytes read per batch. Far below any useful shard size, yet large enough that a checkpoint full of small
tensors (biases, optimizer step counters) does not pay one DCP read, or one file mapping, each."""

_DCP_FILE = re.compile(r"__(\d+)_\d+\.distcp")


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
        with _reading(path):
            check_files(path)  # every file belongs to the save, before `.metadata` or `meta.pt` is relied on
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
        with _reading(path / ".metadata"):
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
            return_freed_memory()  # the previous batch, written and dropped by now
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
        with _reading(path):
            self.tree = {k: _entries(contents[k], (k,), repr(str(path))) for k in [*self.models, *self.optimizers]}
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
    # Their messages name the file and the fix (every reader of checkpoint bytes raises a CheckpointError so).
    except (CheckpointError, TreeLimitError, NewerTorchFormatError) as err:
        raise UsageError(str(err)) from err
    except (RuntimeError, ValueError, EOFError, AssertionError, pickle.UnpicklingError) as err:
        lines = str(err).strip().splitlines()
        cause = lines[0] if lines else type(err).__name__
        raise UsageError(f"{str(path)!r} could not be read ({cause}). HINT: it may be truncated or corrupted; use an"
                         " earlier checkpoint, or save this one again.") from err


def _needs_pickle(what: str) -> str:
    return (f"{what} holds objects that only full unpickling can restore, and unpickling can run arbitrary code."
            " HINT: if you trust this checkpoint, allow it with `--allow-pickle` (Python: `allow_pickle=True`).")


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
    if len(path) > MAX_DEPTH:  # the key paths come from the file; the tree built from them is walked recursively
        raise TreeLimitError(f"the checkpoint names an entry {len(path)} keys deep ({'.'.join(map(str, path[:8]))}...),"
                             f" deeper than the {MAX_DEPTH} levels a checkpoint may nest. HINT: a checkpoint save"
                             " never writes one; the file is damaged or was not written by a save.")
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


def _entries(value: Any, path: tuple, what: str) -> Any:
    """Replace every tensor under ``value`` with its TensorEntry (each shared container once, see :mod:`~lightning_fsdp.checkpoint.integrity.tree`)."""
    return map_leaves(value, lambda leaf, where: TensorEntry((*path, *where), tuple(leaf.shape), leaf.dtype)
                      if torch.is_tensor(leaf) else leaf, what=what)


def _map_leaves(value: Any, fn: Callable[[Any], Any]) -> Any:
    return map_leaves(value, lambda leaf, _: fn(leaf), what="the checkpoint")


def _leaves(value: Any) -> Iterator[Any]:
    return (leaf for _, leaf in leaves(value, what="the checkpoint"))


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
