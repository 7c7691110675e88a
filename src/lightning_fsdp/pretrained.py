"""``load_pretrained``: Hugging Face safetensors weights into a sharded model, from Fabric or the Trainer.

Fabric users can also call ``fabric.load_raw(path, model)``, which takes the same files. In the Trainer the model
is sharded after ``configure_model`` returns, so the weights are loaded in ``on_fit_start``; a resume from
``ckpt_path`` is restored after that hook, so it still wins over the pretrained weights::

    class FineTune(L.LightningModule):
        def configure_model(self):
            self.model = LlamaForCausalLM(config)  # on the meta device under the strategy: no memory yet

        def on_fit_start(self):
            lightning_fsdp.load_pretrained(self.model, "path/to/llama")  # each rank reads its own shards
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, TypeVar, Union

import torch.distributed as dist
from torch.nn import Module

from lightning_fsdp.checkpoint.hf import LoadReport, is_hf_checkpoint, load_pretrained_weights
from lightning_fsdp.checkpoint.io.urls import check_storage_options

__all__ = ["load_pretrained", "LoadReport"]

T = TypeVar("T")


def load_pretrained(module: Module, path: Union[str, Path], *, strict: bool = True,
                    storage_options: Optional[dict[str, Any]] = None) -> LoadReport:
    """Load Hugging Face safetensors weights into ``module`` (sharded or not) on every rank, in place.

    Args:
        module: the model whose state-dict names match the files, e.g. the ``LlamaForCausalLM`` itself, not the
            LightningModule that holds it as ``self.model`` (whose names start with ``model.``).
        path: a ``.safetensors`` file, or a directory (as ``save_pretrained`` writes it) with
            ``model.safetensors.index.json`` or ``model.safetensors``; either may be a URL (``s3://bucket/llama``,
            ``gs://``, ``az://``), read by byte ranges, each rank only the rows of its own shards.
        strict: raise (on every rank) when a weight of the model is not in the files or a tensor of the files is
            not in the model. With ``strict=False`` they are reported as a warning on rank 0 and the missing
            weights keep their initial values, as with ``from_pretrained``.
        storage_options: for a URL, keyword arguments of its fsspec filesystem (e.g. ``{"endpoint_url": ...}``);
            by default the endpoint and credentials come from the environment (for S3: ``AWS_ENDPOINT_URL``, ...).

    Every rank reads only the slices of its own shards, converting precision within a dtype's kind (a bf16 file
    into fp32 parameters). Tied weights (``lm_head`` sharing the embedding) load from whichever name the files hold.
    A load that cannot be exact raises on every rank before any weight is read, whatever ``strict`` says: a shape
    that differs, chunks of a sharded save that do not tile a weight exactly, a dtype of another kind (integers
    for a float weight), or an index entry that leads outside the directory.
    Call it on every rank, after the model is sharded. Returns the :class:`LoadReport` (missing and unexpected
    names), the same on every rank.
    """
    if not isinstance(module, Module):
        raise TypeError(
            f"`load_pretrained(module=...)` expects a torch.nn.Module, got {type(module).__name__}. HINT: pass the"
            " model the weights belong to, e.g. `load_pretrained(self.model, path)`."
        )
    storage_options = check_storage_options(storage_options)
    comm = _DefaultGroup()
    if not is_hf_checkpoint(path, storage_options, comm=comm):  # rank 0 asks the store; every rank gets the answer
        raise ValueError(
            f"`load_pretrained(path={str(path)!r})` is not Hugging Face safetensors weights. Allowed: a"
            " '.safetensors' file, or a directory with 'model.safetensors.index.json' or 'model.safetensors'."
            " HINT: pass the directory `save_pretrained` wrote; for a lightning-fsdp checkpoint use `fabric.load`"
            " or the Trainer's `ckpt_path`."
        )
    return load_pretrained_weights(path, module, strict=strict, comm=comm, storage_options=storage_options)


class _DefaultGroup:
    """The collectives a load needs, over torch.distributed's default group (or none, in one process). The
    Trainer's LightningModule hooks have no handle on the strategy's engine, but they do have the default group."""

    def __init__(self) -> None:
        self.distributed = dist.is_available() and dist.is_initialized()
        self.global_rank = dist.get_rank() if self.distributed else 0

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def broadcast(self, obj: T, src: int = 0) -> T:
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]

    def agree(self, error: Optional[Any]) -> Optional[tuple[int, Any]]:
        if not self.distributed:
            return None if error is None else (self.global_rank, error)
        errors: list[Optional[Any]] = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
        return next(((rank, e) for rank, e in enumerate(errors) if e is not None), None)
