"""A sharded checkpoint written in this process by the streaming writer of object storage
(:class:`~lightning_fsdp.checkpoint.integrity.streaming_write.StreamingWriter`) into a local folder, one file per
object: what the in-process tests of ranged reads and streamed loads read back."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Optional

import torch.distributed.checkpoint as dcp


def streaming_writer(folder: Path) -> Any:
    """The writer a save to a bucket uses, its objects made as files in ``folder``."""
    from lightning_fsdp.checkpoint.integrity.digests import new_save_id
    from lightning_fsdp.checkpoint.integrity.streaming_write import StreamingWriter

    return StreamingWriter(folder, save_id=new_save_id(),
                           open_object=lambda name, size_hint=None: open(folder / name, "wb"))


def save_streamed(folder: Path, state: dict, planner: Optional[Any] = None) -> None:
    """``state`` saved into the new folder ``folder`` by :func:`streaming_writer`, as one process."""
    folder.mkdir(parents=True)
    with warnings.catch_warnings():  # DCP says it saves as one process: it does
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=streaming_writer(folder), planner=planner, no_dist=True)
