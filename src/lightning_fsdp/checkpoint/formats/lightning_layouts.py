"""Where Lightning's own strategies put the model and the optimizers in a checkpoint.

A checkpoint that Fabric wrote (with its ``FSDPStrategy`` or ``ModelParallelStrategy``) keeps every entry of the
user's ``state`` under the user's key, like ours: ``fabric.load(path, {"model": model, "optimizer": optimizer})``
needs no help. A checkpoint that the **Trainer** wrote uses fixed keys instead (cited from Lightning 2.6.6):

==============================  ===============  ==============================  =====================================
writer                          model            optimizers                      optimizer state keyed by
==============================  ===============  ==============================  =====================================
Trainer, any strategy, full     ``state_dict``   ``optimizer_states``: a list    FSDP and ModelParallel: parameter ids
(one ``.ckpt`` file)                             ``[osd_0, osd_1, ...]``         (``rekey_optim_state_dict(...,
                                                                                 PARAM_ID)``); DDP & co: ids too
Trainer ``FSDPStrategy``,       ``model``        ``optimizer_0``,                parameter names (FQNs)
sharded (DCP dir + meta.pt)                      ``optimizer_1``, ...
Trainer ``ModelParallel``,      ``state_dict``   ``optimizer_0``,                parameter names (FQNs)
sharded (DCP dir + meta.pt)                      ``optimizer_1``, ...
==============================  ===============  ==============================  =====================================

Sources: ``pytorch/trainer/connectors/checkpoint_connector.py`` ``dump_checkpoint`` (l. 449 ``"state_dict"``, l. 467
``"optimizer_states"``); ``pytorch/strategies/fsdp.py`` ``save_checkpoint`` (l. 568-571: ``{"model": ...,
"optimizer_{idx}": ...}``) and ``optimizer_state`` (l. 539: id-keyed for full checkpoints);
``pytorch/strategies/model_parallel.py`` ``save_checkpoint`` (l. 317-320: ``{"state_dict": ..., "optimizer_{idx}":
...}``) and ``optimizer_state`` (l. 290: id-keyed for full checkpoints).

This module is pure: it looks only at key names and plain dicts, so the loader (``io.py``) decides what to read.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Optional

__all__ = [
    "TRAINER_MODEL_KEY",
    "TRAINER_OPTIMIZER_LIST_KEY",
    "remap_requested_keys",
    "read_entry",
    "checkpoint_keys_used",
    "fqn_keyed_optimizer_state",
    "id_keyed_optimizer_state",
]

TRAINER_MODEL_KEY = "state_dict"
"""The Trainer's key for the LightningModule's weights (full checkpoints, and ModelParallel's sharded ones)."""

TRAINER_OPTIMIZER_LIST_KEY = "optimizer_states"
"""The Trainer's key for the list of optimizer state dicts in a full checkpoint."""

LIST_ENTRY_SEPARATOR = "/"
"""Joins a list-valued checkpoint key and an index: ``"optimizer_states/0"`` is ``contents["optimizer_states"][0]``."""

_SHARDED_OPTIMIZER_KEY = re.compile(r"optimizer_(\d+)")


def remap_requested_keys(
    available: Iterable[str],
    models: Sequence[str],
    optimizers: Sequence[str],
    *,
    num_optimizer_states: Optional[int] = None,
) -> dict[str, str]:
    """Map requested model and optimizer keys that the checkpoint lacks onto the Trainer's layout.

    Args:
        available: the checkpoint's top-level keys (the DCP top-level keys plus ``meta.pt``'s keys of a sharded
            checkpoint; the keys of the ``torch.load``-ed dict of a full checkpoint).
        models: the keys of ``state`` that hold models, in ``state``'s order.
        optimizers: the keys of ``state`` that hold optimizers, in ``state``'s order.
        num_optimizer_states: the length of the ``"optimizer_states"`` list of a full checkpoint, when the caller
            has it. The list's length is not visible in ``available``; with ``None`` the count is not checked.

    Returns:
        ``{requested_key: key_in_checkpoint}``, only for requested keys that are absent from ``available`` and have a
        place in the Trainer's layout. Keys that are present map to nothing (load them as usual), and so do keys with
        no unambiguous place (the loader's strict check then reports them). A value is either a top-level key
        (``"state_dict"``, ``"optimizer_1"``) or ``"optimizer_states/<i>"``, meaning entry ``i`` of the list under
        ``"optimizer_states"``; :func:`read_entry` resolves both forms, :func:`checkpoint_keys_used` lists the
        top-level keys they consume.

    Rules:
        - A model maps to ``"state_dict"`` only when ``state`` holds exactly one model: the Trainer saves exactly
          one (the LightningModule).
        - Optimizers map by position, the ``i``-th requested optimizer to the Trainer's ``i``-th, like Lightning's
          own loaders do, and only when none of the requested optimizer keys is in the checkpoint and the number
          of the Trainer's optimizers equals the number requested. A partial or uneven match could load one
          optimizer's state into another, so it is left to the caller's error path.
        - ``optimizer_<i>`` entries (sharded checkpoints) are preferred to the ``optimizer_states`` list; the two
          never occur together in a checkpoint Lightning wrote.
    """
    available = set(available)
    mapping: dict[str, str] = {}

    if len(models) == 1 and models[0] not in available and TRAINER_MODEL_KEY in available:
        mapping[models[0]] = TRAINER_MODEL_KEY

    if optimizers and not any(key in available for key in optimizers):
        indices = sorted(int(m.group(1)) for m in map(_SHARDED_OPTIMIZER_KEY.fullmatch, available) if m)
        if indices:
            if indices == list(range(len(optimizers))):
                mapping.update({key: f"optimizer_{i}" for i, key in enumerate(optimizers)})
        elif TRAINER_OPTIMIZER_LIST_KEY in available:
            if num_optimizer_states is None or num_optimizer_states == len(optimizers):
                mapping.update(
                    {key: f"{TRAINER_OPTIMIZER_LIST_KEY}{LIST_ENTRY_SEPARATOR}{i}" for i, key in enumerate(optimizers)}
                )
    return mapping


def read_entry(contents: Mapping[str, Any], key: str) -> Any:
    """``contents[key]``, where ``key`` may also be a list entry ``"<list key>/<index>"`` (see
    :func:`remap_requested_keys`). Raises ``KeyError`` naming the key when the entry is not there."""
    if key in contents:
        return contents[key]
    name, sep, index = key.rpartition(LIST_ENTRY_SEPARATOR)
    if sep and index.isdigit() and isinstance(contents.get(name), (list, tuple)):
        entries = contents[name]
        if int(index) < len(entries):
            return entries[int(index)]
    raise KeyError(f"The checkpoint has no entry {key!r} (its keys: {sorted(contents)}). HINT: request one of those"
                   " keys, or load with `strict=False` to skip the missing ones.")


def checkpoint_keys_used(mapping: Mapping[str, str]) -> set[str]:
    """The checkpoint's top-level keys that the mapped entries come from, e.g. ``{"state_dict", "optimizer_states"}``,
    so a loader can leave them out of what it returns as unrequested metadata."""
    return {value.split(LIST_ENTRY_SEPARATOR, 1)[0] for value in mapping.values()}


def fqn_keyed_optimizer_state(osd: dict[str, Any], param_fqns: Sequence[str]) -> dict[str, Any]:
    """An optimizer state dict keyed by parameter names (FQNs), as torch's ``set_optimizer_state_dict`` wants it.

    Args:
        osd: ``{"state": {key: {...}}, "param_groups": [{"params": [key, ...], ...}, ...]}``. If its keys are
            already names (our checkpoints, Fabric's, ``FSDP.optim_state_dict``), it is returned unchanged. If they
            are integer ids, as in a plain ``optimizer.state_dict()`` or Lightning's full Trainer checkpoints, they
            are replaced by names.
        param_fqns: the names of the live optimizer's parameters, in its order (group by group, each group in its
            ``params`` order), e.g. ``[n for g in get_optimizer_state_dict(model, opt)["param_groups"] for n in
            g["params"]]``.

    The ``j``-th id listed in ``osd``'s param groups (in group order) gets the ``j``-th name. That is exact for a
    plain ``optimizer.state_dict()``, whose ids are those positions. Lightning's FSDP/ModelParallel full checkpoints
    use ``FSDP.rekey_optim_state_dict(..., PARAM_ID, model)`` instead, whose ids are indices into
    ``model.parameters()``, sorted within each group; positions and names agree there whenever each param group lists
    its parameters in the model's order, the usual case (``model.parameters()``, or groups filtered from it).

    Raises:
        ValueError: the keys mix names and ids, or the number of parameters differs from ``param_fqns``, or the state
            names an id that no param group lists.
    """
    state = osd.get("state", {})
    groups = osd.get("param_groups", [])
    ids = [p for group in groups for p in group["params"]]
    keys = list(state) + ids
    if all(isinstance(k, str) for k in keys):
        return osd
    if not all(isinstance(k, int) and not isinstance(k, bool) for k in keys):
        raise ValueError(
            "The optimizer state mixes parameter names and integer ids as keys"
            f" (state keys: {list(state)[:5]}, param-group params: {ids[:5]}). HINT: re-save it with"
            " `optimizer.state_dict()` (ids) or `get_optimizer_state_dict(model, optimizer)` (names)."
        )
    if len(ids) != len(param_fqns) or len(set(ids)) != len(ids):
        raise ValueError(
            f"The checkpoint's optimizer state lists {len(ids)} parameters ({len(set(ids))} distinct) in"
            f" {len(groups)} param groups, but the optimizer being loaded has {len(param_fqns)}. HINT: build the"
            " optimizer with the same parameters and param groups as the one that was saved."
        )
    name_of = dict(zip(ids, param_fqns))
    stray = [k for k in state if k not in name_of]
    if stray:
        raise ValueError(
            f"The checkpoint's optimizer state has entries for parameter ids {stray[:5]} that no param group lists"
            f" (listed: {ids[:5]}...). HINT: the state dict is inconsistent; re-save it from the optimizer."
        )
    return {
        **osd,
        "state": {name_of[k]: v for k, v in state.items()},
        "param_groups": [{**group, "params": [name_of[p] for p in group["params"]]} for group in groups],
    }


def id_keyed_optimizer_state(osd: dict[str, Any]) -> dict[str, Any]:
    """The inverse of :func:`fqn_keyed_optimizer_state`: an optimizer state dict keyed by parameter names becomes one
    keyed by integer ids, the ``j``-th name listed in the param groups (in group order) getting id ``j``, exactly as
    a plain ``optimizer.state_dict()`` numbers them. That is the form the Trainer keeps in a full checkpoint's
    ``"optimizer_states"``, so that any strategy (DDP, a single device) resumes from it with
    ``optimizer.load_state_dict``. Values are left as they are."""
    groups = osd.get("param_groups", [])
    id_of = {name: j for j, name in enumerate(name for group in groups for name in group["params"])}
    return {
        **osd,
        "state": {id_of[name]: value for name, value in osd.get("state", {}).items()},
        "param_groups": [{**group, "params": [id_of[name] for name in group["params"]]} for group in groups],
    }
