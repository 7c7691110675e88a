"""What must wait for a background save that is still in flight (``save.AsyncSaves``).

Two things would otherwise act as if the save were done when it is not:

- **Removals.** ``ModelCheckpoint(save_top_k=1)`` removes the checkpoint of step 1 as soon as the save of step 2
  returns, which for a background save is before step 2 is written. Killed in between, the job would leave no
  checkpoint at all. :class:`DeferredRemovals` holds such a removal until the save in flight is committed, and drops
  it if that save fails: a checkpoint is only removed once the one that supersedes it is in place. Retention's
  pruning (``StepCheckpoints(keep_last=...)``) is deferred the same way, and runs as soon as the commit is done, so
  exactly ``keep_last`` remain once every save is committed (at ``wait_for_saves``, the next save, and exit).
- **The end of the process.** A script's last background save is otherwise never waited for: its error would only be
  raised by a later save, load or teardown, and a script ends without one, so a save that failed (a full disk) ended
  with exit status 0 and no checkpoint. At exit, :func:`track`'ed saves are finished, agreed across ranks, and a
  failure is printed and turns the exit status into 1 (through :mod:`lightning_fsdp._base.process_exit`, which ends the
  process after its own clean-up).
"""

from __future__ import annotations

import atexit
import shutil
import sys
import threading
from pathlib import Path
from typing import Any, Callable, Optional

import torch.distributed as dist

from lightning_fsdp._base import process_exit

__all__ = ["DeferredRemovals", "GroupComm", "remove_checkpoint", "track", "untrack"]


def remove_checkpoint(path: Path) -> None:
    """Remove a checkpoint: a sharded directory, a file, or a link (only the link, never what it points to)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


class DeferredRemovals:
    """Checkpoint removals, and other actions (retention's pruning), that wait for the save in flight (rank 0, where
    the files are removed).

    States: no save outstanding, or its commit done (an action runs at once); a save writing (actions queue up, and
    run right after its commit, in the thread that commits); the save failed (actions are dropped, and stay dropped
    until the failure has been reported by ``settle``, so the checkpoints they would remove are kept).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._state = "idle"  # "idle" | "writing" | "failed"
        self._queued: list[tuple[Callable[[], Any], str]] = []
        self._error: Optional[BaseException] = None

    def hold(self) -> None:
        """A save has started: removals wait for its commit."""
        with self._lock:
            self._state, self._queued, self._error = "writing", [], None

    def remove(self, path: Path) -> None:
        self.defer(lambda: remove_checkpoint(path), f"Removing the superseded checkpoint {str(path)!r}")

    def defer(self, action: Callable[[], Any], what: str) -> None:
        """Run ``action`` once the save in flight is committed: at once when none is, never when it failed.
        ``what`` names it in the error it may raise."""
        with self._lock:
            if self._state == "writing":
                self._queued.append((action, what))
                return
            if self._state == "failed":
                return  # what it would remove may be the newest checkpoint there is
        action()

    def committed(self) -> None:
        """The save is in place: run the actions it superseded (an error is reported by ``settle``)."""
        with self._lock:
            queued, self._queued, self._state = self._queued, [], "idle"
        for action, what in queued:
            try:
                action()
            except OSError as err:
                self._error = self._error or OSError(err.errno, f"{what} failed: {err.strerror}")
            except Exception as err:  # noqa: BLE001 - reported by `settle`, on every rank
                self._error = self._error or err

    def failed(self) -> None:
        with self._lock:
            self._queued, self._state = [], "failed"

    def settle(self) -> Optional[BaseException]:
        """The outcome has been collected: removals happen at once again. Returns a removal's error, if any."""
        with self._lock:
            error, self._error, self._state = self._error, None, "idle"
        return error


# --- the end of the process ---------------------------------------------------------------------------------------

_outstanding: dict[int, tuple[Any, Any]] = {}  # id(AsyncSaves) -> (the AsyncSaves, its Communicator); kept alive
_registered = False


def track(saves: Any, comm: Any, group: Optional[dist.ProcessGroup]) -> None:
    """``saves`` has a save in flight: finish it at exit unless ``untrack``'ed first. ``group``: the process group of
    its background collectives, where the agreement at exit runs."""
    global _registered
    _outstanding[id(saves)] = (saves, GroupComm(comm.global_rank, group))
    if not _registered:
        _registered = True
        # Registered after the process-exit handler (which the engine registers when it creates the process group),
        # so it runs before it (atexit runs handlers last-in first-out): the groups still exist.
        atexit.register(_finish_at_exit)


def untrack(saves: Any) -> None:
    _outstanding.pop(id(saves), None)


def _finish_at_exit() -> None:
    # Python has joined DCP's writer threads by now (before any atexit handler), so every write is over; what is left
    # is to collect the outcome on every rank and agree on it.
    failed = False
    for saves, comm in list(_outstanding.values()):
        if hasattr(sys, "last_value"):
            # The script ended with an uncaught exception, so the other ranks may be anywhere: no collective, each
            # rank reports what it knows (its exit status is 1 already).
            comm = _Alone(comm.global_rank)
        try:
            saves.wait(comm)
        except BaseException as err:  # noqa: BLE001 - reported here, and in the exit status
            failed = True
            print(f"lightning_fsdp: {type(err).__name__}: {err}\nThe script ended while this background save was in"
                  " flight, so the checkpoint was not written; the previous one at that path, if any, is unchanged."
                  " The process exits with status 1. HINT: fix the cause above; to handle such an error in the"
                  " script, make its last save synchronous (`async_save=False`) or load a checkpoint after it, which"
                  " raises the background save's error.", file=sys.stderr, flush=True)
    _outstanding.clear()
    if failed:
        process_exit.exit_with_status(1)


class GroupComm:
    """``together``'s view of the background saves' own process group: used at exit, when the training code on
    other ranks is done, so the agreement cannot interleave with a collective of the default group."""

    def __init__(self, global_rank: int, group: Optional[dist.ProcessGroup]) -> None:
        self.global_rank, self._group = global_rank, group

    @property
    def process_group(self) -> Optional[dist.ProcessGroup]:
        """The group a store's commit gathers over (:mod:`~lightning_fsdp.checkpoint.io.remote`)."""
        return self._group

    def agree(self, error: Optional[Any]) -> Optional[tuple[int, Any]]:
        if self._group is None or not dist.is_initialized():
            return None if error is None else (self.global_rank, error)
        errors: list[Optional[Any]] = [None] * dist.get_world_size(self._group)
        dist.all_gather_object(errors, error, group=self._group)
        return next(((r, e) for r, e in enumerate(errors) if e is not None), None)


class _Alone:
    """``together`` on this rank only."""

    def __init__(self, global_rank: int) -> None:
        self.global_rank = global_rank

    def agree(self, error: Optional[Any]) -> Optional[tuple[int, Any]]:
        return None if error is None else (self.global_rank, error)

