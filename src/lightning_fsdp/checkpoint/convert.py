"""Offline conversions between checkpoint formats, and their description: the glue of ``lightning-fsdp convert``
and ``inspect``. Pure functions for one process; nothing here needs a process group.

- :mod:`~lightning_fsdp.checkpoint.io.readers` opens a checkpoint (metadata only) and reads its tensors a batch at a time;
- :mod:`~lightning_fsdp.checkpoint.io.writers` writes them as a full file, a sharded directory or a safetensors export;
- :mod:`~lightning_fsdp.checkpoint.io.memory` hands freed memory back to the OS between batches;
- this module checks the options and the destination, and moves a complete output into place atomically.

Nothing holds a whole model in memory: peak memory is about one read batch plus what the writer must hold (one
tensor for a full file, for a safetensors file of any size, and for DCP). Measured on a 277 MB model whose largest
tensor is 8 MiB, converting to one safetensors file and to a full file each peaked 17 MB (0.06x) above the start
(``benchmarks/convert_memory.py``); ``tests/workers/convert_memory.py`` holds the bound in the tests.

Nothing is unpickled freely unless ``allow_pickle`` is given: DCP's ``.metadata`` goes through the allow-list of
:mod:`~lightning_fsdp.checkpoint.integrity.safe_pickle`, everything else through ``torch.load(weights_only=True)``. Sharded sources are checked against
their checksums as they are read, full sources before (:mod:`~lightning_fsdp.checkpoint.integrity`), and sharded outputs record checksums.
"""

from __future__ import annotations

import re
import uuid
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch

from lightning_fsdp.checkpoint.integrity.zipfiles import verify_zip
from lightning_fsdp.checkpoint.io.store import OneProcess, Target, store_for
from lightning_fsdp.checkpoint.io.readers import Checkpoint, TensorEntry, UsageError, _reading, open_checkpoint
from lightning_fsdp.checkpoint.io.writers import (
    SAFETENSORS_FILENAME,
    export_name,
    SAFETENSORS_INDEX_FILENAME,
    Progress,
    write_full,
    write_safetensors,
    write_sharded,
)

__all__ = [
    "UsageError",
    "TensorEntry",
    "Checkpoint",
    "open_checkpoint",
    "describe",
    "convert",
    "parse_size",
    "export_prefix",
    "FORMATS",
    "SAFETENSORS_FILENAME",
    "SAFETENSORS_INDEX_FILENAME",
]

FORMATS = ("full", "sharded", "safetensors")
_TRAINER_MARK = "pytorch-lightning_version"  # the Lightning Trainer writes it into every checkpoint
_SIZE = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*([kmgt]i?b|b)?", re.IGNORECASE)
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


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
    strip_prefix: Optional[str] = None,
) -> Target:
    """Write ``source`` in another format at ``destination``, atomically; returns ``destination``. Either may be a
    URL (``s3://...``): a remote source's committed objects are fetched first, and a remote destination is
    committed as a save commits (:mod:`~lightning_fsdp.checkpoint.io.store`).

    - ``to="full"``: one ``torch.save`` file, the layout a full save writes (``torch.load(weights_only=True)``
      reads it); the entries of ``meta.pt`` go to its top level.
    - ``to="sharded"``: a DCP directory plus ``meta.pt``, the layout a sharded save writes.
    - ``to="safetensors"``: model weights only. ``destination`` ending in ``.safetensors`` is that one file;
      anything else is a directory with ``model.safetensors``, or with ``max_shard_size`` (bytes) shards
      ``model-00001-of-0000N.safetensors`` and ``model.safetensors.index.json``, as Hugging Face writes them.
      Several models are exported together with their key prefixed to each name (``model.fc.weight``,
      ``ema.fc.weight``); ``model="ema"`` exports one model, unprefixed.
      ``strip_prefix`` removes a prefix from the names of one exported model, so they match the names the model
      class expects (``model.model.layers.0...`` of a Trainer checkpoint -> ``model.layers.0...``). ``None``
      detects it (see :func:`export_prefix`); ``""`` keeps every name as it is.
    """
    if to not in FORMATS:
        raise UsageError(f"Unknown target format {to!r}. Allowed: {', '.join(FORMATS)}. HINT: e.g. `--to full`.")
    if to != "safetensors" and (max_shard_size is not None or model is not None or strip_prefix):
        option = "--max-shard-size" if max_shard_size is not None else "--model" if model is not None \
            else "--strip-prefix"
        raise UsageError(f"`{option}` applies to `--to safetensors` only, not `--to {to}`. HINT: drop `{option}`,"
                         " or export weights with `--to safetensors`.")
    if max_shard_size is not None and max_shard_size <= 0:
        raise UsageError(f"Invalid max_shard_size={max_shard_size!r}. Allowed: a positive number of bytes."
                         " HINT: e.g. `--max-shard-size 500MB`.")
    if not isinstance(source, Checkpoint):
        with store_for(source).local_copy(source) as local:
            return convert(open_checkpoint(local, allow_pickle=allow_pickle), destination, to=to,
                           max_shard_size=max_shard_size, model=model, overwrite=overwrite, allow_pickle=allow_pickle,
                           progress=progress, strip_prefix=strip_prefix)
    checkpoint = source
    store = store_for(destination)
    target = store.target(destination)
    if checkpoint.format == to:
        others = " or ".join(f"`--to {f}`" for f in FORMATS if f != to)
        raise UsageError(f"{str(checkpoint.path)!r} is already a {to} checkpoint, so there is nothing to convert."
                         f" HINT: choose {others}.")
    _check_destination(checkpoint.path, target, overwrite, to, store)
    if checkpoint.format == "full":
        with _reading(checkpoint.path):  # sharded sources are checked as they are read
            verify_zip(checkpoint.path)
    if to == "full":
        writer: Callable[[Path], None] = lambda staged: write_full(checkpoint, staged, progress)
    elif to == "sharded":
        writer = lambda staged: write_sharded(checkpoint, staged, progress)  # noqa: E731
    else:
        keys = _export_models(checkpoint, model)
        prefix, _ = export_prefix(checkpoint, model=model, strip_prefix=strip_prefix)
        single_file = str(target).endswith(".safetensors")
        if single_file and max_shard_size is not None:
            raise UsageError(f"Sharded safetensors go into a directory, but DST {str(target)!r} names a file."
                             f" HINT: pass a directory, e.g. `{str(target)[:-len('.safetensors')]}`, or drop"
                             " --max-shard-size.")
        writer = lambda staged: write_safetensors(  # noqa: E731
            checkpoint, keys, staged, single_file=single_file, max_shard_size=max_shard_size, progress=progress,
            strip_prefix=prefix,
        )
    _write_atomically(target, writer, store)
    return target


def _check_destination(source: Path, target: Target, overwrite: bool, to: str, store: Any) -> None:
    src, dst = source.resolve(), Path(target).resolve()  # a URL resolves to no local path: it overlaps nothing
    if dst == src or src in dst.parents or dst in src.parents:
        raise UsageError(f"DST {str(target)!r} overlaps SRC {str(source)!r}, and writing it would destroy the"
                         " source. HINT: choose a DST outside the source checkpoint.")
    if not store.exists(target):
        return
    if not overwrite:
        raise UsageError(f"DST {str(target)!r} already exists. HINT: pass --overwrite to replace it, or choose"
                         " another DST.")
    if to == "safetensors" and _is_safetensors_export(Path(target)):
        return
    try:
        store.check_target(target, 0)  # never replaces what is not a checkpoint (a user's files)
    except (IsADirectoryError, FileExistsError) as err:
        raise UsageError(str(err)) from err


def _is_safetensors_export(path: Path) -> bool:
    """A file or directory this module could have written as a safetensors export."""
    if path.is_file():
        return path.suffix == ".safetensors"
    names = [p.name for p in path.iterdir()] if path.is_dir() else []
    return bool(names) and all(n.endswith(".safetensors") or n == SAFETENSORS_INDEX_FILENAME for n in names)


def _write_atomically(target: Target, write: Callable[[Path], None], store: Any) -> None:
    """Write into a staging path (beside a local ``target``) and commit it only when complete."""
    if not store.exists(target):
        store.check_target(target, 0)  # creates the folder a local target goes into; a bucket must exist
    staged = store.staging(target, uuid.uuid4().hex[:12], 0)
    try:
        write(staged)
        store.flush(staged)
        store.commit(staged, target, OneProcess())
    except BaseException:
        store.discard(staged, 0)
        raise


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


def export_prefix(checkpoint: Checkpoint, *, model: Optional[str] = None,
                  strip_prefix: Optional[str] = None) -> tuple[str, str]:
    """The prefix a safetensors export strips from every name, and a sentence saying what and why.

    The Lightning Trainer saves a LightningModule's weights under its attribute names: ``self.model =
    LlamaForCausalLM(...)`` gives ``model.model.layers.0...`` and ``model.lm_head.weight``, while the Hugging Face
    class expects ``model.layers.0...`` and ``lm_head.weight``. Detected (``strip_prefix=None``) only when that is
    unambiguous: the checkpoint was written by the Trainer (it records ``pytorch-lightning_version``), one model
    is exported, and every name of it starts with the same attribute, which is then stripped. Fabric checkpoints
    hold the model that was passed to ``fabric.save``, already under its own names, so nothing is stripped.
    An explicit prefix must begin every name.
    """
    keys = _export_models(checkpoint, model)
    names = [export_name(e, len(keys) > 1) for e in checkpoint.tensors(keys)]
    if strip_prefix == "":
        return "", "names kept as saved"
    if strip_prefix is not None:
        if len(keys) > 1:
            raise UsageError(f"`--strip-prefix {strip_prefix}` applies to one exported model, but"
                             f" {str(checkpoint.path)!r} holds {len(keys)} ({', '.join(keys)}). HINT: choose one"
                             f" with `--model {keys[0]}`.")
        other = next((n for n in names if not n.startswith(strip_prefix)), None)
        if other is not None:
            raise UsageError(f"Invalid `--strip-prefix {strip_prefix}`: the weight {other!r} does not start with"
                             f" it, and every name must. HINT: pass a prefix every name shares, e.g. `--strip-prefix"
                             f" {other.split('.')[0]}.`, or `--strip-prefix ''` to keep the names.")
        return strip_prefix, f"stripped {strip_prefix!r} from {len(names)} names (as asked)"
    tops = {n.split(".", 1)[0] for n in names}
    if len(keys) == 1 and _TRAINER_MARK in checkpoint.metadata and len(tops) == 1 and all("." in n for n in names):
        prefix = tops.pop() + "."
        return prefix, (f"stripped {prefix!r} from {len(names)} names: a Trainer checkpoint whose LightningModule"
                        f" holds every weight in `self.{prefix[:-1]}` (keep them with --strip-prefix '')")
    return "", "names kept as saved (no prefix to strip detected)"


def parse_size(text: str) -> int:
    """``"500MB"`` -> 500_000_000. Units as Hugging Face reads them: KB, MB, GB, TB are powers of 1000, KiB, MiB,
    GiB, TiB powers of 1024; a bare number is bytes."""
    match = _SIZE.fullmatch(text.strip())
    size = float(match.group(1)) * _UNITS[(match.group(2) or "b").lower()] if match else 0
    if not match or size < 1:
        raise UsageError(f"Invalid size {text!r}. Allowed: a positive number with an optional unit B, KB, MB, GB,"
                         " TB (powers of 1000) or KiB, MiB, GiB, TiB (powers of 1024). HINT: e.g. `500MB` or `2GiB`.")
    return int(size)
