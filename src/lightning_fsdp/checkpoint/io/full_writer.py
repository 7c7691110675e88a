"""Write a ``torch.save`` file one tensor at a time.

``torch.save`` pickles the whole object first and then writes every tensor's bytes, so all tensors must be in memory
at once: for a full checkpoint, the whole model and optimizer on rank 0. The file format allows better. Its
``data.pkl`` only *refers* to tensor data by key, with dtype and size, and each tensor's bytes are a separate
record. So this module pickles a skeleton first, from shapes and dtypes alone, then produces, writes and frees the
tensors one by one. The result is an ordinary ``torch.save`` zip archive: ``torch.load(path, weights_only=True)``
and ``mmap=True`` read it, without this package. One record more, ``checksums.json``, holds a fast digest of each
tensor record (:mod:`~lightning_fsdp.checkpoint.integrity`); ``torch.load`` reads only the records its index names and passes it by.

Tensors may be DTensors: each is gathered with ``full_tensor()`` when its turn comes, a collective every rank takes
part in, in the same order, so all ranks walk the same skeleton. Only the writer rank keeps and writes the bytes.

The skeleton declares every tensor as contiguous, at offset 0 of a storage of exactly its own elements, so each
record must hold exactly those bytes and no others: see :func:`_element_bytes`.
"""

from __future__ import annotations

import collections
import io
import pickle
import sys
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from lightning_fsdp._base.compat import legacy_storage_type, open_zipfile_writer, rebuild_tensor, rebuild_tensor_with_dtype
from lightning_fsdp.checkpoint.formats.commit_order import NEW
from lightning_fsdp.checkpoint.integrity.digests import ZIP_CHECKSUMS_RECORD
from lightning_fsdp.checkpoint.integrity.tree import map_leaves
from lightning_fsdp.checkpoint.integrity.write_errors import WriteRecorder, first_explaining, raise_explained
from lightning_fsdp.checkpoint.integrity.zipfiles import RecordDigests
from lightning_fsdp.checkpoint.io.memory import TrimAfter

__all__ = ["write_full_checkpoint", "write_streaming", "save_file"]


def write_full_checkpoint(path: Union[Path, str], obj: Any, *, is_writer: bool, sink: Any = None) -> None:
    """Write ``obj`` (nested dicts/lists of tensors, DTensors and plain values) as a ``torch.save`` file on the
    writer rank; every rank must call this with the same structure, since DTensors are gathered collectively.
    ``sink``: an upload sink (:mod:`.sink`) to stream the file into instead of writing it at ``path`` (which then
    only names it in errors)."""
    write_streaming(path if is_writer else None, obj, _gather, sink=sink if is_writer else None)


def write_streaming(path: Union[Path, str, None], obj: Any, materialize: Callable[[Tensor], Tensor],
                    commit_order: Union[int, None, str] = NEW, *, sink: Any = None) -> None:
    """Core of the streaming writer. ``materialize`` turns each tensor of ``obj`` into a CPU tensor when its turn
    comes (gathering, reading from disk, ...); with ``path=None`` it still runs, for its collectives, and nothing is
    written. ``commit_order``: what the checksums record records (a convert keeps its source's, see
    :data:`~lightning_fsdp.checkpoint.formats.commit_order.NEW`). ``sink``: an upload sink (:mod:`.sink`, a context
    manager) that the archive streams into instead of a file at ``path``, straight from memory (issue 43): it is
    completed once the archive is whole, and aborted (no object) on any error."""
    skeleton, tensors = _skeletonize(obj)
    if path is None:
        for tensor in tensors:
            materialize(tensor)
        return
    # A failed write (disk full) must not stop this rank from taking part in the remaining gathers, or the other
    # ranks would wait in them forever; the error is raised once every tensor has been through `materialize`.
    error: Optional[BaseException] = None
    try:
        stream = WriteRecorder(sink if sink is not None else open(path, "wb"))  # noqa: SIM115 - closed below
    except Exception:  # noqa: BLE001 - re-raised below, e.g. a missing directory or a read-only filesystem
        for tensor in tensors:
            materialize(tensor)
        raise
    # The archive goes through a Python file object, not a path: a failed write then surfaces as the OSError that
    # says why (torch's writer raises "unexpected pos" with the OSError as its context), and the file is closed on
    # every exit, so a failed save's deleted staging file does not keep its disk space until the process ends.
    # A fast digest of each tensor record, hashed while its bytes are in the cache.
    digests = RecordDigests(commit_order=commit_order)
    trim = TrimAfter()
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
                    digests.add(f"data/{key}", _write_tensor(writer, key, value, declared=tensor))
                except Exception as err:  # noqa: BLE001 - re-raised below
                    error = err
                freed = value.untyped_storage().nbytes()
                del value  # free before the next tensor is produced
                # glibc keeps freed gathered tensors resident (they come from its heap once its mmap threshold has
                # grown), fragmented across tensors of different sizes, and the next ones then grow the heap: rank
                # 0's peak rose by about a third of the model and optimizer bytes on a 17M-parameter GPT. Handing the
                # free pages back every few MiB keeps it near the largest tensor (:mod:`~lightning_fsdp.checkpoint.io.memory`).
                trim.freed(freed)
            if error is None and digests.wanted:
                try:
                    payload = digests.payload()
                    writer.write_record(ZIP_CHECKSUMS_RECORD, payload, len(payload))
                except Exception as err:  # noqa: BLE001 - re-raised below
                    error = err
    except Exception as err:  # noqa: BLE001 - closing the archive failed (the first error wins)
        error = first_explaining(error, err)
    finally:
        try:
            if sink is None:
                stream.close()
            elif error is None and stream.error is None:
                sink.__exit__(None, None, None)  # the archive is whole: complete the object
            else:
                failed = error or stream.error
                sink.__exit__(type(failed), failed, failed.__traceback__)  # abort: no object appears
        except Exception as err:  # noqa: BLE001 - the final flush (or the upload's completion) failed
            error = first_explaining(error, err)
    if error is not None:
        raise_explained(stream.error or error, path)


def save_file(obj: Any, path: Path) -> None:
    """``torch.save`` through a file object, so a failed write raises the OSError that says why, naming ``path``."""
    stream: Optional[WriteRecorder] = None
    try:
        with open(path, "wb") as raw:
            stream = WriteRecorder(raw)
            torch.save(obj, stream)
    except Exception as err:  # noqa: BLE001
        raise_explained((stream.error if stream is not None else None) or err, path)


def _write_tensor(writer: Any, key: int, value: Tensor, *, declared: Tensor) -> torch.UntypedStorage:
    value = _dense_cpu(value)
    if value.shape != declared.shape or value.dtype != declared.dtype:  # its bytes would not match the skeleton
        raise RuntimeError(f"internal error: tensor {key} of the checkpoint was declared as {tuple(declared.shape)}"
                           f" {declared.dtype} but produced {tuple(value.shape)} {value.dtype}. Please report this.")
    data = _element_bytes(value)
    writer.write_record(f"data/{key}", data, data.nbytes())
    return data


def _dense_cpu(value: Tensor) -> Tensor:
    """``value`` on the CPU with its elements in row-major order in memory. Copies only what is not so already: a
    tensor that is not contiguous (a transpose, a strided slice), one with a lazy conjugate or negative bit (its
    memory holds the values before that), one on another device. Made contiguous on its own device first, so the
    CPU (rank 0's memory, the scarce one in a full save) holds one copy only."""
    return value.detach().resolve_conj().resolve_neg().contiguous().cpu()


def _element_bytes(value: Tensor) -> torch.UntypedStorage:
    """The bytes of the elements of ``value`` (contiguous, on the CPU), and no others.

    Its storage may hold more than its elements: FSDP2's ``full_tensor()`` of a parameter whose dim 0 does not
    divide by the world size is a view into a padded buffer, and a slice such as ``history[8:]`` is a view with an
    offset. ``.contiguous()`` copies neither, and writing the whole storage makes a record that ``torch.load``
    refuses (or, with ``mmap=True``, reads from the wrong offset). A slice of the storage is a view, not a copy, so
    a gathered parameter is never held twice; a tensor that owns exactly its storage is written as torch.save does.
    """
    if not value.is_contiguous():
        raise RuntimeError("internal error: only a contiguous tensor's elements are one run of bytes")
    storage = value.untyped_storage()
    start = value.storage_offset() * value.element_size()
    nbytes = value.numel() * value.element_size()
    if start == 0 and storage.nbytes() == nbytes:
        return storage
    return storage[start:start + nbytes]


def _gather(tensor: Tensor) -> Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


class _StorageRef:
    """Stands for one tensor's bytes in the pickle; the pickler turns it into torch's storage reference."""

    def __init__(self, key: int, dtype: torch.dtype, numel: int) -> None:
        self.key, self.dtype, self.numel = key, dtype, numel
        self.legacy_type = legacy_storage_type(dtype)


class _TensorStub:
    """Pickles exactly like a contiguous CPU tensor does under ``torch.save``, without the data."""

    def __init__(self, ref: _StorageRef, shape: tuple[int, ...]) -> None:
        self.ref, self.shape = ref, shape

    def __reduce_ex__(self, protocol: int) -> tuple:
        args = (self.ref, 0, self.shape, _contiguous_stride(self.shape), False, collections.OrderedDict())
        if self.ref.legacy_type is None:  # float8 and the other newer dtypes: an untyped storage, then the dtype
            return (rebuild_tensor_with_dtype, (*args, self.ref.dtype))
        return (rebuild_tensor, args)


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj: Any) -> Optional[tuple]:
        if not isinstance(obj, _StorageRef):
            return None
        if obj.legacy_type is None:  # an untyped storage counts bytes, a legacy typed one elements
            return ("storage", torch.UntypedStorage, str(obj.key), "cpu", obj.numel * obj.dtype.itemsize)
        return ("storage", obj.legacy_type, str(obj.key), "cpu", obj.numel)


def _skeletonize(obj: Any) -> tuple[Any, list[Tensor]]:
    """The skeleton of ``obj`` and its tensors in the order their records are written. A container that ``obj``
    holds twice is walked once and stays shared in the skeleton, so the pickle stores it once, as torch.save does
    (see :mod:`~lightning_fsdp.checkpoint.integrity.tree`)."""
    tensors: list[Tensor] = []

    def stub(value: Any, path: tuple) -> Any:
        if not isinstance(value, Tensor):
            return value
        _check_writable(value, "state" + "".join(f"[{step!r}]" for step in path))
        tensors.append(value)
        shape = tuple(value.shape)
        return _TensorStub(_StorageRef(len(tensors) - 1, value.dtype, _numel(shape)), shape)

    return map_leaves(obj, stub, what="the checkpoint state"), tensors


def _check_writable(value: Tensor, where: str) -> None:
    """The skeleton can only describe dense tensors of a dtype torch.save knows; refuse the rest before any byte
    (or gather) is spent, on every rank alike, rather than write a file that reads back wrong."""
    problem = None
    if value.layout != torch.strided or value.is_quantized:
        problem = f"is a {'quantized' if value.is_quantized else str(value.layout)} tensor"
    else:
        try:
            legacy_storage_type(value.dtype)
        except KeyError:
            problem = f"has dtype {value.dtype}, which torch.save cannot write"
    if problem is not None:
        raise TypeError(f"The checkpoint entry {where} {problem}; a full checkpoint holds dense tensors of the"
                        " dtypes torch.save writes. HINT: convert it before saving, e.g. `tensor.to_dense()` or"
                        " `tensor.dequantize()`.")


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
