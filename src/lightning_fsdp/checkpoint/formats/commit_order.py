"""The order in which checkpoints were committed: the one definition every writer records and every reader sorts by.

Why not step order: after a rollback (load step 100 to escape a loss spike, train on, save step 110) the newest
checkpoint has a smaller step than the abandoned step 200, and after a damaged newest checkpoint is skipped the
next save is older by step than the damaged one. Resuming, ``latest`` and retention must follow what was committed
last, and in a run that never rolls back that is step order anyway.

Why not the file's mtime: a copy (``cp`` without ``-p``, ``rsync``, a download from object storage) gives new
mtimes in whatever order it copies. So each save records the key in its own committed metadata, the record that is
written last, just before the commit:

- a sharded checkpoint: its ``checksums.json`` manifest, written by DCP's last step;
- a full checkpoint: the ``checksums.json`` record inside the ``torch.save`` archive;
- a remote save (object storage): its commit object.

Each records ``{COMMIT_ORDER_KEY: next_commit_order()}``: a counter, above every value this process gave before and
above every value it has seen recorded (:func:`observe`). Before each save, rank 0 (the one rank that records it)
reads the orders of the committed checkpoints in the target's directory and observes them
(:mod:`~lightning_fsdp.checkpoint.save`), so the new save counts above every commit there, whoever made it.

Why no clock decides (issue 42 item 3): a clock is monotonic at best within one process. A job requeued on a host
whose clock is behind by ten minutes resumed from step 100 and recorded step 200 *below* step 100, and retention
with ``keep_last=1`` then deleted step 200, the save it had just committed. The wall clock is still mixed in
(``max(time_ns, last + 1)``), only as a floor: a clock set forward pushes the counter up, and later saves still
count above it; a clock set back changes nothing. It also keeps the values in the range older versions
recorded (nanoseconds since 1970), so a directory that both wrote orders correctly.

Saves commit one at a time (a background save waits for the one before), so the order of these values is the commit
order. A checkpoint that records none (written before this key existed, or by another tool) sorts before every
one that does, and among themselves by step (:func:`order_key`).
"""

from __future__ import annotations

import threading
import time
from typing import Any, Optional, Union

__all__ = ["COMMIT_ORDER_KEY", "NEW", "next_commit_order", "order_to_record", "observe", "commit_order_value", "order_key"]

COMMIT_ORDER_KEY = "commit_order"
NEW = "new"
"""A writer's ``commit_order=`` default: record a new value (:func:`next_commit_order`) as it commits, as a save
does. A convert passes its source's value instead (an int, or None to record none), so the copy keeps the source's
place in the commit order rather than becoming the newest checkpoint."""

_lock = threading.Lock()
_last = 0


def next_commit_order() -> int:
    """The value a save records as it commits: above every value this process gave before or saw recorded
    (:func:`observe`)."""
    global _last
    with _lock:
        _last = max(time.time_ns(), _last + 1)
        return _last


def order_to_record(commit_order: Union[int, None, str] = NEW) -> Optional[int]:
    """What a writer given ``commit_order=`` records: a new value for :data:`NEW`, else the value given."""
    if commit_order == NEW:
        return next_commit_order()
    if commit_order is not None and (not isinstance(commit_order, int) or isinstance(commit_order, bool)
                                     or commit_order < 0):
        raise ValueError(f"Invalid commit_order={commit_order!r}. Allowed: {NEW!r}, None or an int >= 0. HINT: pass"
                         " the value a checkpoint records (`commit_order_of(path)`).")
    return commit_order


def observe(order: Optional[int]) -> None:
    """Count from above ``order``, a value some save recorded (None: it recorded none): every later
    :func:`next_commit_order` of this process is greater, whatever the clock says."""
    global _last
    if order is not None:
        with _lock:
            _last = max(_last, order)


def commit_order_value(record: Any) -> Optional[int]:
    """The commit order a checkpoint's committed metadata (a parsed JSON object) records, or None."""
    value = record.get(COMMIT_ORDER_KEY) if isinstance(record, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def order_key(step: int, commit_order: Optional[int], name: str = "") -> tuple:
    """The sort key of a checkpoint, oldest first: by commit order where recorded; those without one before all
    those with one, by step among themselves. ``name`` only breaks ties, so that the order is total."""
    return (0, step, 0, name) if commit_order is None else (1, commit_order, step, name)
