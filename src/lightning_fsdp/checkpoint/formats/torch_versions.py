"""Which torch wrote a sharded checkpoint, and a clear error when the installed torch is too old to read it.

torch does not record its own version in a DCP checkpoint: ``.metadata`` carries DCP's format version, which is
"1.0.0" in torch 2.13, 2.14 and 2.15 alike, and ``meta.pt`` is a plain ``torch.save`` archive. What does change
between releases is the pickled state of DCP's metadata classes. torch 2.15 added ``strides`` to
``TensorProperties``, so a 2.15 ``.metadata`` holds 6-field states where torch 2.13 and 2.14 unpack exactly 5 and
fail with a bare "too many values to unpack". So:

- a sharded save of this package records ``torch.__version__`` in its checksum manifest (``checksums.json``, see
  :mod:`~lightning_fsdp.checkpoint.integrity`), which later readers use to name the writer exactly;
- when unpickling a ``.metadata`` fails, :func:`explain_unreadable_metadata` unpickles it once more, only to read
  the shape of each ``TensorProperties`` state, and turns a state newer than the installed torch's into
  :class:`NewerTorchFormatError`, which names the torch that wrote the file and the torch needed to read it.
"""

from __future__ import annotations

import io
import json
import pickle
from pathlib import Path
from typing import Any, Optional

import torch
from torch.distributed.checkpoint.metadata import TensorProperties

from lightning_fsdp.checkpoint.formats.layout import CHECKSUMS_FILENAME

__all__ = ["NewerTorchFormatError", "MANIFEST_KEY", "recorded_torch_version", "explain_unreadable_metadata"]

MANIFEST_KEY = "torch"
"""The key of ``checksums.json`` that holds the version of the torch that wrote the checkpoint."""

# Length of the pickled `TensorProperties` state -> the first torch release that writes it. A release that adds a
# field again adds a row here.
_TENSOR_PROPERTIES_STATE = {5: "2.13", 6: "2.15"}
_READABLE_STATE = len(TensorProperties(dtype=torch.float32).__getstate__())


class NewerTorchFormatError(ValueError):
    """A checkpoint written by a torch release newer than the installed one, in a format this torch cannot read."""


def recorded_torch_version(path: Path) -> Optional[str]:
    """The torch version that this package recorded when it saved the sharded checkpoint at ``path``; None for a
    checkpoint saved without a manifest (by DCP directly, by Lightning, or before the version was recorded)."""
    try:
        manifest = json.loads((path / CHECKSUMS_FILENAME).read_text())
    except (OSError, ValueError):
        return None
    version = manifest.get(MANIFEST_KEY) if isinstance(manifest, dict) else None
    return version if isinstance(version, str) else None


def explain_unreadable_metadata(path: Path, data: bytes, unpickler: type[pickle.Unpickler], *args: Any) -> None:
    """After unpickling the ``.metadata`` at ``path`` failed: raise :class:`NewerTorchFormatError` if it holds
    ``TensorProperties`` states newer than this torch reads; return (and let the caller re-raise) otherwise.

    ``unpickler(file, *args)`` is the unpickler that failed on ``data``, the file's bytes (with its allow-list, if
    any), so this second pass imports nothing the first would not have; only ``TensorProperties`` is swapped for a
    recorder of state lengths."""
    lengths: set[int] = set()

    class _Recorder:  # stands in for TensorProperties: keeps the state's length, builds nothing
        def __setstate__(self, state: Any) -> None:
            lengths.add(len(state) if isinstance(state, tuple) else -1)

    class _Probe(unpickler):  # type: ignore[misc, valid-type]
        def find_class(self, module: str, name: str) -> Any:
            if (module, name) == (TensorProperties.__module__, TensorProperties.__name__):
                return _Recorder
            return super().find_class(module, name)

    try:
        _Probe(io.BytesIO(data), *args).load()
    except Exception:
        pass  # other classes may fail on newer states too; the lengths seen so far decide
    newest = max(lengths, default=0)
    if newest <= _READABLE_STATE:
        return
    checkpoint = path.parent
    recorded = recorded_torch_version(checkpoint)
    first = _TENSOR_PROPERTIES_STATE.get(newest)
    if recorded is not None:
        writer = f"torch {recorded}"
    elif first is not None:
        writer = f"torch {first} or newer (its tensor metadata has {newest} fields, which torch {first} introduced)"
    else:
        writer = f"a torch release newer than {torch.__version__} (its tensor metadata has {newest} fields)"
    needed = f"torch>={first}" if first is not None else f"a torch newer than {torch.__version__}"
    raise NewerTorchFormatError(
        f"The sharded checkpoint {str(checkpoint)!r} was written by {writer}, and torch {torch.__version__}, installed"
        f" here, cannot read its format. HINT: load it with {needed} (e.g. `pip install \"{needed}\"`); or, where such"
        f" a torch is installed, convert it to a full checkpoint, which any torch reads:"
        f" `lightning-fsdp convert {str(checkpoint)!r} full.pt --to full`."
    )
