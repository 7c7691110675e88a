"""The file that ``zipfile`` and ``torch.load`` are handed where the bytes are not in a file: an item's ranges as
they arrive, a checked memoryview, the two ends of a zip. What they need of it is the same (readable, seekable,
``tell``, ``seek`` from either end); only where the bytes come from differs, which each subclass says in its
``read``/``readinto``."""

from __future__ import annotations

import io

__all__ = ["SizedReader"]


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
