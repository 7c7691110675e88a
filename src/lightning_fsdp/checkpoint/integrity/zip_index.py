"""The places of the tensors in a ``torch.save`` file, read from its index (``data.pkl``) without running any code
from it: which tensor each data record holds, so that a checksum mismatch names the tensor (``model.fc.weight``),
not only the record. Every global in the index becomes a stand-in, so nothing the file names is imported or called.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

from lightning_fsdp._base.compat import TORCH_SAVE_REBUILD_TENSOR
from lightning_fsdp.checkpoint.integrity.tree import map_leaves

__all__ = ["tensor_record_paths", "tensor_record_names"]


class _Opaque:
    """Stands for any object of a ``torch.save`` index while only the places of its tensors are wanted: it takes
    any arguments and any state, and does nothing with them. Its methods are static, so that an opcode applied to
    the class itself (``GLOBAL x y; state; BUILD``) does nothing either, instead of reaching ``setattr``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    @staticmethod
    def __setstate__(*args: Any) -> None:
        pass

    def __call__(self, *args: Any, **kwargs: Any) -> "_Opaque":
        return _Opaque()

    @staticmethod
    def __setitem__(*args: Any) -> None:
        pass

    @staticmethod
    def append(*args: Any) -> None:
        pass

    @staticmethod
    def extend(*args: Any) -> None:
        pass


class _Record:
    def __init__(self, key: str) -> None:
        self.key = key


class _IndexReader(pickle.Unpickler):
    """Unpickles a ``torch.save`` index (``data.pkl``) into its containers, with each tensor replaced by the key of
    its data record. Every global becomes :class:`_Opaque`, so nothing named in the file is imported or called."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in TORCH_SAVE_REBUILD_TENSOR:
            return lambda storage, *args, **kwargs: storage
        if (module, name) == ("collections", "OrderedDict"):
            return dict
        return _Opaque

    def persistent_load(self, pid: Any) -> Any:
        return _Record(str(pid[2])) if isinstance(pid, tuple) and len(pid) > 2 else _Opaque()


def tensor_record_paths(index: bytes, *, what: str = "the checkpoint's index") -> dict[str, tuple]:
    """Map each data record key of a ``torch.save`` file to the path of its tensor in the loaded object (keys and
    indices, e.g. ``("model", "fc.weight")``), given the bytes of its ``data.pkl``. Runs no code from the file.

    The walk visits each shared container once (:mod:`~lightning_fsdp.checkpoint.integrity.tree`), so a tiny file that nests one list in the next
    twice over does not take forever; data nested too deep or too large raises ``TreeLimitError``."""
    paths: dict[str, tuple] = {}

    def record(value: Any, path: tuple) -> None:
        if isinstance(value, _Record):
            paths.setdefault(value.key, path)

    try:
        loaded = _IndexReader(io.BytesIO(index)).load()
    except Exception:  # noqa: BLE001 - a damaged index: the caller names the record key instead
        return paths
    map_leaves(loaded, record, what=what)
    return paths


def tensor_record_names(index: bytes) -> dict[str, str]:
    """Like :func:`tensor_record_paths`, with each path as a dotted name (``model.fc.weight``), for messages."""
    return {key: ".".join(map(str, path)) for key, path in tensor_record_paths(index).items()}
