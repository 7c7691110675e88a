"""Full (unsharded) tensors into a set-up model: the invariant "a full tensor that reaches a sharded parameter is cut
to this rank's shard", and the two functions that keep it.

Why it needs enforcing: after setup every parameter is a DTensor shard, but a state dict written before sharding (a
pretrained file, ``model.state_dict()`` of an unsharded copy, litgpt's ``lit_model.pth``) holds plain tensors of the
full shape. ``nn.Module._load_from_state_dict`` checks the shape (a DTensor reports the global one, so it passes) and
then runs ``param.copy_(full)``, which DTensor refuses ("mixed torch.Tensor and DTensor").

- :func:`accept_full_tensors` (called at setup) gives every module that holds a DTensor parameter or buffer a
  load-state-dict pre-hook. torch runs a module's pre-hooks inside ``Module._load_from_state_dict``, so *after* a
  subclass's own ``_load_from_state_dict`` override has renamed or reshaped its keys (litgpt's LoRA layers move
  ``weight`` to ``linear.weight`` and then call ``super()``), and right before the copy: exactly where the key a
  value finally lands on is known. The hook replaces a plain tensor of the parameter's full shape by a DTensor
  holding this rank's shard of it: a view for the in-place copy, a contiguous copy of the shard only for
  ``assign=True``. Every route through ``load_state_dict`` (``strict`` either way, ``assign``, Lightning's
  ``LightningModule.load_state_dict``) takes it, and torch still reports missing and unexpected keys itself.
- :func:`load_full_from_rank0` is the full-checkpoint reader's side (``fabric.load_raw``, ``fabric.load`` of a full
  file): rank 0 holds the file memory-mapped and broadcasts it one tensor at a time, each rank hands that one entry
  to ``module.load_state_dict`` (so the module's own hooks see the file's keys) and drops it. torch's
  ``set_model_state_dict(broadcast_from_rank0=True)`` cannot do this: it broadcasts by the *model's* keys, so an entry
  that a hook renames never reaches the other ranks.

Memory: a rank holds at most the full tensor it is given plus its own shard; nothing here gathers or clones a whole
tensor.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from lightning_fsdp._base.compat import IncompatibleKeys, dtensor_around

__all__ = ["accept_full_tensors", "local_shard", "load_full_from_rank0", "has_own_load_hooks"]

_HOOKED = "_lightning_fsdp_accepts_full_tensors"


def accept_full_tensors(model: nn.Module) -> None:
    """Let every module of ``model`` that holds a DTensor parameter or buffer load full tensors (idempotent)."""

    def visit(module: nn.Module, unit: Optional[FSDPModule]) -> None:
        unit = module if isinstance(module, FSDPModule) else unit
        holds_dtensors = any(isinstance(t, DTensor) for t in [*module._parameters.values(), *module._buffers.values()])
        if holds_dtensors and not getattr(module, _HOOKED, False):
            module.register_load_state_dict_pre_hook(_ShardFullTensors(unit))
            setattr(module, _HOOKED, True)
        for child in module.children():
            visit(child, unit)

    visit(model, None)


class _ShardFullTensors:
    """The pre-hook. ``unit`` is the FSDP unit that manages the module's parameters: it is resharded first, because
    after a forward that no backward followed its parameters are the gathered plain tensors, and a copy into those
    is lost at the next reshard (FSDP2 registers a hook that does the same, but only at its lazy init, i.e. the first
    forward, so a load right after setup would run this hook first)."""

    def __init__(self, unit: Optional[FSDPModule]) -> None:
        self.unit = unit

    def __call__(self, module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: dict[str, Any],
                 *args: Any) -> None:
        if self.unit is not None and any(not isinstance(p, DTensor) for p in module._parameters.values() if p is not None):
            self.unit.reshard()
        assign = bool(local_metadata.get("assign_to_params_buffers", False))
        for name, current in [*module._parameters.items(), *module._buffers.items()]:
            key = prefix + name
            if not isinstance(current, DTensor) or key not in state_dict:
                continue
            value = state_dict[key]
            # Anything else (a DTensor from a sharded state dict, a tensor of the wrong shape, a non-tensor) is left
            # to torch, which loads it or reports it exactly as it would without sharding.
            if isinstance(value, Tensor) and not isinstance(value, DTensor) and value.shape == current.shape:
                state_dict[key] = local_shard(value, current, own_storage=assign)


def local_shard(full: Tensor, like: DTensor, *, own_storage: bool = False) -> DTensor:
    """This rank's piece of ``full`` as a DTensor with ``like``'s mesh and placements.

    Any list of placements that has one full value works: ``Shard``, ``Replicate`` and ``_StridedShard`` (FSDP over a
    tensor-parallel column split) on any number of mesh axes. The piece is the box that DTensor itself reports for
    this rank's shard (``like.__create_chunk_list__()``: its offsets and sizes in the full tensor, the ones DCP
    writes and reads by), cut from ``full`` with ``narrow``: uneven sizes leave the last ranks a smaller or empty
    piece, as FSDP2 and DTensor lay them out. ``Partial`` has no single full value and is refused. The result is a
    view of ``full`` unless ``own_storage`` (for ``assign=True``, where a view would keep the whole ``full`` alive as
    long as the parameter) or a move to ``like``'s device makes a copy of the shard alone.
    """
    if any(placement.is_partial() for placement in like.placements):
        raise NotImplementedError(
            f"Cannot load a full tensor into a DTensor with placements {like.placements}: a Partial placement holds"
            " summands, not a piece of one full value. HINT: load a state dict of DTensors (a sharded checkpoint)."
        )
    (chunk,) = like.__create_chunk_list__()
    piece = full.detach()
    for dim, (offset, size) in enumerate(zip(chunk.offsets, chunk.sizes)):
        if offset or size != piece.shape[dim]:
            piece = piece.narrow(dim, offset, size)
    local = like.to_local()
    if piece.shape != local.shape:  # pragma: no cover - DTensor's own box for its own shard; a mismatch is a bug
        raise RuntimeError(
            f"internal error: the shard cut from a full tensor of shape {tuple(full.shape)} has shape"
            f" {tuple(piece.shape)}, but this rank's shard has shape {tuple(local.shape)} (placements {like.placements})."
        )
    moved = piece.to(device=local.device)
    if own_storage and moved is piece:
        moved = piece.clone(memory_format=torch.contiguous_format)
    # Beside `like`'s own shard (on the host under CPU offload): `DTensor.from_local` would move it to the mesh's device.
    return dtensor_around(moved, like)


def load_full_from_rank0(module: nn.Module, full: Optional[Mapping[str, Tensor]], *, strict: bool) -> IncompatibleKeys:
    """Load a full state dict that only rank 0 holds (``full``; ``None`` on the other ranks) into ``module``, one
    entry at a time, on every rank.

    Each entry goes through ``module.load_state_dict`` on its own, so the module's hooks see the file's own keys;
    missing keys are those that no entry filled, unexpected ones those that some entry brought unclaimed, as torch
    would report them for the whole dict at once. Rank 0 takes each tensor with ``full[key]`` right before sending
    it (a checksum-verifying mapping hashes it there). A hook that needs several entries together (fusing separate
    q, k, v weights into one) sees them one at a time here; such a model loads with ``model.load_state_dict(full)``.
    """
    if not (dist.is_available() and dist.is_initialized()):
        # Each value through `full[key]` (`dict(full)` would copy a dict subclass's values without it): a reader that
        # checks or fetches a tensor as it is taken sees every one.
        return module.load_state_dict({key: full[key] for key in (full or {})}, strict=strict)
    rank = dist.get_rank()
    # `.items()` of a dict subclass does not go through `__getitem__`: describing an entry reads none of its data.
    described = [(k, tuple(v.shape), v.dtype) for k, v in full.items() if isinstance(v, Tensor)] if full else []
    box = [described if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    plan: list[tuple[str, tuple[int, ...], torch.dtype]] = box[0]  # type: ignore[assignment]
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    # Full checkpoints hold clean names; a `torch.compile`d submodule keeps its parameters under `_orig_mod.`.
    # (Activation-checkpoint wrappers need nothing here: their own load hook puts their prefix back.)
    model_key = {_clean(k): k for k in module.state_dict() if _clean(k) != k}
    missing: Optional[list[str]] = None
    unexpected: list[str] = []
    # The other ranks receive every entry into one buffer the size of the largest: a fresh tensor per entry left
    # the host allocator's heap growing with the number of entries (freed blocks split by small allocations in
    # between), to 0.3x the model's size at 16 layers. Nothing keeps an entry past its `load_state_dict`: the
    # pre-hook copies a view of it into the shard, and torch copies plain parameters and buffers.
    sizes = [_nbytes(shape, dtype) for _, shape, dtype in plan]
    buffer = torch.empty(max(sizes, default=0), dtype=torch.uint8, device=device) if rank != 0 else None
    for (key, shape, dtype), nbytes in zip(plan, sizes):
        if buffer is None:
            assert full is not None
            tensor = full[key].detach().to(device).contiguous()
        else:
            tensor = buffer[:nbytes].view(dtype).view(shape)
        dist.broadcast(tensor, src=0)
        result = module.load_state_dict({model_key.get(key, key): tensor}, strict=False)
        del tensor
        still_missing = set(result.missing_keys)
        missing = result.missing_keys if missing is None else [k for k in missing if k in still_missing]
        unexpected += [k for k in result.unexpected_keys if k not in unexpected]
    if missing is None:  # an empty state dict: nothing was loaded, so everything is missing
        missing = module.load_state_dict({}, strict=False).missing_keys
    if strict and (missing or unexpected):
        raise RuntimeError(
            f"Error(s) in loading state_dict for {type(module).__name__}: missing keys {missing}, unexpected keys"
            f" {unexpected}. HINT: pass `strict=False` to load the entries that match and skip the rest."
        )
    return IncompatibleKeys(missing, unexpected)


def has_own_load_hooks(model: nn.Module) -> bool:
    """Whether some module of ``model`` changes what its state dict's keys or shapes mean while it loads: a class
    that overrides ``_load_from_state_dict`` (litgpt's LoRA layers), or a load pre-hook that neither torch nor this
    package registered. For such a model only the load itself can tell which entries fit, so a checkpoint's names and
    shapes cannot be compared with ``model.state_dict()``'s beforehand."""
    for module in model.modules():
        if not _known(type(module)._load_from_state_dict):
            return True
        if not all(_known(getattr(hook, "hook", hook)) for hook in module._load_state_dict_pre_hooks.values()):
            return True  # (torch wraps a hook registered with its module; `.hook` is the function)
    return False


# Code from these packages loads entries under the names and shapes `state_dict()` gives them (torchmetrics'
# `Metric` overrides `_load_from_state_dict` only to restore its states; activation-checkpoint wrappers and FSDP
# register pre-hooks that keep names as they are).
_KNOWN_ORIGINS = ("torch.", "torchmetrics.", "lightning.", "lightning_fsdp.")


def _known(fn: Any) -> bool:
    origin = getattr(fn, "__module__", None) or type(fn).__module__
    return origin.startswith(_KNOWN_ORIGINS)


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def _clean(key: str) -> str:
    return ".".join(part for part in key.split(".") if part != "_orig_mod")
