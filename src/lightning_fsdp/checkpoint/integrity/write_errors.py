"""Keep the OSError that says why a checkpoint write failed.

torch's zip writer (``torch.save``, and DCP, which writes every tensor with ``torch.save``) loses it: when the disk
fills in the middle of a record, the OSError raised by the file's ``write`` is dropped inside torch's C++ writer,
and what comes out is ``RuntimeError: [enforce fail at inline_container.cc] unexpected pos ...``, which names
neither the cause nor the file (the OSError is its ``__context__`` at best, and DCP pickles errors to gather them
across ranks, which drops the context). So every file a checkpoint is written to goes through a :class:`WriteRecorder`,
which notes the first OSError before torch sees it, and the error raised is that OSError, naming the file.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Union

from torch.distributed.checkpoint.filesystem import FileSystem

from lightning_fsdp.checkpoint.integrity.agreement import os_error_in

__all__ = ["WriteRecorder", "RecordingFileSystem", "raise_explained", "first_explaining"]


class WriteRecorder:
    """A file object that remembers the first OSError of its writes, flushes and close, and completes short writes
    (the kernel writes what fits before a disk is full), so a full disk raises that OSError instead of going
    unnoticed."""

    def __init__(self, stream: Any, path: Union[str, Path, None] = None) -> None:
        self._stream = stream
        self.path = path
        self.error: Optional[OSError] = None

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        written = self._recorded(self._stream.write, view)
        while written is not None and written < len(view):
            more = self._recorded(self._stream.write, view[written:])
            if not more:
                break
            written += more
        return written

    def flush(self) -> None:
        self._recorded(self._stream.flush)

    def close(self) -> None:
        self._recorded(self._stream.close)

    def _recorded(self, call: Callable[..., Any], *args: Any) -> Any:
        try:
            return call(*args)
        except OSError as err:
            self.error = self.error or err
            raise

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)

    def __enter__(self) -> "WriteRecorder":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class RecordingFileSystem(FileSystem):
    """DCP's local file system, with every stream opened for writing wrapped in a :class:`WriteRecorder`.
    :meth:`raise_recorded` turns the error DCP raised into the first OSError any of them saw."""

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()
        self._errors: list[tuple[OSError, str]] = []

    @contextmanager
    def create_stream(self, path: Union[str, Path], mode: str) -> Iterator[Any]:
        if "r" in mode and "+" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        recorder: Optional[WriteRecorder] = None
        try:
            with super().create_stream(path, mode) as stream:
                recorder = WriteRecorder(stream, path)
                yield recorder
        finally:
            if recorder is not None and recorder.error is not None:
                with self._lock:
                    self._errors.append((recorder.error, str(path)))

    def raise_recorded(self, error: BaseException) -> None:
        """Raise the first recorded OSError, naming its file, chained to ``error``; return if none was recorded.

        Raised even when ``error`` holds the OSError as its ``__context__``: DCP pickles each rank's error to gather
        it, and pickling keeps no context, so only an OSError raised as such reaches the other ranks."""
        with self._lock:
            recorded = self._errors[:1]
            self._errors.clear()
        if recorded:
            cause, path = recorded[0]
            raise OSError(cause.errno, cause.strerror or str(cause), path) from error


def first_explaining(first: Optional[BaseException], later: BaseException) -> BaseException:
    """The first error, unless only the later one says why (an OSError from the final flush of a full disk)."""
    if first is None or (os_error_in(first) is None and os_error_in(later) is not None):
        return later
    return first


def raise_explained(error: BaseException, path: Path) -> None:
    """Raise the OSError behind a failed write (no space left on device, ...), naming the file; else ``error``."""
    cause = os_error_in(error)
    if cause is not None:
        raise OSError(cause.errno, cause.strerror or str(cause), str(path)) from error
    raise error
