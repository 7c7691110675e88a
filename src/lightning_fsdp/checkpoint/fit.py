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
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Optional

import torch

__all__ = ["Shapes", "model_shapes", "checkpoint_shapes", "optimizer_names", "saved_state_names", "listed_names",
           "never_stepped", "sharded_tables", "check_fit"]

# A tensor's name -> its global shape; None for a non-tensor entry (it has a name but no shape).
Shapes = dict[str, Optional[tuple[int, ...]]]

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


def _check_names(source: Path, key: str, what: str, missing: set[str], unexpected: set[str]) -> None:
    missing, unexpected = sorted(missing), sorted(unexpected)
    if not missing and not unexpected:
        return
    noun = "keys" if what == "model" else "parameter names"
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
