"""Reading checkpoints into sharded models and optimizers.

- **Sharded** (DCP): each rank reads the pieces of its own shards, whatever world size or mesh wrote them, so a
  checkpoint saved on 2 ranks loads on 1, 3 or 4, and into hybrid or NO_SHARD layouts.
- **Full** (one file): only rank 0 opens it, memory-mapped, and the state-dict API broadcasts one tensor at a time
  and keeps each rank's shard, so no rank ever holds the whole checkpoint in memory.

Every read that can fail on one rank alone is followed by an agreement step (:mod:`~lightning_fsdp.checkpoint.integrity.agreement`), so a corrupted
or truncated checkpoint raises the same error, naming the file, on every rank.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)
from torch.nn import Module
from torch.optim import Optimizer

from lightning_fsdp._base.compat import weights_only_hint
from lightning_fsdp.checkpoint import fit, hf
from lightning_fsdp.checkpoint.formats.layout import DCP_METADATA_FILENAME, METADATA_FILENAME, is_full_checkpoint, is_sharded_checkpoint
from lightning_fsdp.checkpoint.formats.lightning_layouts import (
    TRAINER_OPTIMIZER_LIST_KEY,
    checkpoint_keys_used,
    fqn_keyed_optimizer_state,
    read_entry,
    remap_requested_keys,
)
from lightning_fsdp.checkpoint.integrity.agreement import CheckpointError, Communicator, together, unreadable
from lightning_fsdp.checkpoint.integrity.digests import note_unverified
from lightning_fsdp.checkpoint.integrity.safe_pickle import load_bytes, load_dcp_metadata, load_file
from lightning_fsdp.checkpoint.integrity.sharded_read import VerifyingReader, check_files
from lightning_fsdp.checkpoint.integrity.streaming_read import StreamingReader
from lightning_fsdp.checkpoint.io import ranged_read
from lightning_fsdp.checkpoint.io.collector import collector_paused
from lightning_fsdp.checkpoint.io.remote_full import CheckedOnRead, RemoteFullFile
from lightning_fsdp.checkpoint.io.remote_source import remote_objects
from lightning_fsdp.checkpoint.integrity.zipfiles import LoadVerifier, verify_zip
from lightning_fsdp.checkpoint.io.store import store_for
from lightning_fsdp.checkpoint.latest import fall_back, load_candidates, trusted_when_verified
from lightning_fsdp.checkpoint.state import SplitState, is_stateful, split_state
from lightning_fsdp.engine.full_state_load import has_own_load_hooks, load_full_from_rank0

__all__ = ["load_checkpoint", "checkpoint_keys"]


def load_checkpoint(
    path: Union[str, Path],
    state: Union[Module, Optimizer, dict[str, Any]],
    *,
    strict: bool = True,
    weights_only: Optional[bool] = None,
    comm: Communicator,
    storage_options: Optional[dict[str, Any]] = None,
    read_whole: Optional[Callable[[str], bool]] = None,
) -> dict[str, Any]:
    """Restore ``state`` in place from ``path`` and return what the checkpoint holds beyond the requested keys.

    A sharded checkpoint's entries that DCP holds are returned only if ``read_whole(key)`` says so (the Trainer's
    extras): they are then read whole, plain tensors on every rank; others may be a whole model or optimizer.

    ``path`` may be a URL (``s3://...``; its filesystem gets ``storage_options``): its committed objects are read
    (:mod:`~lightning_fsdp.checkpoint.io.store`). A symlinked ``path`` reads the checkpoint it points to. A rank that dies during the load is reported on the
    others as a ``CollectiveFailure``, like everywhere else.
    """
    with comm.guard(f"loading the checkpoint {str(path)!r}"):
        # `<dir>/latest`: the step checkpoints there, newest first; the load verifies what it reads (issue 43).
        candidates = load_candidates(path, comm, storage_options)
        path = candidates[0]
        if isinstance(state, Module) and hf.is_hf_checkpoint(path, storage_options, comm=comm):
            # Hugging Face weights (`load_raw`), local or at a URL: plain files, read in place (by ranges at a URL),
            # never through a commit (they were not written by a save).
            hf.load_pretrained_weights(path, state, strict=strict, comm=comm, storage_options=storage_options)
            return {}
        while True:
            try:
                with store_for(path, storage_options).open_committed(path, comm) as source, \
                        trusted_when_verified(path, source, comm, storage_options):  # retention need not re-read it
                    return _load(source, state, strict, weights_only, comm, read_whole)
            except Exception as err:  # noqa: BLE001 - damage, on every rank alike: `latest` goes on to the one before
                path = fall_back(candidates, err, comm, storage_options)  # it; anything else is raised


@collector_paused  # a load's objects set off full collections of the whole process (io/collector.py)
def _load(
    source: Path, state: Union[Module, Optimizer, dict[str, Any]], strict: bool,
    weights_only: Optional[bool], comm: Communicator, read_whole: Optional[Callable[[str], bool]] = None,
) -> dict[str, Any]:
    weights_only = True if weights_only is None else weights_only
    if isinstance(state, Module) and hf.is_hf_checkpoint(source):  # Hugging Face weights, e.g. to fine-tune
        hf.load_pretrained_weights(source, state, strict=strict, comm=comm)
        return {}
    sharded = together(comm, f"Opening the checkpoint {str(source)!r}", lambda: _detect(source))
    if isinstance(state, Optimizer):
        raise NotImplementedError(
            "Loading a lone optimizer is not supported, because its state is keyed by the model's parameter names."
            " HINT: load it together with its model: `load(path, {'model': model, 'optimizer': optimizer})`."
        )
    bare = False
    raw = isinstance(state, Module)
    if raw:
        key = _raw_model_key(source, sharded, comm, weights_only)
        bare = key is None  # a file holding just `model.state_dict()`
        state = {key or "model": state}
    split = split_state(state, for_save=False)
    if sharded:
        remainder = _load_sharded(source, state, split, strict, weights_only, comm, read_whole)
    else:
        remainder = _load_full(source, state, split, strict, weights_only, comm, bare_model=bare)
    return {} if raw else remainder


def checkpoint_keys(path: Union[str, Path], *, weights_only: Optional[bool] = None, comm: Communicator,
                    storage_options: Optional[dict[str, Any]] = None) -> set[str]:
    """The top-level keys of a checkpoint of either format, on every rank, without reading any tensor data."""
    with store_for(path, storage_options).open_committed(path, comm) as source:
        return _checkpoint_keys(source, weights_only, comm)


def _checkpoint_keys(source: Path, weights_only: Optional[bool], comm: Communicator) -> set[str]:
    weights_only = True if weights_only is None else weights_only

    def read() -> Optional[set[str]]:
        if comm.global_rank != 0:
            return None
        if _detect(source):
            meta_file = source / METADATA_FILENAME
            metadata = _torch_load(meta_file, weights_only) if meta_file.is_file() else {}
            entries = load_dcp_metadata(source / DCP_METADATA_FILENAME, allow_pickle=not weights_only).state_dict_metadata
            return {fqn.split(".", 1)[0] for fqn in entries} | set(metadata)
        # Memory-mapped, or from a bucket by ranges (the index only): no tensor is read.
        contents, _ = _open_full(source, weights_only)
        return set(contents) if isinstance(contents, dict) else set()

    return comm.broadcast(together(comm, f"Listing the keys of {str(source)!r}", read))


def _detect(source: Path) -> bool:
    """True for a sharded checkpoint, False for a full one; raises for anything else."""
    remote = remote_objects(source)
    if remote is not None and remote.kind == "full":  # in a bucket, read by ranges: nothing here on local disk
        return False
    if is_sharded_checkpoint(source):
        return True
    if is_full_checkpoint(source):
        return False
    if hf.is_hf_checkpoint(source):
        raise ValueError(
            f"{str(source)!r} holds Hugging Face safetensors weights, which load into one model, not into a state"
            " dict. HINT: load them into the model alone: `fabric.load_raw(path, model)`, or"
            " `lightning_fsdp.load_pretrained(model, path)`."
        )
    if source.is_file():
        raise CheckpointError(
            f"{str(source)!r} is not a torch.save zip archive, so it is not a full checkpoint; it may be truncated or"
            " corrupted. HINT: load an earlier checkpoint, or re-create this one."
        )
    raise FileNotFoundError(
        f"{str(source)!r} is not a checkpoint: expected a file (full checkpoint) or a directory with DCP '.metadata'"
        " (sharded checkpoint). HINT: pass the path that the save wrote."
    )


def _load_sharded(
    source: Path, state: dict, split: SplitState, strict: bool, weights_only: bool, comm: Communicator,
    read_whole: Optional[Callable[[str], bool]],
) -> dict[str, Any]:
    meta_file = source / METADATA_FILENAME
    # It checks every item as it reads; from a bucket, each rank reads only its own items' byte ranges (issue 43).
    reader = _sharded_reader(source, weights_only)

    def read_metadata() -> tuple[dict[str, Any], set[str], dict[str, Any], dict[str, Any], Any]:
        # Every file must belong to this save before any is used (`.metadata` decides where bytes go, `meta.pt`
        # holds the step); then meta.pt's zip records. From a bucket the reader checks with `.metadata` parsed once.
        adopted = reader.adopt_metadata() if weights_only and isinstance(reader, StreamingReader) else None
        verified, parsed = adopted or (check_files(source), None)
        if not verified and comm.global_rank == 0:
            note_unverified(source)
        if meta_file.is_file():
            verify_zip(meta_file)  # a torch.save file: its zip records carry CRC-32s
        metadata = _torch_load(meta_file, weights_only) if meta_file.is_file() else {}
        dcp_metadata = parsed or load_dcp_metadata(source / DCP_METADATA_FILENAME, allow_pickle=not weights_only)
        entries, paths = dcp_metadata.state_dict_metadata, dcp_metadata.planner_data or {}
        return metadata, {fqn.split(".", 1)[0] for fqn in entries} | set(metadata), entries, paths, dcp_metadata

    metadata, available, entries, paths, parsed = together(comm, f"Reading the metadata of {str(source)!r}", read_metadata)
    together(comm, f"Checking the shard files of {str(source)!r}", lambda: _check_shard_files(source, parsed))
    # Lightning's Trainer keeps the model under "state_dict" (or "model") and its optimizers under "optimizer_<i>".
    where = {**{k: k for k in state}, **remap_requested_keys(available, list(split.models), list(split.optimizers))}
    # Requested plain entries that DCP holds (a front's sharded extras, another tool's `dcp.save`), not meta.pt, are
    # read into their own tensors in place, with the models; they were skipped, leaving the state as it was.
    plain = {k: v.state_dict() if is_stateful(v) else v for k, v in state.items() if k not in split.models
             and k not in split.optimizers and k not in metadata and fit.saved_leaves(entries, k)}
    fit.check_requested(state, {k for k, v in where.items() if v in available} | set(plain), strict)
    # Unrequested ones the caller wants (the Trainer's: a callback's state that held DTensors) are read whole.
    whole = {k: fit.saved_template(entries, paths, k) for k in (fit.top_keys(entries, paths) if read_whole else ())
             if k not in state and k not in where.values() and k not in metadata and read_whole(k)}
    tensors: dict[str, Any] = {where[k]: get_model_state_dict(m) for k, m in split.models.items() if where[k] in available}
    for key, optimizer in split.optimizers.items():
        if where[key] in available:
            tensors[where[key]] = get_optimizer_state_dict(split.owners[key], optimizer)
    # DCP itself would ignore entries the checkpoint has and the model lacks, even under `strict`.
    models = {k: (fit.model_shapes(tensors[where[k]]), fit.sharded_tables(entries, where[k] + ".", False))
              for k in split.models if where[k] in tensors}
    # The parameter names the checkpoint's param groups list are read with the tensors: missing ones are checked then.
    optimizers = {k: (tensors[where[k]], fit.sharded_tables(entries, where[k] + ".", True), None)
                  for k in split.optimizers if where[k] in tensors}
    leaves = {k: (fit.plain_leaves(k, v), fit.saved_leaves(entries, k)) for k, v in plain.items()}
    together(comm, f"Matching {str(source)!r} to the state",
             lambda: (fit.check_fit(source, models, optimizers, strict), fit.check_plain(source, leaves, strict)))
    tensors.update({**plain, **whole})
    live = {k: fit.optimizer_names(v[0]) for k, v in optimizers.items()}  # before the read replaces the groups
    for key, (request, saved, _) in optimizers.items():
        # Only the state the checkpoint holds is read; the parameters it has none for get none (see below).
        request["state"] = {name: value for name, value in request.get("state", {}).items() if name in saved}
    planner = _LoadPlanner(weights_only=weights_only, allow_partial_load=not strict)
    try:
        together(comm, f"Reading the shards of {str(source)!r}",
                 lambda: dcp.load(tensors, storage_reader=reader, planner=planner))
    finally:
        if isinstance(reader, StreamingReader):
            reader.cancel()  # requests started with the rank's plan, where the load failed before it read them
    # Every rank read the same param groups, so every rank reaches the same answer.
    optimizers = {k: ({"param_groups": [{"params": sorted(live[k])}]}, saved, fit.listed_names(tensors[where[k]]))
                  for k, (_, saved, _) in optimizers.items()}
    together(comm, f"Matching {str(source)!r} to the state", lambda: fit.check_fit(source, {}, optimizers, strict))
    options = StateDictOptions(strict=strict)
    for key, module in split.models.items():
        if where[key] in tensors:
            set_model_state_dict(module, tensors[where[key]], options=options)
    for key, optimizer in split.optimizers.items():
        if where[key] in tensors:
            _, saved, listed = optimizers[key]
            _set_optimizer_state(split.owners[key], optimizer, tensors[where[key]], fit.never_stepped(saved, listed),
                                 StateDictOptions(strict=False))
    for key in plain:  # a pickled leaf came back as a new object: at the top level, it is only in `tensors`
        if is_stateful(state[key]):
            state[key].load_state_dict(tensors[key])
        else:
            state[key] = tensors[key]
    return {**_restore_metadata(state, split, metadata), **{k: tensors[k] for k in whole}}


def _set_optimizer_state(
    owner: Module, optimizer: Optimizer, loaded: dict[str, Any], unstepped: set[str], options: StateDictOptions
) -> None:
    """Load ``loaded`` into ``optimizer``, leaving the parameters named in ``unstepped`` with no state at all, as
    ``optimizer.load_state_dict`` leaves those its state dict holds nothing for.

    The state-dict API gives every parameter a state before it loads (a zero-gradient step), so a parameter that
    never had a gradient when the checkpoint was saved would come out with a zero state and a step count of 1: the
    first step it takes would then differ from the run that saved it. ``strict`` is checked before (:mod:`.fit`), so
    torch's own check, which counts those parameters as missing (and on rank 0 alone for a full load), is off.
    """
    set_optimizer_state_dict(owner, optimizer, loaded, options=options)
    if not unstepped:
        return
    params = [p for group in optimizer.param_groups for p in group["params"]]
    names = _param_names(owner, optimizer)
    if len(names) != len(params):  # one name per parameter, in the optimizer's order (see `_param_names`)
        raise RuntimeError(f"internal error: the optimizer lists {len(params)} parameters and the state-dict API"
                           f" names {len(names)}; please report it with the model and the optimizer's param groups")
    for name, param in zip(names, params):
        if name in unstepped:
            optimizer.state.pop(param, None)


def _load_full(
    source: Path, state: dict, split: SplitState, strict: bool, weights_only: bool, comm: Communicator,
    bare_model: bool = False,
) -> dict[str, Any]:
    # Rank 0 maps the file; the others learn its keys and its non-tensor entries, then receive tensors one by one.
    contents: dict[str, Any] = {}
    verifiers: list[Any] = []  # rank 0's, once the file is open: a LoadVerifier, or the file in a bucket

    def open_file() -> None:
        if comm.global_rank == 0:  # only rank 0 reads the file, so only rank 0 checks it
            # Memory-mapped: no tensor byte is read yet. A file that fails to parse is checked against its zip
            # records' checksums by the reader, which names the damage if that is the cause. From a bucket: the
            # index alone, by ranges; every tensor is a meta tensor until the broadcast below asks for it.
            loaded, remote = _open_full(source, weights_only)
            # Checked as the broadcasts below read each tensor, in the same mapping (see LoadVerifier), or as each
            # record arrives from the bucket (see remote_full).
            verifiers.append(remote if remote is not None else LoadVerifier.open(source, loaded))
            if not verifiers[0].recorded:
                note_unverified(source)
            if not isinstance(loaded, dict):
                raise ValueError(f"{str(source)!r} holds a {type(loaded).__name__}, not a checkpoint dict. HINT: load"
                                 " files that a save wrote from a dict of state (`fabric.save(path, {'model': model})`);"
                                 " read this one with `torch.load(path, weights_only=True)`.")
            contents.update({next(iter(split.models)): loaded} if bare_model else loaded)

    together(comm, f"Reading {str(source)!r}", open_file)
    entries: dict[str, Any] = {}  # rank 0: the requested models' and optimizers' entries, optimizers keyed by name

    def locate() -> tuple[list[str], dict[str, Any]]:
        # Lightning's Trainer keeps the model under "state_dict" and its optimizers in the list "optimizer_states",
        # keyed by parameter id.
        listed = contents.get(TRAINER_OPTIMIZER_LIST_KEY)
        count = len(listed) if isinstance(listed, (list, tuple)) else None
        mapping = remap_requested_keys(contents, list(split.models), list(split.optimizers), num_optimizer_states=count)
        for key in [*split.models, *split.optimizers]:
            if key in contents or key in mapping:
                entry = read_entry(contents, mapping.get(key, key))
                if key in split.optimizers:
                    entry = fqn_keyed_optimizer_state(entry, _param_names(split.owners[key], split.optimizers[key]))
                entries[key] = entry
        used = set(split.models) | set(split.optimizers) | checkpoint_keys_used(mapping)
        tables = {k: fit.checkpoint_shapes(v) if k in split.models else (fit.saved_state_names(v), fit.listed_names(v))
                  for k, v in entries.items()}
        rest = {k: v for k, v in contents.items() if k not in used}
        # From a bucket, the entries broadcast as objects (plain values, a tensor among them) are fetched here.
        return list(entries), remote.materialize(rest) if remote is not None else rest, tables

    # Errors on rank 0 (e.g. an optimizer state that does not fit the optimizer) must reach every rank, or the
    # others would wait in the state-dict API's broadcast.
    remote = verifiers[0] if verifiers and not isinstance(verifiers[0], LoadVerifier) else None
    located = together(comm, f"Reading {str(source)!r}", lambda: locate() if comm.global_rank == 0 else None)
    found, metadata, tables = comm.broadcast(located)
    fit.check_requested(state, [*found, *metadata], strict)
    # Checked on every rank from rank 0's tables, before the state-dict API's broadcasts: a mismatch found there
    # would raise on rank 0 alone (and as an anonymous size error for a shape).
    # A model whose modules rename or reshape entries while loading (litgpt's LoRA layers) is checked by torch
    # itself, after its hooks, in `load_full_from_rank0`: on every rank alike, since every rank loads the same entries.
    models = {k: (fit.model_shapes(get_model_state_dict(m)), tables[k]) for k, m in split.models.items()
              if k in found and not has_own_load_hooks(m)}
    optimizers = {k: (get_optimizer_state_dict(split.owners[k], o), *tables[k])
                  for k, o in split.optimizers.items() if k in found}
    together(comm, f"Matching {str(source)!r} to the state", lambda: fit.check_fit(source, models, optimizers, strict))
    # `strict` is checked above (`fit`); torch's own optimizer check would count never-stepped parameters as missing.
    optimizer_options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False)
    for key, module in split.models.items():
        if key in found:
            # Entry by entry through the module's own `load_state_dict`, so hooks that rename keys (litgpt's LoRA
            # layers) see the file's names on every rank; see `full_state_load`.
            full = CheckedOnRead(entries.get(key, {}), verifiers[0]) if comm.global_rank == 0 else None
            try:
                load_full_from_rank0(module, full, strict=strict)
            finally:
                if full is not None:
                    full.close()
            entries.pop(key, None)
    for key, optimizer in split.optimizers.items():
        if key in found:
            # torch's state-dict API flattens an optimizer's state before it broadcasts it, so from a bucket rank 0
            # fetches this optimizer's records (prefetched in order) before, and drops them after.
            saved = entries.pop(key, {})
            if remote is not None:
                saved = remote.materialize(saved)
            _set_optimizer_state(split.owners[key], optimizer, saved, fit.never_stepped(*tables[key]),
                                 optimizer_options)
            del saved
    # A mismatch found while broadcasting raises here, on every rank, before the load returns. The damaged values
    # have been broadcast by then (stopping rank 0 alone mid-broadcast would hang the others).
    together(comm, f"Verifying {str(source)!r}", lambda: verifiers[0].finish() if verifiers else None)
    return _restore_metadata(state, split, metadata)


def _param_names(model: Module, optimizer: Optimizer) -> list[str]:
    """The names of the optimizer's parameters, in its order. Local (no collectives); the state-dict API initializes
    missing optimizer state, which the load that follows does on every rank anyway."""
    return [n for g in get_optimizer_state_dict(model, optimizer)["param_groups"] for n in g["params"]]


class _LoadPlanner(dcp.DefaultLoadPlanner):
    """DCP's planner, except that non-tensor entries (optimizer hyperparameters) obey ``weights_only``.

    DCP unpickles those entries with full unpickling. Here each one is first read with ``weights_only=True``, which
    refuses arbitrary objects, and only then handed to DCP.
    """

    def __init__(self, *, weights_only: bool, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._weights_only = weights_only

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        if self._weights_only:
            payload = value.getvalue()
            try:
                load_bytes(payload)
            except Exception as err:
                raise RuntimeError(
                    f"The entry {read_item.dest_index.fqn!r} holds objects that only full unpickling can restore, and"
                    " unpickling can run arbitrary code. HINT: if you trust this checkpoint, pass"
                    f" `weights_only=False`, e.g. {weights_only_hint()}."
                ) from err
            value = io.BytesIO(payload)
        super().load_bytes(read_item, value)


def _restore_metadata(state: dict, split: SplitState, metadata: dict[str, Any]) -> dict[str, Any]:
    """Put requested plain entries back into ``state`` (Stateful ones through ``load_state_dict``) and return the
    entries nobody asked for."""
    for key, value in list(state.items()):
        if key in split.models or key in split.optimizers or key not in metadata:
            continue
        if is_stateful(value):
            value.load_state_dict(metadata[key])
        else:
            state[key] = metadata[key]
    return {k: v for k, v in metadata.items() if k not in state}


def _raw_model_key(source: Path, sharded: bool, comm: Communicator, weights_only: bool) -> Optional[str]:
    """The key of the one model in a checkpoint, for loading a bare module (Fabric's ``load_raw``); ``None`` for a
    file that holds just a model's state dict."""

    def find() -> Optional[str]:
        if sharded:
            metadata = load_dcp_metadata(source / DCP_METADATA_FILENAME, allow_pickle=not weights_only)
            kinds: dict[str, bool] = {}
            for fqn in metadata.state_dict_metadata:
                top, _, rest = fqn.partition(".")
                kinds[top] = kinds.get(top, False) or rest.startswith(("state.", "param_groups"))
            models = [k for k, is_optimizer in kinds.items() if not is_optimizer]
        else:
            contents, _ = _open_full(source, weights_only)  # from a bucket: the index alone, by ranges
            if all(torch.is_tensor(v) for v in contents.values()):
                return None
            models = [k for k, v in contents.items() if isinstance(v, dict) and v and all(torch.is_tensor(t) for t in v.values())]
        if len(models) != 1:
            raise ValueError(
                f"cannot tell which entry of {str(source)!r} is the model (candidates: {sorted(models)}). HINT: load"
                " it with a state dict that names the key, e.g. `load(path, {'model': model})`."
            )
        return models[0]

    return together(comm, f"Finding the model in {str(source)!r}", find)


def _sharded_reader(source: Path, weights_only: bool) -> VerifyingReader:
    remote = remote_objects(source)
    if remote is None:
        return VerifyingReader(source, allow_pickle=not weights_only)
    return StreamingReader(source, allow_pickle=not weights_only, url_of=remote.url,
                           fetch=lambda needs: ranged_read.fetch(remote, needs),
                           prefetch=lambda spans: ranged_read.Fetch(remote, spans))


def _check_shard_files(source: Path, metadata: Any) -> None:
    """Name a missing or truncated ``.distcp`` file before DCP trips over it with an anonymous read error: the
    metadata (``.metadata``, as read by the load: parsed once) records where in which file every piece lives, so each
    file must reach the end of its last piece. From a bucket, the sizes are COMMIT's (checked against the objects
    when the save committed them)."""
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        end = info.offset + info.length
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    remote = remote_objects(source)
    for name, size in sorted(needed.items()):
        file = source / name
        if remote is not None:
            where = remote.url(name) if name in remote.objects else f"{remote.prefix}/{name}"
            if name not in remote.objects:
                raise FileNotFoundError(f"the shard file {where!r} is not among the objects its COMMIT names. HINT:"
                                        " the checkpoint is incomplete; load an earlier one.")
            if remote.size(name) < size:
                raise ValueError(f"the shard file {where!r} is truncated ({remote.size(name)} bytes, the metadata needs"
                                 f" {size}). HINT: the checkpoint is damaged; load an earlier one.")
            continue
        if not file.is_file():
            raise FileNotFoundError(f"the shard file {str(file)!r} is missing. HINT: the checkpoint is incomplete; load an earlier one.")
        actual = file.stat().st_size
        if actual < size:
            raise ValueError(
                f"the shard file {str(file)!r} is truncated ({actual} bytes, the metadata needs {size}). HINT: the"
                " checkpoint is damaged; load an earlier one."
            )


def _open_full(source: Path, weights_only: bool) -> tuple[Any, Optional[RemoteFullFile]]:
    """A full checkpoint's contents, on the rank that reads it: memory-mapped from a local file (no tensor read),
    or, in a bucket, from its index read by ranges, each tensor a meta tensor that the returned file fetches
    (:mod:`~lightning_fsdp.checkpoint.io.remote_full`); nothing is downloaded."""
    objects = remote_objects(source)
    if objects is None or objects.kind != "full":
        return _torch_load(source, weights_only), None
    remote = RemoteFullFile(objects)
    return _torch_load(source, weights_only, remote.load), remote


def _torch_load(path: Path, weights_only: bool, reader: Optional[Callable[[bool], Any]] = None) -> Any:
    try:
        return load_file(path, allow_pickle=not weights_only) if reader is None else reader(not weights_only)
    except (CheckpointError, OSError):  # damaged bytes (named by the reader), a missing file
        raise
    except Exception as err:
        if weights_only and "weights_only" in str(err):
            raise RuntimeError(
                f"{str(path)!r} holds objects that only full unpickling can restore, and unpickling can run arbitrary"
                " code. HINT: if you trust this file, pass `weights_only=False`, e.g."
                f" {weights_only_hint()}."
            ) from err
        raise unreadable(path, err) from err
