"""Making every rank fail together.

A checkpoint is read and written by several ranks, and many failures are local: a shard only one rank reads is
corrupted, rank 0's disk is full. If only that rank raises, the others walk into the next collective and wait there
until the timeout. :func:`together` runs a step on every rank, shares the outcome, and raises the same
:class:`CheckpointError` on all of them when any rank failed.
"""

from __future__ import annotations

import builtins
from typing import Any, Callable, ContextManager, Optional, Protocol, TypeVar

from lightning_fsdp._base.failures import CollectiveFailure, explain_collective_failure

__all__ = ["Communicator", "CheckpointError", "unreadable", "together", "os_error_in"]

T = TypeVar("T")


class Communicator(Protocol):
    """The collectives a save or load needs (the engine provides them)."""

    global_rank: int

    def barrier(self) -> None: ...

    def broadcast(self, obj: Any, src: int = 0) -> Any: ...

    def agree(self, error: Optional[Any]) -> Optional[tuple[int, Any]]: ...

    def guard(self, phase: str) -> ContextManager[None]:
        """Re-raise a collective that fails in the block (a rank died) as the engine's ``CollectiveFailure``."""
        ...


class CheckpointError(RuntimeError):
    """A checkpoint could not be read or written; raised on every rank alike."""


def unreadable(path: Any, cause: BaseException) -> CheckpointError:
    """The one error for bytes that do not parse as the checkpoint file ``path`` should be: every reader of
    checkpoint bytes (``.metadata``, ``meta.pt``, a full file, ``checksums.json``, a safetensors header) raises it
    for whatever it was handed, so a damaged file is named as such instead of surfacing as the parser's
    ``KeyError``, ``struct.error`` or ``EOFError``. Chain it to ``cause`` (``raise unreadable(path, err) from err``)."""
    lines = str(cause).strip().splitlines()
    detail = f"{type(cause).__name__}: {lines[0][:200]}" if lines else type(cause).__name__
    return CheckpointError(f"{str(path)!r} could not be read: it is damaged, truncated or not the file a checkpoint"
                           f" save writes ({detail}). HINT: load an earlier checkpoint, or save this one again.")


def together(comm: Communicator, what: str, step: Callable[[], T]) -> T:
    """Run ``step`` on this rank; if it fails on any rank, raise on every rank.

    Every rank raises the same exception: the failing rank's type when it is a built-in one (so
    ``except IsADirectoryError`` works everywhere, and an ``OSError`` keeps its ``errno``) or a kind of
    ``CheckpointError`` (``ChecksumError``, ``UnsafeCheckpointError``), else ``CheckpointError``;
    the message says what was being done, which rank failed and why. The failing rank chains its original exception.
    """
    result: Optional[T] = None
    mine: Optional[BaseException] = None
    try:
        result = step()
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as err:  # noqa: BLE001 - DCP's CheckpointException derives from BaseException
        mine = err
    try:
        # A background save's group agrees through plain gloo calls: explained here as the engine's are.
        with explain_collective_failure("agreement on errors"):
            first = comm.agree(None if mine is None else _report(mine, comm.global_rank))
    except CollectiveFailure as err:
        # A rank died or hung in this step (killed mid-upload): the survivors' error says which step, and so which
        # checkpoint or URL, as every other failure of `together` does. The rest of the message stays: the rank,
        # the timeout and the HINT of `explain_collective_failure`.
        text = str(err)
        err.args = (f"{what} failed: {text[:1].lower()}{text[1:]}",)
        raise
    if first is None:
        return result  # type: ignore[return-value]
    _, (origin, type_name, message, errno) = first
    kind = getattr(builtins, type_name, None) or _checkpoint_error_kind(type_name)
    text = f"{what} failed on rank {origin}: {message}"
    if isinstance(kind, type) and issubclass(kind, OSError) and errno is not None:
        raise OSError(errno, text) from mine  # OSError picks the subclass for the errno (FileNotFoundError, ...)
    if isinstance(kind, type) and issubclass(kind, Exception) and kind is not RuntimeError:
        raise kind(text) from mine
    raise CheckpointError(f"{text} ({type_name})") from mine


def _checkpoint_error_kind(type_name: str) -> Optional[type]:
    """The kind of ``CheckpointError`` called ``type_name`` (the failing rank's type arrives as its name)."""
    kinds: list[type] = [CheckpointError]
    while kinds:
        kind = kinds.pop()
        if kind.__name__ == type_name:
            return kind
        kinds.extend(kind.__subclasses__())
    return None


def _report(err: BaseException, rank: int) -> tuple[int, str, str, Optional[int]]:
    """What every rank needs to raise this rank's error: the rank where it started, the type, the message and the
    errno.

    Two kinds of errors hide their origin. DCP gathers the errors of a save or load itself and raises one
    ``CheckpointException`` on every rank, holding each failing rank's exception: the rank that failed is the first
    key there, not the rank reporting. And a failed write (disk full) often surfaces as a ``RuntimeError`` from a C++
    writer whose ``__context__`` is the ``OSError`` that says what happened: that one is reported.
    """
    failures = getattr(err, "failures", None)
    if isinstance(failures, dict) and failures:
        rank = min(failures)
        wrapped = failures[rank]
        err = wrapped[0] if isinstance(wrapped, tuple) else wrapped
    cause = None if isinstance(err, OSError) else os_error_in(err)  # an OSError says itself (a store's, its URL)
    if cause is not None:
        err = cause
    if isinstance(err, OSError) and err.errno is not None and err.strerror:
        # Without the "[Errno N]" prefix: the OSError raised on every rank adds it once.
        message = err.strerror + (f": {str(err.filename)!r}" if err.filename else "")
        return rank, type(err).__name__, _short(message), err.errno
    # str() of a KeyError is the repr of its message; the KeyError raised on every rank adds that once.
    message = err.args[0] if isinstance(err, KeyError) and len(err.args) == 1 else str(err)
    return rank, type(err).__name__, _short(str(message)), None


def os_error_in(err: BaseException) -> Optional[OSError]:
    """The first ``OSError`` with an errno in ``err``'s chain of causes and contexts (``err`` itself included)."""
    seen: set[int] = set()
    current: Optional[BaseException] = err
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno is not None:
            return current
        current = current.__cause__ or current.__context__
    return None


def _short(message: str, limit: int = 1500) -> str:
    """DCP's errors carry every rank's full traceback; keep the lines that say what went wrong."""
    if "Traceback" in message:
        lines = message.splitlines()
        summary = [lines[0]] + [
            line for line in lines[1:] if line and not line[0].isspace() and not line.startswith("Traceback")
        ]
        message = " | ".join(dict.fromkeys(summary))
    return message if len(message) <= limit else message[:limit] + " [...]"
