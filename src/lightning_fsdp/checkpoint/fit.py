"""Does a checkpoint fit the model and optimizer it is loaded into? One answer for both formats.

torch answers this differently per path: DCP ignores keys that the checkpoint has and the model lacks (so a strict
sharded load accepted them silently), a full load raised ``load_state_dict``'s error on rank 0 only (the others
waited in the next broadcast), and a shape mismatch in a full load surfaced as an arithmetic error deep in the
state-dict API. Here every load compares the checkpoint's names and shapes with the live objects' before any tensor
moves, on every rank from the same tables, so the same error is raised everywhere:

- ``strict=True``: the model's keys and the checkpoint's must be the same set; the error lists the first few on each
  side. The optimizer's parameters must be the checkpoint optimizer's: state for a parameter the optimizer lacks is
  unexpected, and a parameter is missing only when the checkpoint does not know it at all, neither state nor a place
  in its param groups (the optimizer that saved it did not have it). A parameter the checkpoint lists without state
  never had a gradient there (an unused pooler, a validation-only head): that is no mismatch, and it loads as "no
  state", as ``optimizer.load_state_dict`` does (:func:`never_stepped`).
- Any ``strict``: a tensor present on both sides must have the same (global) shape; ``strict=False`` skips keys,
  never reshapes.

A requested plain entry (a dict or list of tensors, not a model or optimizer) whose data DCP holds, as a front's
sharded extras or another tool's ``dcp.save`` keep it, is read into its tensors in place (:func:`plain_leaves`,
:func:`check_plain`): each tensor must have the saved shape and dtype, a tensor must stand where a tensor was saved,
and ``strict`` compares the leaves as it compares a model's keys. One nobody requested is read, where the caller
asks for it, into plain tensors of the saved shapes (:func:`saved_template`).
"""

from __future__ import annotations

import math

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Optional

import torch

__all__ = ["Shapes", "model_shapes", "checkpoint_shapes", "optimizer_names", "saved_state_names", "listed_names",
           "never_stepped", "sharded_tables", "check_requested", "check_fit",
           "Leaves", "plain_leaves", "saved_leaves", "check_plain",
           "top_keys", "saved_template"]

# A tensor's name -> its global shape; None for a non-tensor entry (it has a name but no shape).
Shapes = dict[str, Optional[tuple[int, ...]]]

# A plain entry's leaf under DCP's flat name -> (shape, dtype) of a tensor; else, for a value in the state, its type's
# name, and for one in the checkpoint, None (DCP keeps it pickled).
Leaves = dict[str, Any]

_SHOWN = 5  # names listed per side; the count says how many there are


def model_shapes(state_dict: Mapping[str, Any]) -> Shapes:
    """Names and shapes of a state dict; DTensors report their global shape, without communicating."""
    return {name: _shape(value) for name, value in state_dict.items()}


checkpoint_shapes = model_shapes  # a full checkpoint's entry is a plain state dict of (memory-mapped) tensors


def saved_state_names(state: Mapping[str, Any]) -> set[str]:
    """The parameter names a full checkpoint's optimizer entry (keyed by names) holds state for."""
    return set(state.get("state", {}))


def listed_names(state: Mapping[str, Any]) -> set[str]:
    """The parameter names an optimizer state dict keyed by names lists in its param groups (with or without state)."""
    return {p for group in state.get("param_groups", []) for p in group.get("params", []) if isinstance(p, str)}


def never_stepped(saved: set[str], listed: set[str]) -> set[str]:
    """The parameters a checkpoint's optimizer had but never stepped (listed in its param groups, with no state):
    they load as no state at all, not as the zero state the state-dict API would give them."""
    return listed - saved


def optimizer_names(state: Mapping[str, Any]) -> set[str]:
    """Every parameter name an optimizer state dict keyed by names (the state-dict API's form) lists."""
    names = set(state.get("state", {}))
    for group in state.get("param_groups", []):
        names.update(p for p in group.get("params", []) if isinstance(p, str))
    return names


def sharded_tables(entries: Mapping[str, Any], prefix: str, optimizer: bool) -> Any:
    """Read one entry's table from DCP's metadata (``{flat name: storage metadata}``), where ``prefix`` is the
    entry's key plus a dot. A model entry gives :data:`Shapes`; an optimizer entry gives the names of the parameters
    it holds state for, from its ``state.<name>.<state key>`` entries."""
    if optimizer:
        names = set()
        for flat in entries:
            if flat.startswith(prefix + "state."):
                names.add(flat[len(prefix) + len("state."):].rpartition(".")[0])
        return names
    return {flat[len(prefix):]: _shape_of_metadata(meta) for flat, meta in entries.items() if flat.startswith(prefix)}


def check_requested(state: Mapping[str, Any], available: Iterable[str], strict: bool) -> None:
    """Under ``strict``, every key of ``state`` must be in the checkpoint (``available``: its top-level keys)."""
    if not strict:
        return
    available = set(available)
    missing = [k for k in state if k not in available]
    if missing:
        raise KeyError(
            f"The requested state key {missing[0]!r} is not in the checkpoint. HINT: pass `strict=False` to load the"
            " keys that are there and skip the rest."
        )


def check_fit(
    source: Path,
    models: Mapping[str, tuple[Shapes, Shapes]],
    optimizers: Mapping[str, tuple[Mapping[str, Any], set[str], Optional[set[str]]]],
    strict: bool,
) -> None:
    """Raise if the checkpoint at ``source`` does not fit. ``models`` maps each state key to (the model's table, the
    checkpoint's); ``optimizers`` to (the optimizer's state dict keyed by names, the parameter names the checkpoint
    holds optimizer state for, the names its param groups list). The last is None where it is not known yet (a
    sharded checkpoint keeps it in an entry read with the tensors): the check for missing parameters then waits for
    the second call, once it is read."""
    for key, (live, saved) in models.items():
        for name in sorted(live.keys() & saved.keys()):
            if live[name] is not None and saved[name] is not None and live[name] != saved[name]:
                raise ValueError(
                    f"the tensor {name!r} of {key!r} has shape {list(saved[name])} in the checkpoint {str(source)!r}"
                    f" but {list(live[name])} in the model. HINT: build the model with the same configuration as the"
                    " one that saved the checkpoint; `strict=False` skips missing keys but never reshapes a tensor."
                )
    if not strict:
        return
    for key, (live, saved) in models.items():
        _check_names(source, key, "model", set(live) - set(saved), set(saved) - set(live))
    for key, (live_state, saved, listed) in optimizers.items():
        # State for a parameter the optimizer does not have is unexpected. A parameter of the optimizer that the
        # checkpoint neither holds state for nor lists is missing. One it lists without state never had a gradient
        # when it was saved: whatever the live optimizer holds for it (the state-dict API gives every parameter a
        # zero state before the first step), it loads as none, like `optimizer.load_state_dict`.
        live = optimizer_names(live_state)
        _check_names(source, key, "optimizer", set() if listed is None else live - saved - listed, saved - live)


def plain_leaves(key: str, value: Any) -> Leaves:
    """The leaves of ``value``, requested under ``key``, by the flat names DCP gives them when it saves it: dicts are
    walked (``<key>.<dict key>``), and so are lists that hold a tensor or a dict at any depth (``<key>.<index>``);
    anything else (a tensor, a tuple, a list of numbers) is one leaf."""
    found: Leaves = {}

    def walk(name: str, item: Any) -> None:
        if isinstance(item, Mapping):
            for k, v in item.items():
                walk(f"{name}.{k}", v)
        elif isinstance(item, list) and _walked(item):
            for i, v in enumerate(item):
                walk(f"{name}.{i}", v)
        else:
            found[name] = (tuple(item.shape), item.dtype) if isinstance(item, torch.Tensor) else type(item).__name__

    walk(key, value)
    return found


def saved_leaves(entries: Mapping[str, Any], key: str) -> Leaves:
    """The leaves DCP's metadata (``{flat name: storage metadata}``) holds for the top-level ``key``."""
    found: Leaves = {}
    for flat, meta in entries.items():
        if flat == key or flat.startswith(key + "."):
            size = _shape_of_metadata(meta)
            found[flat] = None if size is None else (size, meta.properties.dtype)
    return found


def check_plain(source: Path, entries: Mapping[str, tuple[Leaves, Leaves]], strict: bool) -> None:
    """Raise unless each requested plain entry can be read in place. ``entries`` maps each key to (the state's
    leaves, the checkpoint's): a leaf both have must be a tensor on both sides, of the same shape and dtype, or a
    value on both sides (the saved value then replaces it); whatever ``strict`` says, since skipping it would leave
    the state silently unrestored. Under ``strict`` both must have the same leaves."""
    for key, (live, saved) in entries.items():
        for name, want in live.items():
            have = saved.get(name, _ABSENT)
            under = sorted(n for n in saved if n.startswith(name + "."))
            over = [n for n in saved if name.startswith(n + ".")]
            if under or over or (have is not _ABSENT and isinstance(have, tuple) != isinstance(want, tuple)):
                at = over[0] if over else name
                held = (f"{len(under)} leaves under {at!r} (e.g. {under[0]!r}: {_leaf(saved[under[0]])})" if under
                        else f"{_leaf(saved[at])} at {at!r}")
                raise ValueError(
                    f"the entry {key!r} cannot be read into the state in place: the checkpoint {str(source)!r} holds"
                    f" {held}, and the state holds {_leaf(want) if at == name else 'a dict or list'} there."
                    f" HINT: pass {key!r} as it was saved, with a tensor of the saved shape and dtype for each tensor"
                    f" (e.g. `torch.empty(shape, dtype=dtype)`) and any value for the others; {_listing(saved)}."
                )
            if isinstance(have, tuple) and have != want:
                what, saved_v, live_v = ("shape", list(have[0]), list(want[0])) if have[0] != want[0] else (
                    "dtype", have[1], want[1])
                raise ValueError(
                    f"the tensor {name!r} of the entry {key!r} has {what} {saved_v} in the checkpoint"
                    f" {str(source)!r} but {live_v} in the state. HINT: pass a tensor of {what} {saved_v} there (e.g."
                    f" `torch.empty({list(have[0])}, dtype={have[1]})`): a plain entry is read into its tensors in"
                    " place, never reshaped or converted."
                )
        if strict:
            _check_names(source, key, "entry", set(live) - set(saved), set(saved) - set(live))


_ABSENT = object()


def top_keys(entries: Mapping[str, Any], paths: Mapping[str, tuple]) -> set[str]:
    """The top-level keys of the state DCP saved; ``paths`` is its metadata's ``planner_data``, each flat name's path
    (a key may hold a dot), else the name up to its first dot."""
    return {str(paths.get(flat, (flat.split(".", 1)[0],))[0]) for flat in entries}


def saved_template(entries: Mapping[str, Any], paths: Mapping[str, tuple], key: str) -> Any:
    """The saved entry ``key``'s dicts and lists, to read it into whole: an empty plain tensor of the saved (global)
    shape and dtype for each tensor, None for each pickled value (DCP's load puts the value there). A path that is
    not its flat name's, a list index beyond the entries, or two paths that disagree on a container is refused: a
    crafted ``.metadata`` must not allocate at will or fail deep in DCP."""
    root: dict = {}
    for flat, meta in entries.items():
        path = paths.get(flat) or tuple(flat.split("."))
        if str(path[0]) != key:
            continue
        node: Any = root
        for i, part in enumerate(path):
            last = i == len(path) - 1
            new = _empty_leaf(flat, meta) if last else ([] if isinstance(path[i + 1], int) else {})
            held: Any = None  # what the path's place held before: a leaf must not replace a container
            if isinstance(node, list) and isinstance(part, int) and 0 <= part < len(entries):
                node.extend([None] * (part + 1 - len(node)))
                held = node[part]
                node[part] = new if last or node[part] is None else node[part]
            elif isinstance(node, dict) and isinstance(part, str):
                held = node.get(part)
                node[part] = new if last else node.get(part, new)
            else:
                part = None  # refused below
            if part is None or ".".join(map(str, path)) != flat or (not last and type(node[part]) is not type(new)) \
                    or (last and isinstance(held, (dict, list))):
                raise ValueError(f"DCP's .metadata places {flat!r} at {path!r}, which does not fit the other entries"
                                 f" of {key!r}. HINT: the checkpoint is damaged or was not written by DCP; load an"
                                 " earlier one.")
            node = node[part]
    return root[key]


def _empty_leaf(flat: str, meta: Any) -> Optional[torch.Tensor]:
    """A zeroed tensor of the saved shape and dtype (None for a pickled value), once the saved chunks are seen to
    cover exactly that shape: a crafted ``.metadata`` must not size an allocation its chunks do not account for."""
    size = _shape_of_metadata(meta)
    if size is None:
        return None
    numel = math.prod(size)
    chunks = list(getattr(meta, "chunks", None) or [])
    inside = all(len(c.offsets) == len(size) == len(c.sizes) and all(
        0 <= o and 0 <= n and o + n <= d for o, n, d in zip(c.offsets, c.sizes, size)) for c in chunks)
    if not inside or sum(math.prod(c.sizes) for c in chunks) != numel:
        raise ValueError(f"DCP's .metadata gives {flat!r} the shape {list(size)} but chunks that do not cover it"
                         " exactly. HINT: the checkpoint is damaged or was not written by DCP; load an earlier one.")
    return torch.zeros(size, dtype=meta.properties.dtype)  # zeros: no byte of the process's memory is handed out


def _walked(items: list) -> bool:  # as DCP decides which lists to walk into when it flattens a state dict
    return any(isinstance(v, (torch.Tensor, Mapping)) or (isinstance(v, list) and _walked(v)) for v in items)


def _leaf(leaf: Any) -> str:
    if isinstance(leaf, tuple):
        return f"a tensor of shape {list(leaf[0])} and dtype {leaf[1]}"
    return "a pickled value, not a tensor" if leaf is None else f"a value of type {leaf}, not a tensor"


def _listing(saved: Leaves) -> str:
    tensors = [f"{n!r}: {list(v[0])} {v[1]}" for n, v in sorted(saved.items()) if isinstance(v, tuple)]
    shown = ", ".join(tensors[:_SHOWN]) + (", ..." if len(tensors) > _SHOWN else "")
    return f"the checkpoint's tensors there: {shown}" if tensors else "the checkpoint holds no tensor there"


def _check_names(source: Path, key: str, what: str, missing: set[str], unexpected: set[str]) -> None:
    missing, unexpected = sorted(missing), sorted(unexpected)
    if not missing and not unexpected:
        return
    noun = "parameter names" if what == "optimizer" else "keys"
    parts = []
    if missing:
        parts.append(f"missing from the checkpoint: {_few(missing)}")
    if unexpected:
        parts.append(f"in the checkpoint but not in the {what}: {_few(unexpected)}")
    raise KeyError(
        f"the {what} {key!r} and the checkpoint {str(source)!r} do not have the same {noun} ({'; '.join(parts)})."
        " HINT: pass `strict=False` to load the keys both have and skip the rest, e.g."
        " `fabric.load(path, state, strict=False)`."
    )


def _few(names: Iterable[str]) -> str:
    names = list(names)
    shown = ", ".join(repr(n) for n in names[:_SHOWN])
    return f"{len(names)} ({shown}{', ...' if len(names) > _SHOWN else ''})"


def _shape(value: Any) -> Optional[tuple[int, ...]]:
    return tuple(value.shape) if isinstance(value, torch.Tensor) else None


def _shape_of_metadata(meta: Any) -> Optional[tuple[int, ...]]:
    size = getattr(meta, "size", None)  # TensorStorageMetadata has a size; BytesStorageMetadata does not
    return tuple(size) if size is not None else None
