"""Checkpoint files are read with an allow-list only.

Unpickling runs whatever callable a pickle names, so a crafted checkpoint file can run code on every rank that
loads it. This module is the one place that turns checkpoint bytes into objects, and it never unpickles freely
unless the user opted in (``weights_only=False``, CLI ``--allow-pickle``):

- DCP's ``.metadata`` (torch reads it with plain ``pickle.load``): :func:`load_dcp_metadata` and
  :class:`SafeFileSystemReader`, which every DCP read in this package goes through. The allow-list holds DCP's
  metadata classes, torch dtypes, sizes, layouts and memory formats, paths, and plain containers.
- ``torch.save`` files (full checkpoints, ``meta.pt``) and DCP's non-tensor entries: :func:`load_file` and
  :func:`load_bytes`, i.e. ``torch.load(weights_only=True)``, torch's own allow-list unpickler.
- :func:`tensor_record_paths` and :func:`tensor_record_names` read a ``torch.save`` index without constructing
  anything, to find tensors and name them in errors.

Whatever bytes these readers are handed, they return a well-formed object or raise a ``CheckpointError`` that names
the file (:func:`~lightning_fsdp.checkpoint.integrity.agreement.unreadable`): unknown opcodes, truncation, stack underflow, memo misses and the like
surface from the unpickler as any of a dozen exception types, and are turned into that one error here, at the
boundary, never at the call sites. A length field larger than the file reads no more than the file holds: the
``.metadata`` is read into memory first (it is small: 593 kB for 3,000 tensors), and an in-memory stream allocates
only what it returns.
"""

from __future__ import annotations

import enum
import gc
import io
import pickle
import struct
import threading
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.metadata as dcp_metadata

from lightning_fsdp._base.compat import DCPStorageInfo, get_layout, weights_only_hint
from lightning_fsdp.checkpoint.formats.torch_versions import explain_unreadable_metadata
from lightning_fsdp.checkpoint.integrity.agreement import CheckpointError, unreadable
from lightning_fsdp.checkpoint.integrity.zipfiles import verify_zip

__all__ = [
    "UnsafeCheckpointError",
    "load_dcp_metadata",
    "load_file",
    "load_bytes",
    "SafeFileSystemReader",
]

HINT = (f" HINT: if you trust this checkpoint, allow full unpickling explicitly: {weights_only_hint()} (command"
        " line: `--allow-pickle`).")


class UnsafeCheckpointError(CheckpointError, pickle.UnpicklingError):
    """A checkpoint file names an object that unpickling would have to construct or call, outside the allow-list.

    A kind of ``CheckpointError`` (a file that cannot be read as it is) and of ``UnpicklingError`` (what torch's own
    ``weights_only`` refusal raises)."""


def _allowed_globals() -> dict[tuple[str, str], Any]:
    """What a DCP ``.metadata`` may name. Every entry is either a class whose construction only stores data, or a
    function that only looks a name up (``_get_layout``); none can reach the file system or run code."""
    allowed: dict[tuple[str, str], Any] = {}
    for name in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                 "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING"):
        allowed[(dcp_metadata.__name__, name)] = getattr(dcp_metadata, name)
    allowed[(DCPStorageInfo.__module__, DCPStorageInfo.__name__)] = DCPStorageInfo
    for name, value in vars(torch).items():
        if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
            allowed[("torch", name)] = value
    allowed[("torch", "Size")] = torch.Size
    allowed[("torch.serialization", "_get_layout")] = get_layout
    import collections
    import pathlib

    allowed[("collections", "OrderedDict")] = collections.OrderedDict
    for name in ("PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath", "Path"):
        allowed[("pathlib", name)] = getattr(pathlib, name)
    for name in ("set", "frozenset", "slice", "complex"):
        allowed[("builtins", name)] = getattr(__import__("builtins"), name)
    return allowed


_ALLOWED = _allowed_globals()


class _AllowListUnpickler(pickle._Unpickler):
    """The allow-list unpickler of DCP's ``.metadata``.

    Naming only allowed globals is not enough: the opcodes that set state (BUILD, SETITEM(S), APPEND(S),
    ADDITEMS) apply to whatever is on top of the stack, and that may be an allowed *class* itself.
    ``GLOBAL pathlib.PosixPath; (None, {"__truediv__": ...}); BUILD`` would ``setattr`` on ``PosixPath`` for the
    whole process. So each of those opcodes checks that its target is an object this unpickler made (a container
    it built, an instance it constructed), never a class, a global or anything a global returned.

    This is Python's own unpickler (``pickle._Unpickler``), the one whose opcodes can be overridden. The C
    unpickler cannot keep these guarantees: it cannot be told which objects a BUILD may touch (its BUILD
    ``setattr``s a state's second half on whatever is on the stack, a class included), and its memo is an array
    sized by the largest index a PUT names: ``LONG_BINPUT 0x08000000`` in a 10-byte file makes it allocate and zero
    2 GiB, 0x7fffffff 32 GiB (here the memo is a dict, one entry per PUT).

    What makes the Python unpickler slow is mostly its reads, not the checks: every opcode and every argument went
    through ``_Unframer.read`` (frame bookkeeping, a length check, then the stream's ``read``), 2.4 million calls
    for a ``.metadata`` of 3,000 tensors x 8 ranks. The whole file is in memory here, so :meth:`load` reads
    straight from the in-memory stream and skips FRAME's length (frames only batch the writer's I/O; a frame
    length says nothing about the objects), and what it made is one dict (id -> object), not a set and a list.
    """

    dispatch = dict(pickle._Unpickler.dispatch)

    def __init__(self, file: io.BytesIO, what: str) -> None:
        super().__init__(file)
        self._file = file
        self._what = what
        # id -> object for everything this unpickler made; holding the object keeps its id from being reused.
        self._made: dict[int, Any] = {}

    def _mark(self, obj: Any) -> None:
        # Calling an Enum class (REDUCE, NEWOBJ, OBJ, INST: how pickle writes a member) returns its existing member,
        # a global: `_MEM_FORMAT_ENCODING(0)` then BUILD `{"_value_": 99}` would renumber it for the process.
        if not isinstance(obj, enum.Enum):
            self._made[id(obj)] = obj

    def load(self) -> Any:
        """Unpickle from the in-memory stream, reading it directly (see the class docstring): the same opcodes
        and checks as ``pickle._Unpickler.load``, without the unframer between each opcode and its bytes."""
        file = self._file
        self.read, self.readline, self.readinto = file.read, file.readline, file.readinto
        self.metastack, self.stack, self.proto = [], [], 0
        self.append = self.stack.append
        read, dispatch = file.read, self.dispatch
        try:
            while True:
                key = read(1)
                if not key:
                    raise pickle.UnpicklingError("the pickle ends before its STOP opcode. HINT: the file is cut short or damaged; load an earlier checkpoint.")
                dispatch[key[0]](self)
        except pickle._Stop as stop:
            return stop.value

    def _largest_put(self) -> int:
        """The largest memo index the bytes stored to (-1: none)."""
        return max(self.memo, default=-1)

    def _load_frame(self) -> None:
        if len(self.read(8)) != 8:
            raise pickle.UnpicklingError("the pickle ends inside a FRAME opcode's length. HINT: the file is cut short or damaged; load an earlier checkpoint.")

    dispatch[pickle.FRAME[0]] = _load_frame

    def _load_bytearray8(self) -> None:
        # pickle._Unpickler allocates (and zeroes) the length a BYTEARRAY8 names before reading: 2**40 from a
        # 20-byte file. Read what is there first, so that the file's size bounds it like every other length.
        (length,) = struct.unpack("<Q", self.read(8))
        data = self.read(length)
        if len(data) != length:
            raise pickle.UnpicklingError(f"a BYTEARRAY8 of {length} bytes, but only {len(data)} follow it."
                                          "HINT: the file is cut short or damaged; load an earlier checkpoint.")
        self.append(bytearray(data))

    dispatch[pickle.BYTEARRAY8[0]] = _load_bytearray8

    def _target(self, obj: Any, opcode: str) -> Any:
        if isinstance(obj, type) or id(obj) not in self._made:
            shown = getattr(obj, "__qualname__", None) or type(obj).__qualname__
            raise UnsafeCheckpointError(
                f"{self._what} applies state ({opcode}) to `{shown}`, which it did not construct: unpickling it would"
                " change that object (a class or a global) for the whole process, so it was refused and nothing"
                f" was changed.{HINT}"
            )
        return obj

    def find_class(self, module: str, name: str) -> Any:
        try:
            return _ALLOWED[(module, name)]
        except KeyError:
            raise UnsafeCheckpointError(
                f"{self._what} names `{module}.{name}`, which is not allowed in a checkpoint: unpickling it could run"
                f" arbitrary code, so nothing of it was run.{HINT}"
            ) from None

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeCheckpointError(f"{self._what} holds a persistent reference, which DCP metadata never has.{HINT}")

    # What this unpickler makes: containers, and instances of allowed classes. A call of an allowed function
    # (`_get_layout`) returns an existing global, so it does not count.
    def _made_by(load: Callable[[Any], None]) -> Callable[[Any], None]:  # type: ignore[misc]
        def made(self: "_AllowListUnpickler") -> None:
            load(self)
            obj = self.stack[-1]
            self._made[id(obj)] = obj
        return made

    def _constructed_by(load: Callable[[Any], None]) -> Callable[[Any], None]:  # type: ignore[misc]
        def constructed(self: "_AllowListUnpickler") -> None:
            load(self)
            self._mark(self.stack[-1])
        return constructed

    # A container opcode always makes a new object; a class called may hand back an existing one (see `_mark`).
    for _op in (pickle.EMPTY_DICT, pickle.DICT, pickle.EMPTY_LIST, pickle.LIST, pickle.EMPTY_SET):
        dispatch[_op[0]] = _made_by(pickle._Unpickler.dispatch[_op[0]])
    for _op in (pickle.NEWOBJ, pickle.NEWOBJ_EX, pickle.OBJ, pickle.INST):
        dispatch[_op[0]] = _constructed_by(pickle._Unpickler.dispatch[_op[0]])

    def _load_reduce(self) -> None:
        constructs = isinstance(self.stack[-2], type)
        pickle._Unpickler.load_reduce(self)
        if constructs:
            self._mark(self.stack[-1])

    dispatch[pickle.REDUCE[0]] = _load_reduce

    # The opcodes that change an object already on the stack: its top (BUILD, APPEND, SETITEM take one value
    # first; the others take everything down to the mark).
    def _checked(load: Callable[[Any], None], opcode: str, depth: int) -> Callable[[Any], None]:  # type: ignore[misc]
        def checked(self: "_AllowListUnpickler") -> None:
            if depth:
                self._target(self.stack[-1 - depth], opcode)
            else:
                self._target(self.metastack[-1][-1] if self.metastack and self.metastack[-1] else None, opcode)
            load(self)
        return checked

    for _op, _name, _depth in ((pickle.BUILD, "BUILD", 1), (pickle.APPEND, "APPEND", 1),
                               (pickle.SETITEM, "SETITEM", 2), (pickle.APPENDS, "APPENDS", 0),
                               (pickle.SETITEMS, "SETITEMS", 0), (pickle.ADDITEMS, "ADDITEMS", 0)):
        dispatch[_op[0]] = _checked(pickle._Unpickler.dispatch[_op[0]], _name, _depth)
    del _op, _name, _depth, _made_by, _constructed_by, _checked


def load_dcp_metadata(path: Union[str, Path], *, allow_pickle: bool = False, data: Optional[bytes] = None) -> Any:
    """Unpickle DCP's ``.metadata`` at ``path`` with the allow-list (plain pickle only with ``allow_pickle``).

    Returns a DCP ``Metadata`` whose tables have the types DCP's readers rely on; raises ``CheckpointError`` naming
    the file for any other bytes (see the module docstring). ``data``: the file's bytes, already read (an object
    streamed from a store: ``path`` is then its URL, for the messages only)."""
    unpickler, args = (pickle.Unpickler, ()) if allow_pickle else (_AllowListUnpickler, (repr(str(path)),))
    if data is None:
        data = Path(path).read_bytes()  # an OSError (missing, unreadable) stays one: it is not about the bytes
    try:
        metadata = _unpickle(data, unpickler, args)
    except CheckpointError:
        raise
    except Exception as err:  # noqa: BLE001 - any parse failure of these bytes: KeyError, struct.error, EOFError...
        # A newer torch's format fails inside torch's own classes ("too many values to unpack"): name the torch that
        # wrote the file and the one needed, instead (raises if that is the cause).
        explain_unreadable_metadata(Path(path), data, unpickler, *args)
        raise unreadable(path, err) from err
    problem = _metadata_problem(metadata)
    if problem:
        raise unreadable(path, TypeError(problem))
    return metadata


class _CheckedBytesUnpickler(pickle.Unpickler):
    """The C unpickler, for bytes that :class:`_AllowListUnpickler` has read in full in this process (see
    :func:`_unpickle`); it keeps the allow-list and the refusal of persistent references all the same."""

    find_class = _AllowListUnpickler.find_class
    persistent_load = _AllowListUnpickler.persistent_load

    def __init__(self, file: io.BytesIO, what: str) -> None:
        super().__init__(file)
        self._what = what


# The `.metadata` bytes this process has read with the allow-list (exact bytes, compared in full on a hit), newest
# last. One load reads the same `.metadata` three to five times (the shared small objects, the shard-file check,
# DCP's reader, the manifest's save id); after the first, the C unpickler reads it, 10 to 20 times faster.
_CHECKED: dict[bytes, None] = {}
_CHECKED_LOCK = threading.Lock()
_CHECKED_MAX = 4  # a few checkpoints at once (a load, a verify of another); each entry is one `.metadata`


def _unpickle(data: bytes, unpickler: type, args: tuple) -> Any:
    """Unpickle ``data`` with ``unpickler``; with the allow-list, bytes already read in full with it in this process
    go through the C unpickler instead.

    That is as safe: unpickling is deterministic, so the C unpickler does to the same bytes what the Python one did
    (the same opcodes on the same kinds of objects, in the same order), and the Python pass showed that none of it
    names a global outside the list or changes an object it did not make. The one cost the two spend differently is
    the memo (the C one sizes an array by the largest index): bytes whose largest index is beyond what their own
    entries need are never cached. Cyclic GC is paused during the parse: the unpickler makes ~100,000s of objects
    and nothing cyclic, and each full collection it would trigger walks all of them (a quarter of the time on a
    3.6 MB `.metadata`)."""
    data = bytes(data)  # a bytearray or memoryview: the cache's key must not change (no copy for bytes)
    paused = gc.isenabled()
    gc.disable()
    try:
        if unpickler is not _AllowListUnpickler:
            return unpickler(io.BytesIO(data), *args).load()
        if data in _CHECKED:
            return _CheckedBytesUnpickler(io.BytesIO(data), *args).load()
        reader = _AllowListUnpickler(io.BytesIO(data), *args)
        loaded = reader.load()
        if reader._largest_put() < 2 * len(reader.memo) + 16:
            with _CHECKED_LOCK:  # loads and verifications may run on several threads at once
                _CHECKED[data] = None
                while len(_CHECKED) > _CHECKED_MAX:
                    del _CHECKED[next(iter(_CHECKED))]
        return loaded
    finally:
        if paused:
            gc.enable()


def _metadata_problem(metadata: Any) -> str:
    """What in an unpickled ``.metadata`` is not of the type DCP wrote (and its readers index), or ''."""
    if not isinstance(metadata, dcp_metadata.Metadata):
        return f"it holds a {type(metadata).__name__}, not DCP's Metadata"
    if not isinstance(getattr(metadata, "state_dict_metadata", None), dict):
        return "its state_dict_metadata is not a dict"
    for name, entry in metadata.state_dict_metadata.items():
        if not isinstance(name, str):
            return f"it names an entry {name!r}, not a string"
        if isinstance(entry, dcp_metadata.TensorStorageMetadata):
            # A BUILD whose state lost a field leaves the instance without that attribute: getattr, not `.`.
            properties, size, chunks = (getattr(entry, field, None) for field in ("properties", "size", "chunks"))
            if not (isinstance(properties, dcp_metadata.TensorProperties)
                    and isinstance(getattr(properties, "dtype", None), torch.dtype)
                    and _sizes(size) and isinstance(chunks, list)
                    and all(isinstance(c, dcp_metadata.ChunkStorageMetadata) and _sizes(getattr(c, "offsets", None))
                            and _sizes(getattr(c, "sizes", None)) and len(c.offsets) == len(c.sizes) == len(size)
                            for c in chunks)):
                return f"the tensor entry {name!r} is malformed"
        elif not isinstance(entry, dcp_metadata.BytesStorageMetadata):
            return f"the entry {name!r} is a {type(entry).__name__}"
    storage = getattr(metadata, "storage_data", None)
    if storage is not None:
        if not isinstance(storage, dict):
            return "its storage_data is not a dict"
        for index, info in storage.items():
            if not (isinstance(index, dcp_metadata.MetadataIndex) and isinstance(getattr(index, "fqn", None), str)
                    and isinstance(info, DCPStorageInfo) and isinstance(getattr(info, "relative_path", None), str)
                    and _count(getattr(info, "offset", None)) and _count(getattr(info, "length", None))):
                return f"the storage record {index!r} is malformed"
    if getattr(metadata, "storage_meta", None) is not None and not isinstance(metadata.storage_meta,
                                                                                dcp_metadata.StorageMeta):
        return "its storage_meta is not DCP's StorageMeta"
    return ""


def _count(value: Any) -> bool:
    return type(value) is int and 0 <= value < 2**63


def _sizes(value: Any) -> bool:
    return isinstance(value, (torch.Size, tuple, list)) and all(_count(v) for v in value)


class SafeFileSystemReader(dcp.FileSystemReader):
    """DCP's file reader, except that ``.metadata`` is unpickled with the allow-list.

    Tensors are read by DCP with ``weights_only=True`` already; non-tensor entries go through the load planner,
    which this package's planners check with :func:`load_bytes`.
    """

    def __init__(self, path: Union[str, Path], *, allow_pickle: bool = False) -> None:
        super().__init__(path)
        self.allow_pickle = allow_pickle

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        rank = kwargs.get("rank")
        name = ".metadata" if rank is None else f"__{rank}.metadata"
        metadata = load_dcp_metadata(Path(self.path) / name, allow_pickle=self.allow_pickle)
        # What torch's reader does after unpickling: stamp this load's id (older files have no storage_meta).
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def load_file(path: Union[str, Path], *, allow_pickle: bool = False, mmap: bool = True) -> Any:
    """``torch.load`` a checkpoint file: torch's allow-list (``weights_only=True``) unless ``allow_pickle``.

    Raises ``CheckpointError`` naming the file for bytes that do not parse (``ChecksumError`` where the archive's
    own checksums show the damage); torch's ``weights_only`` refusal stays an ``UnpicklingError``, which the
    callers turn into the hint to allow unpickling."""
    try:
        return torch.load(path, map_location="cpu", mmap=mmap, weights_only=not allow_pickle)
    except (OSError, CheckpointError):
        raise
    except Exception as err:  # noqa: BLE001 - any parse failure of these bytes
        if Path(path).is_dir():  # torch's message for a directory; not about bytes
            raise
        _raise_if_damaged(Path(path), err)
        if isinstance(err, pickle.UnpicklingError) and not allow_pickle:
            raise  # a refusal of the allow-list, in bytes that are as saved
        raise unreadable(path, err) from err


def _raise_if_damaged(path: Path, err: BaseException) -> None:
    """After ``torch.load`` failed on ``path``: raise ``ChecksumError`` if its zip records do not match their
    checksums, ``CheckpointError`` if it is not even a zip archive; return when its bytes are as saved."""
    try:
        verify_zip(path)
    except CheckpointError:
        raise
    except Exception as damage:  # noqa: BLE001 - no readable zip archive at all
        raise unreadable(path, err) from damage


def load_bytes(payload: bytes, *, allow_pickle: bool = False) -> Any:
    """``torch.load`` one serialized entry (a DCP non-tensor entry) under the same rule as :func:`load_file`."""
    return torch.load(io.BytesIO(payload), map_location="cpu", weights_only=not allow_pickle)
