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

A full or sharded output keeps the source's commit order (:mod:`~lightning_fsdp.checkpoint.formats.commit_order`),
on every store: a copy is not a new save. After a rollback (save 100, 200; load 100; save 110), converting 200 into
the run's folder or bucket must not make the abandoned 200 its ``latest``. A source that records no order gives an
output that records none (it then sorts by step, before every checkpoint that records one).

A safetensors export to a URL stays a plain Hugging Face folder (no ``COMMIT``: ``from_pretrained``,
``huggingface_hub`` and :func:`~lightning_fsdp.pretrained.load_pretrained` read the objects themselves), so it is
replaced in an order that never shows a reader a mix of two exports (:func:`_export_to_url`):

1. the previous export's objects are noted: its index and the shards the index names, and ``model.safetensors``;
   nothing else under the prefix (a ``config.json``, a tokenizer, anything a user put there) is ever touched;
2. the new shards are uploaded under names no earlier export used (``model-00001-of-00002-<token>.safetensors``),
   so no object a reader of the previous index can reach changes;
3. the entry point is written last, in one PUT (S3's PUT replaces an object whole): ``model.safetensors.index.json``
   naming exactly the new shards, or ``model.safetensors`` for a one-file export;
4. the previous export's entry point that the new one does not overwrite goes first (its index when the new one is a
   single file, its ``model.safetensors`` when the new one is sharded), then its shards.

What a reader sees at each instant: until 3, the previous export, whole; from 3 on, the new one, whole. Between 3
and 4, when the layout changes (one file <-> shards), both entry points exist and each names a whole export: a
reader that looks for ``model.safetensors`` first (``transformers``) still reads the previous one, one that looks
for the index first (this package) reads the new one; neither reads a mix. A reader that opened the previous index
before 3 and fetches its shards after 4 gets a missing object (an error, never other weights). A crash before 3
leaves the previous export readable and unchanged (the new shards uploaded so far are deleted); a crash between 3
and 4 leaves both entry points, which the next export to that URL removes. A one-file export replaced by a one-file
export is one PUT over the same name: S3 serves the old object or the new one, but a ranged reader spanning the PUT
could read both. One writer at a time: two exports racing to one URL are not guarded against.
"""

from __future__ import annotations

import contextlib
import json
import re
import tempfile
import uuid
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch

from lightning_fsdp.checkpoint.integrity.zipfiles import verify_zip
from lightning_fsdp.checkpoint.io.store import OneProcess, Target, store_for
from lightning_fsdp.checkpoint.io.urls import join
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
    "source_commit_order",
    "SOURCE",
    "FORMATS",
    "SAFETENSORS_FILENAME",
    "SAFETENSORS_INDEX_FILENAME",
]

FORMATS = ("full", "sharded", "safetensors")
_TRAINER_MARK = "pytorch-lightning_version"  # the Lightning Trainer writes it into every checkpoint
_SIZE = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*([kmgt]i?b|b)?", re.IGNORECASE)
SOURCE = "source"  # convert's `commit_order=` default: the output records what the source records
_SHARD = re.compile(r"(model-\d+-of-\d+)\.safetensors")  # how the writer names shards (`writers._SHARD_NAME`)
# The names an export to a URL gives its shards (the writer's, with a token): the only ones a later export deletes.
_SHARD_NAME = re.compile(r"model-\d+-of-\d+(?:-[0-9a-f]{8})?\.safetensors")
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
    commit_order: Union[int, None, str] = SOURCE,
    storage_options: Optional[dict[str, Any]] = None,
) -> Target:
    """Write ``source`` in another format at ``destination``, atomically; returns ``destination``. Either may be a
    URL (``s3://...``): a remote source's committed objects are fetched first, and a remote destination is
    committed as a save commits (:mod:`~lightning_fsdp.checkpoint.io.store`), except a safetensors export, which
    stays plain objects (see the module's docstring for how one replaces another).

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

    ``commit_order`` (full and sharded outputs): what the output records as its commit order. By default
    (:data:`SOURCE`) the source's, so the copy keeps its place among the checkpoints it joins; pass the value read
    beforehand (:func:`source_commit_order`) when ``source`` is a local copy of the checkpoint it stands for.
    ``storage_options`` go to fsspec for a URL.
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
    if commit_order == SOURCE and to != "safetensors":
        # Read where the source is (a URL's COMMIT), not from the local copy made below.
        commit_order = source_commit_order(source.path if isinstance(source, Checkpoint) else source, storage_options)
    if not isinstance(source, Checkpoint):
        with store_for(source, storage_options).local_copy(source) as local:
            return convert(open_checkpoint(local, allow_pickle=allow_pickle), destination, to=to,
                           max_shard_size=max_shard_size, model=model, overwrite=overwrite, allow_pickle=allow_pickle,
                           progress=progress, strip_prefix=strip_prefix, commit_order=commit_order,
                           storage_options=storage_options)
    checkpoint = source
    store = store_for(destination, storage_options)
    target = store.target(destination)
    if checkpoint.format == to:
        others = " or ".join(f"`--to {f}`" for f in FORMATS if f != to)
        raise UsageError(f"{str(checkpoint.path)!r} is already a {to} checkpoint, so there is nothing to convert."
                         f" HINT: choose {others}.")
    exporting_to_url = to == "safetensors" and store.remote  # plain objects, no commit (see the module's docstring)
    if not exporting_to_url:
        _check_destination(checkpoint.path, target, overwrite, to, store)
    if checkpoint.format == "full":
        with _reading(checkpoint.path):  # sharded sources are checked as they are read
            verify_zip(checkpoint.path)
    if to == "full":
        writer: Callable[[Path], None] = lambda staged: write_full(checkpoint, staged, progress, commit_order)
    elif to == "sharded":
        writer = lambda staged: write_sharded(checkpoint, staged, progress, commit_order)  # noqa: E731
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
        if exporting_to_url:
            _export_to_url(str(target), writer, store.fs, overwrite=overwrite)
            return target
    _write_atomically(target, writer, store, commit_order)
    return target


def source_commit_order(source: Union[str, Path], storage_options: Optional[dict[str, Any]] = None) -> Optional[int]:
    """The commit order the checkpoint at ``source`` records (for a URL, its ``COMMIT``), None when it records none.
    What a convert of it records (:func:`convert`'s ``commit_order``)."""
    store = store_for(source, storage_options)
    return store.commit_order(store.target(source))


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


def _write_atomically(target: Target, write: Callable[[Path], None], store: Any,
                      commit_order: Union[int, None, str]) -> None:
    """Write into a staging path (beside a local ``target``) and commit it only when complete."""
    if not store.exists(target):
        store.check_target(target, 0)  # creates the folder a local target goes into; a bucket must exist
    staged = store.staging(target, uuid.uuid4().hex[:12], 0)
    try:
        write(staged)
        store.flush(staged)
        # A remote store records the order in its COMMIT too; a local checkpoint records it in its files alone.
        store.commit(staged, target, OneProcess(), commit_order=commit_order)
    except BaseException:
        store.discard(staged, 0)
        raise


def _export_to_url(target: str, write: Callable[[Path], None], fs: Any, *, overwrite: bool) -> None:
    """A safetensors export to a URL, replacing a previous one without ever showing a reader a mix of the two (the
    steps and what a reader sees: this module's docstring)."""
    fs.invalidate_cache()
    if fs.exists(target) and not overwrite:
        raise UsageError(f"DST {target!r} already exists. HINT: pass --overwrite to replace it, or choose another"
                         " DST.")
    with tempfile.TemporaryDirectory(prefix="lightning-fsdp-export-") as root:
        local = Path(root) / (target.rsplit("/", 1)[-1] or "export")
        if target.endswith(".safetensors"):  # one object: one PUT replaces it whole, nothing else is there
            write(local)
            fs.put_file(str(local), target)
            return
        previous = _previous_export(fs, target)  # before anything is written: what the new one replaces
        write(local)
        token = uuid.uuid4().hex[:8]
        index = local / SAFETENSORS_INDEX_FILENAME
        uploads: dict[str, Path] = {}  # object name -> local file: the new shards, under names no export used
        if index.is_file():
            record = json.loads(index.read_text())
            renamed = {}
            for file in sorted(local.glob("*.safetensors")):
                match = _SHARD.fullmatch(file.name)
                renamed[file.name] = f"{match.group(1) if match else file.stem}-{token}.safetensors"
                uploads[renamed[file.name]] = file
            record["weight_map"] = {name: renamed[file] for name, file in record["weight_map"].items()}
            index.write_text(json.dumps(record, indent=2) + "\n")
            entry, stale_entry = SAFETENSORS_INDEX_FILENAME, SAFETENSORS_FILENAME
        else:
            entry, stale_entry = SAFETENSORS_FILENAME, SAFETENSORS_INDEX_FILENAME
        try:
            if uploads:  # one call: the filesystem keeps several uploads in flight
                fs.put([str(f) for f in uploads.values()], [join(target, n) for n in uploads])
            fs.put_file(str(local / entry), join(target, entry))  # the switch: one PUT, last
        except BaseException:
            with contextlib.suppress(Exception):  # best effort: the previous export is untouched either way
                _remove(fs, [join(target, n) for n in uploads])
            raise
    # The previous export goes: first an entry point of the other layout (it names a whole export, the previous
    # one), then the shards that only the previous index named. Never anything it did not name.
    written = set(uploads) | {entry}
    if stale_entry in previous:
        _remove(fs, [join(target, stale_entry)])
    _remove(fs, [join(target, n) for n in sorted(previous - written - {stale_entry})])


def _previous_export(fs: Any, target: str) -> set[str]:
    """The objects of the export at ``target`` (names under it): its entry points, and the shards its index names
    that lie directly under it. Only names an export writes: a tampered index cannot make the next export delete
    anything outside the prefix or that is not a ``.safetensors`` object."""
    found: set[str] = set()
    if fs.isfile(join(target, SAFETENSORS_FILENAME)):
        found.add(SAFETENSORS_FILENAME)
    try:
        payload = fs.cat_file(join(target, SAFETENSORS_INDEX_FILENAME))
    except FileNotFoundError:
        return found
    found.add(SAFETENSORS_INDEX_FILENAME)
    try:
        weight_map = json.loads(payload)["weight_map"]
        names = set(weight_map.values()) if isinstance(weight_map, dict) else set()
    except (ValueError, KeyError, TypeError):  # unreadable: it goes, and the shards no one can name stay
        return found
    return found | {n for n in names if isinstance(n, str) and _SHARD_NAME.fullmatch(n)}


def _remove(fs: Any, urls: list[str]) -> None:
    """Delete exactly these objects, one by one: never `fs.rm`, which reads `*`, `?` and `[` in a name as a pattern
    (a name from a crafted index, or a URL like `exp[1]/hf`, would delete other objects)."""
    for url in urls:
        with contextlib.suppress(FileNotFoundError):  # already gone: what removing wanted
            fs.rm_file(url)


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
