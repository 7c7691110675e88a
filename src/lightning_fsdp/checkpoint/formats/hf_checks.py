"""What a Hugging Face safetensors checkpoint must satisfy before any of its bytes is read into a model.

A load that cannot be exact is refused, never approximated: DCP copies whatever the files and the model's shards
have in common and stays silent about the rest, so every gap it would leave must be found here first.

- **Index entries** (:func:`index_files`): each file an index names must lie inside the checkpoint's directory and
  be a ``.safetensors`` file. An entry like ``"../elsewhere/model.safetensors"`` would read another checkpoint's
  weights; one that is not a ``.safetensors`` file would be skipped by the reader, and the load would then fail
  on a "missing" weight instead of on the entry.
- **Sharding info** (:func:`check_sharding_info`): a file written by DCP's Hugging Face writer with
  ``save_distributed=True`` holds one chunk per tensor, and ``DCP_SHARDING_INFO`` in its header says where that
  chunk sits in the full tensor. torch's reader trusts it; here every offset must be a list of non-negative
  integers, one per dim of the stored chunk.
- **Weights** (:func:`check_weights`): for every weight that will be read, its chunks must tile the model's tensor
  exactly (inside its bounds, no overlap, nothing uncovered), and the dtype stored must be of the parameter's kind
  (floating point, integer, bool, complex). A precision change within a kind (bf16 into fp32) is converted, as
  ``from_pretrained`` does; a change of kind (an int32 file into a float weight) means the file is not this model's.

Each check raises a ``ValueError`` or ``TypeError`` naming the entry or tensor, what was found, and the fix. The
caller runs them on every rank inside its agreement step, before any tensor is read.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata

__all__ = ["index_files", "check_sharding_info", "check_weights"]

SUFFIX = ".safetensors"
SHARDING_INFO_KEY = "DCP_SHARDING_INFO"  # torch's key in the safetensors header's "__metadata__"
OFFSETS_KEY = "saved_offsets"
_LISTED = 5  # offending names shown in one message; the count says how many more


# ---------------------------------------------------------------------------------------------------- index entries


def index_files(directory: Path, index: Path, weight_map: Mapping[str, Any]) -> list[Path]:
    """The files ``weight_map`` names, each checked to lie inside ``directory``; sorted, without duplicates.

    "Inside" holds for the name as written (no absolute path, no ``..`` out of the directory) and for the file it
    reaches after symlinks. One exception keeps the Hugging Face hub's own cache loadable: in a snapshot
    (``models--org--name/snapshots/<revision>/``) every file is a symlink into the repository's ``blobs/`` folder,
    so for a directory shaped like a snapshot a symlink may resolve into that ``blobs/`` folder too.
    """
    root = directory.resolve()
    blobs = _hub_blobs(root)
    by_file: dict[str, str] = {}  # entry value -> first tensor naming it, for the message
    for tensor, name in weight_map.items():
        by_file.setdefault(name if isinstance(name, str) else repr(name), tensor)
    bad: list[str] = []
    for name, tensor in by_file.items():
        reason = _entry_problem(directory, root, blobs, name)
        if reason:
            bad.append(f"{tensor!r} -> {name!r} ({reason})")
    if bad:
        raise ValueError(
            f"the index {str(index)!r} names files outside the checkpoint directory {str(directory)!r} or not"
            f" safetensors files: {_listing(bad)}. Allowed: a '{SUFFIX}' file name relative to the directory that"
            " stays inside it, also after following symlinks. HINT: put the files into the directory and name them"
            " by their plain file names in 'weight_map' (as `save_pretrained` writes them), or load the other"
            " checkpoint from its own directory."
        )
    # Normalized, so "./a.safetensors" and "a.safetensors" are one file, read once.
    return sorted({directory / os.path.normpath(name) for name in by_file})


def _entry_problem(directory: Path, root: Path, blobs: Path | None, name: str) -> str:
    if not isinstance(name, str) or not name:
        return "not a file name"
    if os.path.isabs(name) or Path(name).is_absolute():
        return "an absolute path"
    lexical = os.path.normpath(os.path.join(root, name))
    if not _inside(Path(lexical), root):
        return "leads out of the directory"
    if not name.endswith(SUFFIX):
        return f"not a '{SUFFIX}' file"
    target = (directory / name).resolve()
    if not _inside(target, root) and not (blobs is not None and _inside(target, blobs)):
        return f"a symlink to {str(target)!r}, outside the directory"
    return ""


def _inside(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def _hub_blobs(root: Path) -> Path | None:
    """``<repo>/blobs`` when ``root`` is ``<repo>/snapshots/<revision>`` of a Hugging Face hub cache, else None."""
    blobs = root.parent.parent / "blobs"
    return blobs.resolve() if root.parent.name == "snapshots" and blobs.is_dir() else None


# ---------------------------------------------------------------------------------------------------- sharding info


def check_sharding_info(file: str, header: Mapping[str, str] | None, shapes: Mapping[str, Sequence[int]]) -> None:
    """Check one file's ``DCP_SHARDING_INFO`` (from its header's ``__metadata__``) against its tensors' ``shapes``."""
    if not header or not header.get(SHARDING_INFO_KEY):
        return
    fix = (" HINT: the file's header is damaged or was edited; re-save the checkpoint with DCP's"
           " `HuggingFaceStorageWriter`, or consolidate it into whole tensors first.")
    try:
        info = json.loads(header[SHARDING_INFO_KEY])
    except ValueError as err:
        raise ValueError(f"{file!r}: {SHARDING_INFO_KEY} in the header is not JSON ({err}).{fix}") from err
    if not isinstance(info, dict):
        raise ValueError(f"{file!r}: {SHARDING_INFO_KEY} is {info!r}, expected an object per tensor name.{fix}")
    bad = []
    for tensor, shape in shapes.items():
        entry = info.get(tensor)
        offsets = entry.get(OFFSETS_KEY) if isinstance(entry, dict) else None
        if entry is None:
            bad.append(f"{tensor!r}: no entry")
        elif not (isinstance(offsets, list) and len(offsets) == len(shape)
                  and all(type(o) is int and o >= 0 for o in offsets)):
            bad.append(f"{tensor!r}: {OFFSETS_KEY}={offsets!r} for a chunk of shape {list(shape)}")
    if bad:
        raise ValueError(
            f"{file!r}: {SHARDING_INFO_KEY} does not place every tensor of the file: {_listing(bad)}. Allowed: for"
            f" each tensor, {{\"{OFFSETS_KEY}\": [...]}} with one non-negative integer per dim of the chunk.{fix}"
        )


# ---------------------------------------------------------------------------------------------------- weights


def check_weights(state: Mapping[str, Any], metadata: Metadata, names: Sequence[str],
                  files: Mapping[str, Mapping[str, torch.dtype]], placed: set[str]) -> None:
    """Raise unless each of ``names`` (in the model's ``state`` and in the files) can be read exactly.

    ``files`` gives, per tensor name, each file holding a chunk of it and the dtype stored there (DCP's metadata
    keeps one file per offset, so a tensor stored twice would look stored once). ``placed`` are the files whose
    header places their chunks (``DCP_SHARDING_INFO``): a tensor with a chunk in one of them is a sharded save's, to
    be tiled by its chunks, even when only one chunk at offset 0 is there. Shapes come first (the common mistake:
    another config), then the chunks' geometry, then the dtypes.
    """
    stored = metadata.state_dict_metadata
    shape_errors, chunk_errors, kind_errors = [], [], []
    for name in names:
        shape = tuple(getattr(state[name], "shape", ()))
        chunks = [(tuple(c.offsets), tuple(c.sizes)) for c in stored[name].chunks]
        whole = len(chunks) == 1 and not any(chunks[0][0]) and not placed.intersection(files[name])
        if whole:  # one whole tensor, as `save_pretrained` writes it
            if chunks[0][1] != shape:
                shape_errors.append(f"{name}: file {chunks[0][1]}, model {shape}")
        else:
            problem = _tiling_problem(shape, chunks)
            if problem:
                where = ", ".join(sorted({Path(f).name for f in files[name]}))
                chunk_errors.append(f"{name} (model {shape}, in {where}): {problem}")
        wanted = getattr(state[name], "dtype", None)
        for file, dtype in sorted(files[name].items()):
            if wanted is not None and _kind(dtype) != _kind(wanted):
                kind_errors.append(f"{name}: {Path(file).name} holds {_short(dtype)} ({_kind(dtype)}), the model"
                                   f" {_short(wanted)} ({_kind(wanted)})")
    if shape_errors:
        raise ValueError(
            f"these weights have another shape in the files than in the model: {_listing(shape_errors)}. HINT: build"
            " the model from the config saved with the weights (`AutoConfig.from_pretrained(path)`)."
        )
    if chunk_errors:
        raise ValueError(
            f"the chunks in the files do not make up these weights exactly: {_listing(chunk_errors)}. Allowed: chunks"
            " (placed by DCP_SHARDING_INFO) that lie inside the weight, do not overlap and together cover all of it."
            " HINT: copy every shard file of the save into the directory and remove files of other saves, or"
            " consolidate the sharded save into whole tensors (torch's `consolidate_safetensors_files`) and load that."
        )
    if kind_errors:
        raise TypeError(
            f"these weights are stored with a dtype of another kind than the model's: {_listing(kind_errors)}. Allowed:"
            " the same kind (floating point, integer, bool or complex); precision changes within a kind, such as bf16"
            " into fp32, are converted. HINT: check that the files belong to this model; if they do, build the model"
            " with the files' dtype, or convert the files with `safetensors.torch.save_file` after casting."
        )


def _tiling_problem(shape: tuple[int, ...], chunks: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> str:
    """Why ``chunks`` (offsets, sizes) do not tile a tensor of ``shape`` exactly, or ``""`` when they do."""
    for offsets, sizes in chunks:
        if len(offsets) != len(shape) or len(sizes) != len(shape):
            return (f"a chunk of shape {list(sizes)} at offset {list(offsets)} has {len(sizes)} dims, the weight"
                    f" {len(shape)}")
        if any(o < 0 or o + s > d for o, s, d in zip(offsets, sizes, shape)):
            return f"the chunk of shape {list(sizes)} at offset {list(offsets)} reaches outside the weight"
    # Sorted by their first offset, a chunk can only overlap those after it that start before it ends on dim 0, so
    # the usual row-wise shards cost one comparison each.
    ordered = sorted(chunks)
    for i, (offsets, sizes) in enumerate(ordered):
        for other_offsets, other_sizes in ordered[i + 1:]:
            if shape and other_offsets[0] >= offsets[0] + sizes[0]:
                break
            if (offsets, sizes) == (other_offsets, other_sizes):
                return f"the chunk of shape {list(sizes)} at offset {list(offsets)} is stored twice"
            if _overlap(offsets, sizes, other_offsets, other_sizes):
                return (f"the chunks at offsets {list(offsets)} (shape {list(sizes)}) and {list(other_offsets)}"
                        f" (shape {list(other_sizes)}) overlap")
    # Inside the bounds and pairwise disjoint: they cover everything exactly when their volumes add up.
    covered = sum(_numel(sizes) for _, sizes in chunks)
    total = _numel(shape)
    if covered != total:
        return f"the chunks cover {covered} of its {total} elements; the rest would keep its initial values"
    return ""


def _overlap(a_off, a_size, b_off, b_size) -> bool:
    if any(s == 0 for s in a_size) or any(s == 0 for s in b_size):
        return False
    return all(ao < bo + bs and bo < ao + as_ for ao, as_, bo, bs in zip(a_off, a_size, b_off, b_size))


def _numel(sizes: Sequence[int]) -> int:
    count = 1
    for size in sizes:
        count *= size
    return count


def _kind(dtype: torch.dtype) -> str:
    if dtype == torch.bool:
        return "bool"
    if dtype.is_complex:
        return "complex"
    if dtype.is_floating_point:
        return "floating point"
    return "integer"


def _short(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _listing(items: Sequence[str]) -> str:
    shown = "; ".join(items[:_LISTED])
    return shown + (f"; and {len(items) - _LISTED} more" if len(items) > _LISTED else "")
