"""Write a ``torch.save`` file one tensor at a time.

``torch.save`` pickles the whole object first and then writes every tensor's bytes, so all tensors must be in memory
at once: for a full checkpoint, the whole model and optimizer on rank 0. The file format allows better. Its
``data.pkl`` only *refers* to tensor data by key, with dtype and size, and each tensor's bytes are a separate
record. So this module pickles a skeleton first, from shapes and dtypes alone, then produces, writes and frees the
tensors one by one. The result is an ordinary ``torch.save`` zip archive: ``torch.load(path, weights_only=True)``
and ``mmap=True`` read it, without this package.

Tensors may be DTensors: each is gathered with ``full_tensor()`` when its turn comes, a collective every rank takes
part in, in the same order, so all ranks walk the same skeleton. Only the writer rank keeps and writes the bytes.
"""

from __future__ import annotations

import collections
import io
import pickle
import sys
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from lightning_fsdp._compat import open_zipfile_writer, storage_type_for

__all__ = ["write_full_checkpoint", "write_streaming", "save_file"]


def write_full_checkpoint(path: Path, obj: Any, *, is_writer: bool) -> None:
    """Write ``obj`` (nested dicts/lists of tensors, DTensors and plain values) as a ``torch.save`` file on the
    writer rank; every rank must call this with the same structure, since DTensors are gathered collectively."""
    write_streaming(path if is_writer else None, obj, _gather)


def write_streaming(path: Optional[Path], obj: Any, materialize: Callable[[Tensor], Tensor]) -> None:
    """Core of the streaming writer. ``materialize`` turns each tensor of ``obj`` into a CPU tensor when its turn
    comes (gathering, reading from disk, ...); with ``path=None`` it still runs, for its collectives, and nothing is
    written."""
    skeleton, tensors = _skeletonize(obj)
    if path is None:
        for tensor in tensors:
            materialize(tensor)
        return
    # A failed write (disk full) must not stop this rank from taking part in the remaining gathers, or the other
    # ranks would wait in them forever; the error is raised once every tensor has been through `materialize`.
    error: Optional[BaseException] = None
    try:
        stream = open(path, "wb")  # noqa: SIM115 - closed below on every path
    except Exception:  # noqa: BLE001 - re-raised below, e.g. a missing directory or a read-only filesystem
        for tensor in tensors:
            materialize(tensor)
        raise
    # The archive goes through a Python file object, not a path: a failed write then surfaces as the OSError that
    # says why (torch's writer raises "unexpected pos" with the OSError as its context), and the file is closed on
    # every exit, so a failed save's deleted staging file does not keep its disk space until the process ends.
    try:
        with open_zipfile_writer(stream) as writer:
            try:
                data = io.BytesIO()
                _Pickler(data, protocol=2).dump(skeleton)
                payload = data.getvalue()
                writer.write_record("data.pkl", payload, len(payload))
                for name, value in ((".format_version", "1"), ("byteorder", sys.byteorder)):
                    writer.write_record(name, value, len(value))
            except Exception as err:  # noqa: BLE001 - re-raised below
                error = err
            for key, tensor in enumerate(tensors):
                value = materialize(tensor)
                if error is not None:
                    continue
                try:
                    value = value.detach().contiguous().cpu()
                    storage = value.untyped_storage()
                    writer.write_record(f"data/{key}", storage, storage.nbytes())
                except Exception as err:  # noqa: BLE001 - re-raised below
                    error = err
                del value  # free before the next tensor is produced
    except Exception as err:  # noqa: BLE001 - closing the archive failed (the first error wins)
        error = error or err
    finally:
        try:
            stream.close()
        except Exception as err:  # noqa: BLE001 - the final flush failed
            error = error or err
    if error is not None:
        _raise_explained(error, path)


def save_file(obj: Any, path: Path) -> None:
    """``torch.save`` through a file object, so a failed write raises the OSError that says why, naming ``path``."""
    try:
        with open(path, "wb") as stream:
            torch.save(obj, stream)
    except Exception as err:  # noqa: BLE001
        _raise_explained(err, path)


def _raise_explained(error: BaseException, path: Path) -> None:
    """Raise the OSError behind a failed write (no space left on device, ...), naming the file; else ``error``."""
    cause = error if isinstance(error, OSError) else error.__context__
    if isinstance(cause, OSError) and cause.errno is not None:
        raise OSError(cause.errno, cause.strerror or str(cause), str(path)) from error
    raise error


def _gather(tensor: Tensor) -> Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


class _StorageRef:
    """Stands for one tensor's bytes in the pickle; the pickler turns it into torch's storage reference."""

    def __init__(self, key: int, dtype: torch.dtype, numel: int) -> None:
        self.key, self.dtype, self.numel = key, dtype, numel


class _TensorStub:
    """Pickles exactly like a contiguous CPU tensor does under ``torch.save``, without the data."""

    def __init__(self, ref: _StorageRef, shape: tuple[int, ...]) -> None:
        self.ref, self.shape = ref, shape

    def __reduce_ex__(self, protocol: int) -> tuple:
        stride = _contiguous_stride(self.shape)
        return (torch._utils._rebuild_tensor_v2, (self.ref, 0, self.shape, stride, False, collections.OrderedDict()))


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj: Any) -> Optional[tuple]:
        if isinstance(obj, _StorageRef):
            return ("storage", storage_type_for(obj.dtype), str(obj.key), "cpu", obj.numel)
        return None


def _skeletonize(obj: Any) -> tuple[Any, list[Tensor]]:
    tensors: list[Tensor] = []

    def walk(value: Any) -> Any:
        if isinstance(value, Tensor):
            tensors.append(value)
            shape = tuple(value.shape)
            return _TensorStub(_StorageRef(len(tensors) - 1, value.dtype, _numel(shape)), shape)
        if isinstance(value, dict):
            return {k: walk(v) for k, v in value.items()}  # an OrderedDict is written as a plain dict
        if type(value) in (list, tuple):
            return type(value)(walk(v) for v in value)
        return value

    return walk(obj), tensors


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, running = [], 1
    for size in reversed(shape):
        stride.append(running)
        running *= max(size, 1)
    return tuple(reversed(stride))
