"""The file that ``zipfile`` and ``torch.load`` are handed where the bytes are not in a file: an item's ranges as
they arrive, a checked memoryview, the two ends of a zip. What they need of it is the same (readable, seekable,
``tell``, ``seek`` from either end, a ``readinto`` that stops at the end); only where the bytes come from differs,
which each subclass says in its ``_fill`` (or its own ``read``/``readinto``). :class:`BlockReader` is the one that
answers small reads from the two blocks it fetched last."""

from __future__ import annotations

import io
from typing import Any

__all__ = ["SizedReader", "BlockReader"]


class SizedReader(io.RawIOBase):
    """A read-only stream of ``_extent()`` bytes whose position is ``_pos``. A seek before the start stops at 0, as a
    file's would fail: these readers' callers (zipfile, torch) never seek there except by a damaged offset, which
    then reads the start and fails on what it finds, as a damaged file does."""

    _pos = 0

    def _extent(self) -> int:
        raise NotImplementedError

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        if whence not in (io.SEEK_SET, io.SEEK_CUR, io.SEEK_END):
            raise ValueError(f"whence={whence!r} is not one of 0 (start), 1 (current position), 2 (end). HINT:"
                             " pass io.SEEK_SET, io.SEEK_CUR or io.SEEK_END")
        base = (0, self._pos, self._extent())[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        want = min(len(view), self._extent() - self._pos)
        if want <= 0:
            return 0
        count = self._fill(view, want)
        self._pos += count
        return count

    def _fill(self, view: memoryview, want: int) -> int:
        """Copy up to ``want`` bytes (``want`` >= 1, none past the end) from ``_pos`` into ``view``; how many."""
        raise NotImplementedError


class BlockReader(SizedReader):
    """A reader whose reads are answered from the two blocks it fetched last, newest first: zipfile and torch read a
    record's header, skip a little and read the next, so two blocks answer most small reads without another system
    call or request. A subclass says which block to fetch for a read (``_fetch_block``)."""

    def __init__(self) -> None:
        super().__init__()
        self._blocks: list[tuple[int, bytes]] = []  # (start, bytes), newest first

    def _fetch_block(self, position: int, want: int) -> tuple[int, bytes]:
        """A block ``(start, bytes)`` that holds the ``want`` bytes from ``position``, or all that is left of them."""
        raise NotImplementedError

    def _fill(self, view: memoryview, want: int) -> int:
        data, start = self._block_at(self._pos, want)
        count = max(0, min(want, start + len(data) - self._pos))
        view[:count] = data[self._pos - start:self._pos - start + count]
        return count

    def _block_at(self, position: int, want: int) -> tuple[bytes, int]:
        for start, data in self._blocks:
            if start <= position and position + want <= start + len(data):
                return data, start
        start, data = self._fetch_block(position, want)
        self._blocks = [(start, data), *self._blocks[:1]]
        return data, start
