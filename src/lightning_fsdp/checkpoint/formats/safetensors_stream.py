"""Writing a safetensors file one tensor at a time, so an export holds about one tensor, never the whole model; and
reading one on any fsspec filesystem by byte ranges (:class:`RangedFile`: the header, then only the rows asked for).

The format puts everything a reader needs to know before the data: 8 bytes (little-endian) giving the header's
length, the header (JSON: ``"__metadata__"`` and, per tensor, its dtype, shape and ``data_offsets`` into the data
that follows), then the tensors' raw bytes back to back in the order of their offsets. Shapes and dtypes alone fix
the header, so it is written first, and each tensor is then read from the source, written and freed in turn.

The file is laid out exactly as ``safetensors.torch.save_file`` (0.8) lays it out, so an export is byte for byte
the file the library would write: tensors ordered by dtype (widest first, in safetensors' dtype order, which keeps
every tensor aligned to its element size) then by name; compact JSON with ``"__metadata__"`` first and the tensors
in data order; the header padded with spaces to a multiple of 8 bytes (the reader strips trailing spaces); no
holes between tensors (the reader requires the offsets to tile the data exactly).
"""

from __future__ import annotations

import json
import struct
import warnings
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

__all__ = ["SafetensorsItem", "header_bytes", "ordered", "write_file", "DTYPE_NAMES", "RangedFile"]

# safetensors' dtype names, widest first in the order its writer sorts them (descending `Dtype` enum order).
DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.uint64: "U64", torch.int64: "I64", torch.float64: "F64", torch.complex64: "C64",
    torch.float32: "F32", torch.uint32: "U32", torch.int32: "I32",
    torch.bfloat16: "BF16", torch.float16: "F16", torch.uint16: "U16", torch.int16: "I16",
    torch.float8_e5m2fnuz: "F8_E5M2FNUZ", torch.float8_e4m3fnuz: "F8_E4M3FNUZ", torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
}
_RANK = {dtype: i for i, dtype in enumerate(DTYPE_NAMES)}
_HEADER_SIZE = struct.Struct("<Q")


@dataclass(frozen=True)
class SafetensorsItem:
    """One tensor of an export: its name in the file, and what the header needs to know of it."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count * self.dtype.itemsize


def ordered(items: Iterable[SafetensorsItem]) -> list[SafetensorsItem]:
    """``items`` in the order their bytes go into the file. Raises ``TypeError`` for a dtype safetensors lacks."""
    items = list(items)
    for item in items:
        if item.dtype not in _RANK:
            raise TypeError(f"The tensor {item.name!r} has the dtype {item.dtype}, which safetensors cannot store."
                            f" Allowed: {', '.join(str(d).removeprefix('torch.') for d in DTYPE_NAMES)}. HINT: export"
                            " a checkpoint whose weights have one of these dtypes, or convert to `--to full`.")
    return sorted(items, key=lambda item: (_RANK[item.dtype], item.name))


def header_bytes(items: Sequence[SafetensorsItem], metadata: Optional[dict[str, str]]) -> bytes:
    """The 8-byte length and the padded JSON header for ``items``, already in file order (see :func:`ordered`)."""
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = metadata
    offset = 0
    for item in items:
        if item.name in header:
            raise ValueError(f"The name {item.name!r} occurs twice in one safetensors file; each must be unique. HINT: rename or"
                             " drop one of the two entries before the export.")
        header[item.name] = {"dtype": DTYPE_NAMES[item.dtype], "shape": list(item.shape),
                             "data_offsets": [offset, offset + item.nbytes]}
        offset += item.nbytes
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)  # the data then starts 8-byte aligned
    return _HEADER_SIZE.pack(len(text)) + text


def write_file(path: Path, items: Sequence[SafetensorsItem], tensors: Iterator[torch.Tensor], *,
               metadata: Optional[dict[str, str]] = None,
               written: Callable[[SafetensorsItem, torch.Tensor], None] = lambda item, tensor: None) -> None:
    """Write ``items`` (in file order) to ``path``, taking their data from ``tensors``, one tensor per item in the
    same order. Each tensor is written and released before the next is taken, so the caller's iterator decides
    how much is ever held; ``written`` is called after each (e.g. to drop a memory-mapped tensor's pages)."""
    with open(path, "wb") as file:
        file.write(header_bytes(items, metadata))
        for item in items:
            tensor = next(tensors)
            if tuple(tensor.shape) != item.shape or tensor.dtype != item.dtype:
                raise RuntimeError(f"internal error: {item.name!r} was announced as {item.dtype} {list(item.shape)}"
                                   f" but read as {tensor.dtype} {list(tensor.shape)}")
            _write_tensor(file, tensor)
            written(item, tensor)
            del tensor


def _write_tensor(file, tensor: torch.Tensor) -> None:
    if tensor.numel() == 0:
        return
    # A contiguous tensor is written from its own memory (no copy); a strided view is copied once, alone.
    flat = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    file.write(memoryview(flat.numpy()))


# ------------------------------------------------------------------------------------------- reading by ranges


class RangedFile:
    """A safetensors file on any fsspec filesystem (``fs``), read by byte ranges: the 8-byte length and the header
    once, then only the rows of each tensor a reader asks for (:meth:`row_range`, :meth:`piece`).

    The header is checked as the safetensors library checks a local file before it reads a byte of data: a length
    that fits the file, a JSON object, every tensor a known dtype with a shape whose size matches its offsets, and
    the offsets tiling the data exactly (no gap, no overlap, nothing after the last). A ``ValueError`` says which.
    """

    def __init__(self, fs, url: str) -> None:
        self.url = url
        size = fs.size(url)
        if size < _HEADER_SIZE.size:
            raise _bad_header(f"the file has {size} bytes, fewer than the 8 of a safetensors header length")
        (length,) = _HEADER_SIZE.unpack(fs.cat_file(url, start=0, end=_HEADER_SIZE.size))
        if _HEADER_SIZE.size + length > size:
            raise _bad_header(f"its header length {length} runs past the end of the file ({size} bytes)")
        header = json.loads(fs.cat_file(url, start=_HEADER_SIZE.size, end=_HEADER_SIZE.size + length))
        if not isinstance(header, dict):
            raise _bad_header("its header is not a JSON object")
        self.data_start = _HEADER_SIZE.size + length
        meta = header.pop("__metadata__", None)
        if meta is not None and not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
            raise _bad_header("its '__metadata__' is not a mapping of strings to strings")
        self.header_metadata: Optional[dict[str, str]] = meta
        names = {name: dtype for dtype, name in DTYPE_NAMES.items()}
        self.entries: dict[str, tuple[torch.dtype, tuple[int, ...], int, int]] = {}
        for key, entry in header.items():
            try:
                dtype, shape, (start, end) = names[entry["dtype"]], tuple(entry["shape"]), entry["data_offsets"]
            except (KeyError, TypeError, ValueError) as err:
                raise _bad_header(f"the header entry of {key!r} is not a dtype known to torch, a shape and two data"
                                 f" offsets ({err!r})") from err
            if not all(isinstance(d, int) and d >= 0 for d in shape) or not 0 <= start <= end:
                raise _bad_header(f"the header entry of {key!r} has a bad shape {list(shape)} or offsets"
                                 f" {[start, end]}")
            if end - start != SafetensorsItem(key, shape, dtype).nbytes:
                raise _bad_header(f"{key!r} spans {end - start} bytes, but its shape and dtype need"
                                 f" {SafetensorsItem(key, shape, dtype).nbytes}")
            self.entries[key] = (dtype, shape, start, end)
        at = 0
        for dtype, shape, start, end in sorted(self.entries.values(), key=lambda e: (e[2], e[3])):
            if start != at:
                raise _bad_header(f"its tensors' data offsets do not tile the data (a {'gap' if start > at else 'overlap'}"
                                 f" at byte {at})")
            at = end
        if self.data_start + at != size:
            raise _bad_header(f"its tensors end at byte {self.data_start + at}, but the file has {size} bytes")

    def row_range(self, key: str, region: tuple[slice, ...]) -> tuple[int, int]:
        """The bytes ``[start, end)`` of the file that hold ``region`` of ``key``: its rows along dim 0, whole."""
        dtype, shape, start, end = self.entries[key]
        if not shape:
            return self.data_start + start, self.data_start + end
        row = SafetensorsItem(key, shape[1:], dtype).nbytes
        first, stop = region[0].start or 0, shape[0] if region[0].stop is None else region[0].stop
        return self.data_start + start + first * row, self.data_start + start + stop * row

    def piece(self, key: str, region: tuple[slice, ...], data: bytes) -> torch.Tensor:
        """``region`` of ``key`` from ``data``, the bytes :meth:`row_range` named."""
        dtype, shape, _, _ = self.entries[key]
        if not shape:
            return _view(data, dtype).reshape(())
        rows = (region[0].stop if region[0].stop is not None else shape[0]) - (region[0].start or 0)
        if rows * SafetensorsItem(key, shape[1:], dtype).nbytes == 0:
            return torch.empty((rows, *shape[1:]), dtype=dtype)[(slice(None), *region[1:])]
        return _view(data, dtype).reshape(rows, *shape[1:])[(slice(None), *region[1:])]


def _view(data: bytes, dtype: torch.dtype) -> torch.Tensor:
    """``data`` seen as a tensor, not copied (a copy would hold every range twice): the reader only copies out of
    it, so that the buffer of ``bytes`` is read-only does not matter (torch warns that it is, once per call)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)
        return torch.frombuffer(data, dtype=dtype)


def _bad_header(problem: str) -> ValueError:
    """The error for a safetensors file whose header does not hold; the reader names the file (``unreadable``)."""
    return ValueError(f"{problem}. HINT: the file is damaged or is not a safetensors file; upload it again, or"
                      " re-create it with `save_pretrained`.")
