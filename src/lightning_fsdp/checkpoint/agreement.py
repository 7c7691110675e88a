"""Making every rank fail together.

A checkpoint is read and written by several ranks, and many failures are local: a shard only one rank reads is
corrupted, rank 0's disk is full. If only that rank raises, the others walk into the next collective and wait there
until the timeout. :func:`together` runs a step on every rank, shares the outcome, and raises the same
:class:`CheckpointError` on all of them when any rank failed.
"""

from __future__ import annotations

import builtins
from typing import Any, Callable, Optional, Protocol, TypeVar

__all__ = ["Communicator", "CheckpointError", "together"]

T = TypeVar("T")


class Communicator(Protocol):
    """The collectives a save or load needs (the engine provides them)."""

    global_rank: int

    def barrier(self) -> None: ...

    def broadcast(self, obj: Any, src: int = 0) -> Any: ...

    def agree(self, error: Optional[Any]) -> Optional[tuple[int, Any]]: ...


class CheckpointError(RuntimeError):
    """A checkpoint could not be read or written; raised on every rank alike."""


def together(comm: Communicator, what: str, step: Callable[[], T]) -> T:
    """Run ``step`` on this rank; if it fails on any rank, raise on every rank.

    Every rank raises the same exception: the failing rank's type when it is a built-in one (so
    ``except IsADirectoryError`` works everywhere), else ``CheckpointError``; the message says what was being done,
    which rank failed and why. The failing rank chains its original exception.
    """
    result: Optional[T] = None
    mine: Optional[BaseException] = None
    try:
        result = step()
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as err:  # noqa: BLE001 - DCP's CheckpointException derives from BaseException
        mine = err
    first = comm.agree(None if mine is None else (type(mine).__name__, _short(str(mine))))
    if first is None:
        return result  # type: ignore[return-value]
    rank, (type_name, message) = first
    kind = getattr(builtins, type_name, None)
    text = f"{what} failed on rank {rank}: {message}"
    if isinstance(kind, type) and issubclass(kind, Exception) and kind is not RuntimeError:
        raise kind(text) from mine
    raise CheckpointError(f"{text} ({type_name})") from mine


def _short(message: str, limit: int = 1500) -> str:
    """DCP's errors carry every rank's full traceback; keep the lines that say what went wrong."""
    if "Traceback" in message:
        lines = message.splitlines()
        summary = [lines[0]] + [
            line for line in lines[1:] if line and not line[0].isspace() and not line.startswith("Traceback")
        ]
        message = " | ".join(dict.fromkeys(summary))
    return message if len(message) <= limit else message[:limit] + " [...]"
