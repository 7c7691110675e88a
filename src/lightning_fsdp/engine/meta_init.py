"""Empty initialization: build a model without allocating its parameters, then give every rank's shards the values
the model's own construction would have given them.

Two halves, one owner:

* :func:`empty_init_context` is what ``init_module(empty_init=True)`` enters on both fronts. Only **parameters** go to
  the meta device; buffers are built for real.
* :func:`materialize` runs in setup, after ``fully_shard``: it allocates each meta tensor as a local shard, runs the
  model's own initializers on the shards, and refuses (on every rank) to hand back a tensor nobody wrote.

Which initializer runs (``param_init_fn``, see :func:`initialize`):

* ``None`` (default): what construction runs. torch's per-module ``reset_parameters()`` (``_reset_parameters()`` for
  ``nn.MultiheadAttention``), children before parents as in ``__init__``; then, for modules inside a Hugging Face
  ``PreTrainedModel``, that model's ``_init_weights(module)``, which is what ``post_init()`` applies after
  construction. litgpt's ``GPT`` and user modules need nothing else: their construction is the first pass.
* a callable ``fn(module)``: called instead, once per module that owns meta tensors.
* ``"skip"``: allocate only. For callers that load every weight right after setup (a pretrained loader).
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Callable, Optional, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.nn.modules.module import register_module_parameter_registration_hook

from lightning_fsdp._base.compat import compute_local_shape_and_global_offset

__all__ = ["SKIP", "ParamInitFn", "empty_init_context", "materialize", "has_meta_tensors"]

SKIP = "skip"
_Watched = list[tuple[str, nn.Module, str, bool]]  # (module path, module, attribute, is_parameter)
ParamInitFn = Union[None, str, Callable[[nn.Module], None]]


# --- construction ---------------------------------------------------------------------------------------------------


@contextmanager
def empty_init_context() -> Iterator[None]:
    """Parameters registered inside the block are moved to the meta device as they are registered; everything else,
    buffers included, is created as usual.

    Why buffers stay real: they are small (FSDP does not shard them anyway, so every rank holds them in full after
    setup whatever we do here), and many are *computed* in ``__init__`` with no initializer that could recompute them
    later: Hugging Face's rotary ``inv_freq``, litgpt's ``cos``/``sin``, a user's lookup table. On the meta device
    they would have no value, and after materialization only garbage. This is accelerate's
    ``init_empty_weights(include_buffers=False)``, done with torch's public registration hook.

    Cost: a parameter is created on the default device first and moved when it is registered, so each one is
    allocated briefly (``torch.empty`` of one tensor, untouched pages on CPU). ``nn.Linear`` and friends register
    their weight before ``reset_parameters()`` fills it, so their random init runs on meta and costs nothing.
    """
    handle = register_module_parameter_registration_hook(_parameter_to_meta)
    try:
        yield
    finally:
        handle.remove()


def _parameter_to_meta(module: nn.Module, name: str, param: Optional[nn.Parameter]) -> Optional[nn.Parameter]:
    if param is None or param.is_meta:
        return None
    try:
        meta = type(param)(param.detach().to("meta"), requires_grad=param.requires_grad)
    except TypeError:  # a parameter subclass with another constructor (quantized weights): left as it is
        return None
    meta.__dict__.update(param.__dict__)  # attributes libraries set on parameters (e.g. no-weight-decay flags)
    return meta


def has_meta_tensors(module: nn.Module) -> bool:
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))


# --- materialization ------------------------------------------------------------------------------------------------


def materialize(
    module: nn.Module,
    mesh: DeviceMesh,
    device: torch.device,
    *,
    params_on_cpu: bool,
    param_init_fn: ParamInitFn = None,
) -> None:
    """Allocate the meta tensors of the (already sharded) ``module`` and initialize them; see the module docstring.

    Sharding happened first, so only local shards are allocated: no rank ever holds the full model. Raises a
    ``RuntimeError`` on every rank if a floating-point tensor is left unwritten, or if a module owning other meta
    tensors has no initializer (unless ``param_init_fn="skip"``).
    """
    owners = [(name, m) for name, m in module.named_modules() if any(t.is_meta for t in _direct_tensors(m))]
    # Integer and bool tensors cannot carry the NaN sentinel: for them, an owner with no initializer is the error.
    non_float = {id(m) for _, m in owners
                 if any(t.is_meta and not (t.is_floating_point() or t.is_complex()) for t in _direct_tensors(m))}
    # The slots that were meta, named before allocation: real tensors of the same modules are not watched.
    fresh: _Watched = [(path, m, name, is_param) for path, m in owners
                       for slots, is_param in ((m._parameters, True), (m._buffers, False))
                       for name, t in slots.items() if t is not None and t.is_meta]
    with _per_shard_random_init(mesh, device):
        for _, owner in owners:
            _allocate(owner, device, params_on_cpu)
        if param_init_fn == SKIP:
            return
        watched = _fill_with_sentinel(fresh)
        with torch.no_grad():
            uncovered = [m for m in initialize(module, [m for _, m in owners], param_init_fn) if id(m) in non_float]
    _refuse_unwritten(watched, uncovered, param_init_fn, device)


def _allocate(owner: nn.Module, device: torch.device, params_on_cpu: bool) -> None:
    """``to_empty`` for the meta tensors of ``owner`` only: its real tensors (a buffer computed in ``__init__``, a
    parameter built outside the meta context) keep their values."""
    real_buffers = {n: b for n, b in owner._buffers.items() if b is not None and not b.is_meta}
    real_params = {n: p.detach().clone() for n, p in owner._parameters.items() if p is not None and not p.is_meta}
    owner.to_empty(device="cpu" if params_on_cpu else device, recurse=False)
    with torch.no_grad():
        for name, value in real_params.items():
            owner._parameters[name].copy_(value)
    for name, buf in list(owner._buffers.items()):
        buf = real_buffers.get(name, buf)
        # Buffers take part in compute, so they live on the device even when offloaded parameters stay on the host.
        owner._buffers[name] = buf.to(device) if buf is not None else None


def initialize(module: nn.Module, owners: list[nn.Module], param_init_fn: ParamInitFn = None) -> list[nn.Module]:
    """Run the initializers for ``owners`` (modules of ``module`` that own freshly allocated tensors) and return those
    that no initializer covers. Runs under ``no_grad`` by the caller."""
    if callable(param_init_fn):
        for owner in owners:
            param_init_fn(owner)
        return []
    # 1. torch's level: what each module's `__init__` ran, children first (a parent's `__init__` finishes after its
    #    children's): `nn.MultiheadAttention._reset_parameters` zeroes `out_proj.bias` after `out_proj`'s own reset.
    order = _children_first(module, owners)
    covered: set[int] = set()
    for owner in order:
        reset = getattr(owner, "reset_parameters", None) or getattr(owner, "_reset_parameters", None)
        if callable(reset):
            reset()
            covered.add(id(owner))
    # 2. Hugging Face's level: `post_init()` applies the nearest `PreTrainedModel`'s `_init_weights` to every module,
    #    children first (`initialize_weights`' smart_apply). Called per module rather than through
    #    `initialize_weights()`, because that one would also overwrite modules that were never on meta, and skips every
    #    module construction already flagged `_is_hf_initialized` (construction ran it on the meta tensors).
    hf_owner = _hf_owners(module)
    if hf_owner:
        _hf_pass(order, hf_owner, covered)
    _zero_padding_rows(order)
    return [m for m in owners if id(m) not in covered]


def _zero_padding_rows(owners: list[nn.Module]) -> None:
    """Redo ``weight[padding_idx] = 0`` of ``nn.Embedding`` on the shard that holds the row.

    Both torch's ``Embedding.reset_parameters`` and Hugging Face's ``_init_weights`` zero the padding row through
    indexing, and indexing a sharded DTensor returns a gathered copy, so the write never reaches the shard. (A model
    whose own initializer leaves the padding row random would get it zeroed here; neither library's does.)
    """
    for owner in owners:
        weight = owner.weight if isinstance(owner, nn.Embedding) and owner.padding_idx is not None else None
        if not isinstance(weight, DTensor):
            continue
        _, offset = compute_local_shape_and_global_offset(weight.shape, weight.device_mesh, weight.placements)
        local = weight.to_local()
        row = owner.padding_idx % weight.shape[0] - offset[0]
        if 0 <= row < local.shape[0]:
            local[row].zero_()


def _children_first(module: nn.Module, owners: list[nn.Module]) -> list[nn.Module]:
    wanted = {id(m) for m in owners}
    order: list[nn.Module] = []
    seen: set[int] = set()

    def visit(m: nn.Module) -> None:
        if id(m) in seen:
            return
        seen.add(id(m))
        for child in m.children():
            visit(child)
        if id(m) in wanted:
            order.append(m)

    visit(module)
    return order


def _hf_owners(module: nn.Module) -> dict[int, nn.Module]:
    """For each module, the nearest Hugging Face ``PreTrainedModel`` at or above it (composite models dispatch to
    their sub-models' own ``_init_weights``). Empty when transformers was never imported: then no model is one."""
    if "transformers" not in sys.modules:
        return {}
    from transformers import PreTrainedModel

    owners: dict[int, nn.Module] = {}

    def visit(m: nn.Module, nearest: Optional[nn.Module]) -> None:
        if isinstance(m, PreTrainedModel):
            nearest = m
        if nearest is not None:
            owners.setdefault(id(m), nearest)
        for child in m.children():
            visit(child, nearest)

    visit(module, None)
    return owners


def _hf_pass(order: list[nn.Module], hf_owner: dict[int, nn.Module], covered: set[int]) -> None:
    from transformers.initialization import guard_torch_init_functions

    pretrained_models = list({id(m): m for m in hf_owner.values()}.values())
    _check_ties(pretrained_models)
    # A tied target (`lm_head.weight`) is the same object as its source (`embed_tokens.weight`), and construction
    # gives it the source's value: `post_init` initializes before it ties, and the source's module (with its zeroed
    # padding row) was initialized by its own sub-model. So the target's module must not write it again. Transformers'
    # init functions skip a tensor flagged `_is_hf_initialized`, which is how `from_pretrained` protects tied weights.
    targets = {id(owner): name for pretrained in pretrained_models
               for target in (getattr(pretrained, "all_tied_weights_keys", None) or {})
               for owner, name in [_slot(pretrained, target)] if owner is not None}
    # The guard makes plain `torch.nn.init` calls (remote code) honour that flag too, as `initialize_weights` does.
    with guard_torch_init_functions():
        for owner in order:
            pretrained = hf_owner.get(id(owner))
            if pretrained is None:
                continue
            tied = owner._parameters.get(targets[id(owner)]) if id(owner) in targets else None
            if tied is not None:
                tied._is_hf_initialized = True
            try:
                pretrained._init_weights(owner)
            finally:
                if tied is not None:
                    del tied._is_hf_initialized
            covered.add(id(owner))


def _slot(root: nn.Module, dotted: str) -> tuple[Optional[nn.Module], str]:
    path, _, name = dotted.rpartition(".")
    try:
        return root.get_submodule(path), name
    except AttributeError:
        return None, name


def _check_ties(pretrained_models: list[nn.Module]) -> None:
    """Tied weights (``lm_head.weight`` is ``embed_tokens.weight``) are one parameter object, which sharding and
    allocation keep; a tie found broken here would mean two copies train apart, so it is an error, not a fix-up."""
    for pretrained in pretrained_models:
        for target, source in (getattr(pretrained, "all_tied_weights_keys", None) or {}).items():
            try:
                tied = pretrained.get_parameter(target) is pretrained.get_parameter(source)
            except AttributeError:
                continue
            if not tied:
                raise RuntimeError(
                    f"`{target}` and `{source}` of {type(pretrained).__name__} should be one tied parameter but are"
                    " two after sharding. HINT: call `model.tie_weights()` before `setup`, and report this with the"
                    " model's name."
                )


# --- the check ------------------------------------------------------------------------------------------------------


def _fill_with_sentinel(fresh: _Watched) -> _Watched:
    """NaN in every freshly allocated floating-point tensor: one still holding NaN after the initializers was written
    by none of them (or only in part). Checked on the local shard, so it costs one pass over this rank's memory."""
    watched: _Watched = []
    for path, owner, name, is_param in fresh:
        tensor = (owner._parameters if is_param else owner._buffers)[name]
        if tensor.is_floating_point() or tensor.is_complex():
            with torch.no_grad():
                _local(tensor).fill_(float("nan"))
            watched.append((path, owner, name, is_param))
    return watched


def _refuse_unwritten(watched: _Watched, uncovered: list[nn.Module], param_init_fn: ParamInitFn,
                      device: torch.device) -> None:
    # Looked up again by slot: an initializer may assign a new tensor (litgpt's rope cache) rather than fill in place.
    flags = torch.tensor(
        [bool(_local(slot[name]).isnan().any()) for _, owner, name, is_param in watched
         for slot in [owner._parameters if is_param else owner._buffers]] + [bool(uncovered)],
        dtype=torch.int32,
    )
    if dist.is_initialized() and dist.get_world_size() > 1:
        # One collective, so every rank raises together: a rank whose shard of a tensor is empty sees no NaN.
        comm = flags.to(device if dist.get_backend() == "nccl" else "cpu")
        dist.all_reduce(comm, op=dist.ReduceOp.MAX)
        flags = comm.cpu()
    unwritten = [f"{path + '.' if path else ''}{name} ({type(owner).__name__})"
                 for (path, owner, name, _), flag in zip(watched, flags.tolist()) if flag]
    others = sorted({type(m).__name__ for m in uncovered}) if flags[-1] else []
    if not unwritten and not others:
        return
    listed = unwritten[:8] + (["..."] if len(unwritten) > 8 else [])
    what = f"the tensors {', '.join(listed)} were written by no initializer" if listed else ""
    if others:
        what += ("; and " if what else "") + f"the modules {', '.join(others)} own non-float meta tensors and have no" \
                                            " `reset_parameters()`"
    how = "`param_init_fn`" if callable(param_init_fn) else "their modules' `reset_parameters()`"
    raise RuntimeError(
        f"After empty initialization ({how}), {what}, so they would hold uninitialized memory. HINT: give each such"
        " module a `reset_parameters()` that fills its own tensors in place, or pass `param_init_fn=fn` to the"
        " strategy (called as `fn(module)` on every module with meta tensors, after sharding); if you load every"
        " weight right after setup, say so with `param_init_fn='skip'`."
    )


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _direct_tensors(module: nn.Module) -> list[torch.Tensor]:
    return [t for t in (*module._parameters.values(), *module._buffers.values()) if t is not None]


@contextmanager
def _per_shard_random_init(mesh: DeviceMesh, device: torch.device) -> Iterator[None]:
    """Give each shard its own random stream while parameters are initialized on a CPU mesh.

    On CUDA, DTensor's random ops keep one seed across ranks and offset it per shard. On a CPU mesh they fall back to
    the plain generator, so every rank would fill its shard with the same numbers (rank 1's rows repeating rank 0's).
    Seeding by the coordinate along the shard axis keeps replicas (hybrid sharding, NO_SHARD) identical while shards
    differ. The global generator is restored afterwards, minus the one draw that picks the base seed.
    """
    if device.type != "cpu":
        yield
        return
    base = torch.randint(0, 2**31, (1,))
    if dist.is_initialized():
        dist.broadcast(base, src=0)  # ranks seeded differently must still agree on their replicas
    base = int(base.item())
    # The coordinate over every axis that splits tensors ("shard", and "tp" under tensor parallelism), so each
    # piece of a parameter gets its own stream; the "replicate" axis is left out, so replicas stay identical.
    # (Parameters that tensor parallelism replicates are made equal across "tp" afterwards, by the caller.)
    shard_coordinate = 0
    for axis, name in enumerate(mesh.mesh_dim_names or ()):
        if name != "replicate":
            shard_coordinate = shard_coordinate * mesh.size(axis) + mesh.get_local_rank(axis)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(base + shard_coordinate)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*DTensor random operators may not have complete support.*")
            yield
