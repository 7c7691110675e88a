"""Save and load ``state`` dicts of sharded models, their optimizers and plain objects.

Models and optimizers go through torch's distributed state-dict API (``get_model_state_dict`` and friends), so
their keys are clean parameter names (FQNs) whatever wrappers the model carries, and optimizer state is keyed by
those names too. Everything else in ``state`` is "metadata": saved as is, or through ``state_dict()`` for objects
that have one.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Callable, Optional, Protocol, Union

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import FSDPModule
from torch.nn import Module
from torch.optim import Optimizer

from lightning_fsdp.checkpoint import atomic
from lightning_fsdp.checkpoint.layout import METADATA_FILENAME, is_full_checkpoint, is_sharded_checkpoint

__all__ = ["save_checkpoint", "load_checkpoint", "Communicator"]


class Communicator(Protocol):
    """The collectives a save or load needs (the engine provides them)."""

    global_rank: int

    def barrier(self) -> None: ...

    def broadcast(self, obj: Any, src: int = 0) -> Any: ...


def save_checkpoint(
    path: Union[str, Path],
    state: dict[str, Any],
    *,
    full: bool,
    comm: Communicator,
    filter: Optional[dict[str, Callable[[str, Any], bool]]] = None,
) -> Path:
    """Write ``state`` to ``path``, replacing a previous checkpoint there only once the new one is complete."""
    target = Path(comm.broadcast(str(path)))
    atomic.check_replaceable(target)
    models, optimizers, metadata = _split(state)
    _reshard(models)
    if not models:
        raise ValueError(
            "The checkpoint state holds no model. HINT: pass the model that the strategy set up, like so:"
            " `save(path, {'model': model, 'optimizer': optimizer})` (Fabric: `fabric.save`)."
        )
    owners = _optimizer_owners(models, optimizers)
    options = StateDictOptions(full_state_dict=full, cpu_offload=full)
    tensors: dict[str, Any] = {key: get_model_state_dict(module, options=options) for key, module in models.items()}
    for key, optimizer in optimizers.items():
        fresh = not optimizer.state
        tensors[key] = get_optimizer_state_dict(owners[key], optimizer, options=options)
        if fresh:
            # The state-dict API initializes missing state with a zero-gradient step; undo that on the live
            # optimizer, so saving before the first step does not change training.
            optimizer.state.clear()
    for key, keep in (filter or {}).items():
        for converted in (tensors, metadata):
            if isinstance(converted.get(key), dict):
                converted[key] = {k: v for k, v in converted[key].items() if keep(k, v)}

    staged = atomic.staging_path(target, comm.broadcast(uuid.uuid4().hex[:12]))
    is_writer = comm.global_rank == 0
    try:
        if is_writer:
            target.parent.mkdir(parents=True, exist_ok=True)
        if full:
            if is_writer:
                torch.save({**tensors, **metadata}, staged)
        else:
            if is_writer:
                staged.mkdir(parents=True)
            comm.barrier()
            dcp.save(tensors, checkpoint_id=staged)
            if is_writer:
                torch.save(metadata, staged / METADATA_FILENAME)
        if is_writer:
            atomic.fsync_tree(staged)
        comm.barrier()
        if is_writer:
            atomic.commit(staged, target)
        comm.barrier()
    except BaseException:
        if is_writer:
            atomic.discard(staged)
        raise
    return target


def load_checkpoint(
    path: Union[str, Path],
    state: Union[Module, Optimizer, dict[str, Any]],
    *,
    strict: bool = True,
    weights_only: Optional[bool] = None,
    comm: Communicator,
) -> dict[str, Any]:
    """Restore ``state`` in place from ``path`` and return what the checkpoint holds beyond the requested keys."""
    source = Path(comm.broadcast(str(path)))
    weights_only = True if weights_only is None else weights_only
    if comm.global_rank == 0:
        atomic.recover(source)  # a save that died between its two renames left the old checkpoint aside
    comm.barrier()
    if not (is_sharded_checkpoint(source) or is_full_checkpoint(source)):
        raise FileNotFoundError(
            f"{str(source)!r} is not a checkpoint: expected a file (full checkpoint) or a directory with DCP"
            f" '.metadata' (sharded checkpoint). HINT: pass the path that the save wrote."
        )
    if isinstance(state, Module):
        _load_raw_module(source, state, strict=strict, weights_only=weights_only)
        return {}
    if isinstance(state, Optimizer):
        raise NotImplementedError(
            "Loading a lone optimizer is not supported, because its state is keyed by the model's parameter names."
            " HINT: load it together with its model: `load(path, {'model': model, 'optimizer': optimizer})`."
        )
    models, optimizers, _ = _split(state)
    _reshard(models)
    owners = _optimizer_owners(models, optimizers)
    if is_sharded_checkpoint(source):
        metadata = _torch_load(source / METADATA_FILENAME, weights_only) if (source / METADATA_FILENAME).is_file() else {}
        available = set(_dcp_top_level_keys(source)) | set(metadata)
        _check_requested(state, available, strict)
        tensors: dict[str, Any] = {k: get_model_state_dict(m) for k, m in models.items() if k in available}
        for key, optimizer in optimizers.items():
            if key in available:
                tensors[key] = get_optimizer_state_dict(owners[key], optimizer)
        dcp.load(tensors, checkpoint_id=source)
        options = StateDictOptions(strict=strict)
        contents = metadata
    else:
        contents = _torch_load(source, weights_only)
        _check_requested(state, set(contents), strict)
        tensors = {k: contents.pop(k) for k in list(models) + list(optimizers) if k in contents}
        options = StateDictOptions(full_state_dict=True, strict=strict)
    for key, module in models.items():
        if key in tensors:
            set_model_state_dict(module, tensors[key], options=options)
    for key, optimizer in optimizers.items():
        if key in tensors:
            set_optimizer_state_dict(owners[key], optimizer, tensors[key], options=options)
    for key, value in list(state.items()):
        if key in models or key in optimizers or key not in contents:
            continue
        if _is_stateful(value):
            value.load_state_dict(contents[key])
        else:
            state[key] = contents[key]
    return {k: v for k, v in contents.items() if k not in state}


def _load_raw_module(source: Path, module: Module, *, strict: bool, weights_only: bool) -> None:
    if is_sharded_checkpoint(source):
        key = _single_model_key(source)
        tensors = {key: get_model_state_dict(module)}
        dcp.load(tensors, checkpoint_id=source)
        set_model_state_dict(module, tensors[key], options=StateDictOptions(strict=strict))
        return
    contents = _torch_load(source, weights_only)
    weights = contents.get("model", contents) if isinstance(contents, dict) else contents
    set_model_state_dict(module, weights, options=StateDictOptions(full_state_dict=True, strict=strict))


def _single_model_key(path: Path) -> str:
    """The one model in a sharded checkpoint: the top-level key whose entries are not optimizer state."""
    metadata = dcp.FileSystemReader(path).read_metadata()
    keys: dict[str, bool] = {}
    for fqn in metadata.state_dict_metadata:
        top, _, rest = fqn.partition(".")
        is_optimizer = rest.startswith(("state.", "param_groups"))
        keys[top] = keys.get(top, False) or is_optimizer
    models = [k for k, is_optimizer in keys.items() if not is_optimizer]
    if len(models) != 1:
        raise ValueError(
            f"Cannot tell which model to load from {str(path)!r}: it holds the entries {sorted(keys)}. HINT: load it"
            " with a state dict that names the key, e.g. `load(path, {'model': model}, strict=False)`."
        )
    return models[0]


def _reshard(models: dict[str, Module]) -> None:
    """Put every unit back into its sharded state.

    After a forward without backward (evaluation, sampling), the root unit keeps its parameters unsharded, and
    ``parameters()`` then returns plain tensors that neither the optimizer nor the state-dict API know.
    """
    for module in models.values():
        for unit in module.modules():
            if isinstance(unit, FSDPModule):
                unit.reshard()


def _split(state: dict[str, Any]) -> tuple[dict[str, Module], dict[str, Optimizer], dict[str, Any]]:
    models: dict[str, Module] = {}
    optimizers: dict[str, Optimizer] = {}
    metadata: dict[str, Any] = {}
    for key, value in state.items():
        if isinstance(value, Module):
            models[key] = value
        elif isinstance(value, Optimizer):
            optimizers[key] = value
        else:
            metadata[key] = value.state_dict() if _is_stateful(value) else value
    return models, optimizers, metadata


def _optimizer_owners(models: dict[str, Module], optimizers: dict[str, Optimizer]) -> dict[str, Module]:
    """Match each optimizer to the model whose parameters it updates."""
    owners: dict[str, Module] = {}
    params_of = {key: {id(p) for p in module.parameters()} for key, module in models.items()}
    for key, optimizer in optimizers.items():
        ids = {id(p) for group in optimizer.param_groups for p in group["params"]}
        match = [k for k, params in params_of.items() if ids and ids <= params]
        if not match:
            raise ValueError(
                f"The optimizer under key {key!r} updates parameters that belong to no model in the checkpoint state"
                f" (models: {sorted(models)}). HINT: add the model it optimizes, e.g."
                f" `state={{'model': model, {key!r}: optimizer}}`."
            )
        owners[key] = models[match[0]]
    return owners


def _check_requested(state: dict[str, Any], available: Iterable[str], strict: bool) -> None:
    if not strict:
        return
    missing = [k for k in state if k not in set(available)]
    if missing:
        raise KeyError(
            f"The requested state key {missing[0]!r} is not in the checkpoint. HINT: pass `strict=False` to load the"
            " keys that are there and skip the rest."
        )


def _dcp_top_level_keys(path: Path) -> set[str]:
    metadata = dcp.FileSystemReader(path).read_metadata()
    return {fqn.split(".", 1)[0] for fqn in metadata.state_dict_metadata}


def _torch_load(path: Path, weights_only: bool) -> Any:
    try:
        return torch.load(path, map_location="cpu", mmap=True, weights_only=weights_only)
    except Exception as err:
        if weights_only and "weights_only" in str(err):
            raise RuntimeError(
                f"{str(path)!r} holds objects that only full unpickling can restore, which can run arbitrary code."
                " HINT: if you trust this file, pass `weights_only=False`, e.g. `fabric.load(path, state,"
                " weights_only=False)`."
            ) from err
        raise RuntimeError(f"Could not read the checkpoint file {str(path)!r}: {err}") from err


def _is_stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))
