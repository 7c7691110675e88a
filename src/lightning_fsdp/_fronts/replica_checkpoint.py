"""torchft's counters in the checkpoints of both fronts, under fault tolerance (docs/guides/fault-tolerance.md).

A checkpoint written by a replica group holds, beside the user's state, torchft's count of committed steps and of
batches committed across groups (``ReplicaGroup.state_dict()``) under :data:`STATE_KEY`. A load puts them back
before the next window, so after a whole-job restart every group, loading the same checkpoint, joins the first
quorum at the saved step: no group is behind another, none heals, and training goes on from exactly that step.

A checkpoint without the key (saved with fault tolerance off, or before it was stored) loads with this rule: on the
Fabric front torchft counts from step 0, as a fresh start would; on the Trainer front from the checkpoint's
``global_step``, which the Trainer's loop requires to equal torchft's count (``ReplicaGroup.check_step``). A value
that is not a pair of ints in [0, 2**53) is refused before anything is applied.

The key belongs to the strategy while fault tolerance is on: it is never handed to the caller with the rest of a
load, and a user's state may not use it. With fault tolerance off, a user's own entry of that name is left alone;
only a value of exactly the counters' shape (a fault-tolerant run's checkpoint, loaded without it) is taken out.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Optional, Union

from lightning_fsdp._base.errors import bad_argument
from lightning_fsdp.engine.fault_tolerance.transport import MAX_COUNT

__all__ = ["STATE_KEY", "restore_replica_state", "with_replica_state"]

STATE_KEY = "fault_tolerance"
_FIELDS = ("step", "batches_committed")
# A checkpoint saved with fault tolerance off may hold the user's own entry of that name (allowed then).
_HINT = ("HINT: load a checkpoint that this strategy saved; this one was altered or written by another tool, or it was"
         f" saved with fault tolerance off and {STATE_KEY!r} is your own entry there: load it with fault tolerance off,"
         " rename that entry and save it again")


def with_replica_state(group: Optional[Any], state: Mapping[str, Any]) -> dict[str, Any]:
    """``state`` with the group's torchft counters added (a new dict; the caller's is left as it is). Without a
    group, ``state`` itself."""
    if group is None:
        return state  # type: ignore[return-value]
    if STATE_KEY in state:
        raise ValueError(bad_argument(
            f"state[{STATE_KEY!r}]", state[STATE_KEY], f"no entry named {STATE_KEY!r} in a checkpoint's state while"
            " fault_tolerance is on", f"Rename your entry: the strategy stores torchft's step under {STATE_KEY!r}.",
            problem="The key is the strategy's own under fault tolerance",
        ))
    return {**state, STATE_KEY: group.state_dict()}


def restore_replica_state(group: Optional[Any], remainder: dict[str, Any], path: Union[str, Path], *,
                          fallback_step: Any = 0) -> None:
    """Take the torchft counters out of a load's ``remainder`` (what the checkpoint held beyond the requested
    state) and, under fault tolerance, give them to ``group``; ``fallback_step`` is the step of a checkpoint that
    has none (see the module's rule). Raises ``ValueError`` naming ``path`` for a value that is not valid."""
    if group is None:
        # Fault tolerance off: a user's own entry of that name is theirs; only the counters a replica group saved
        # (a checkpoint of a fault-tolerant run, loaded without it) are taken out.
        saved = remainder.get(STATE_KEY)
        if isinstance(saved, dict) and sorted(saved) == sorted(_FIELDS) and all(_is_count(saved[k]) for k in _FIELDS):
            remainder.pop(STATE_KEY)
        return
    saved = remainder.pop(STATE_KEY, None)
    if saved is None:
        _check_count(path, "the step to resume at (a checkpoint without torchft's step)", fallback_step)
        state = {"step": int(fallback_step), "batches_committed": 0}
    else:
        if not isinstance(saved, dict) or sorted(saved) != sorted(_FIELDS):
            raise ValueError(  # the value cut: a user's entry can be any size
                f"The checkpoint {str(path)!r} holds {STATE_KEY}={saved!r:.200}, not torchft's counters. Allowed: a"
                f" dict with exactly the keys {', '.join(map(repr, _FIELDS))}, each an int >= 0 and < 2**53. {_HINT}"
            )
        for name in _FIELDS:
            _check_count(path, f"{STATE_KEY}[{name!r}]", saved[name])
        state = {name: int(saved[name]) for name in _FIELDS}
    group.load_state_dict(state)


def _is_count(value: Any) -> bool:
    # Bounded as the heal transport bounds torchft's counters: far above any run, exact in every JSON reader.
    return type(value) is int and 0 <= value < MAX_COUNT


def _check_count(path: Union[str, Path], what: str, value: Any) -> None:
    if not _is_count(value):
        raise ValueError(f"The checkpoint {str(path)!r} holds {what} = {value!r:.200}. Allowed: an int >= 0 and"
                         f" < 2**53. {_HINT}")
