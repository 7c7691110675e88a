"""The heal payload of one group rank, and its loader into a group rank of the same layout.

A payload is a plain tree the transport carries (tensors and JSON values only)::

    {"model": {"params": {name: local shard}, "buffers": {name: tensor}},
     "optimizers": [optimizer.state_dict(), ...], "schedulers": [scheduler.state_dict(), ...],
     "loop": ..., "strategy": ..., "manager": ...}

``loop``, ``strategy`` and ``manager`` are the caller's (the loop position, the strategy's state such as
:func:`rng_state`, torchft's manager state) and come back from :func:`load` as they went.

:func:`produce` runs at a window's start on the sender's main thread: it takes references to the parameters' local
shards (during forward FSDP2 swaps the module's parameters for unsharded ones, so they cannot be looked up later),
clones the buffers (forward may update them), and freezes every plain value, which raises at once, naming the path,
for a value the transport cannot carry. The payload is then read, not changed, by the transport in torchft's quorum
thread: nothing here runs a collective or an optimizer step (``get_optimizer_state_dict`` may do both).

:func:`layout_of` describes what a payload must match: every parameter (name, dtype, global and local shape,
placements, mesh shape, this rank's mesh coordinate), every persistent buffer, each optimizer's class and parameter
groups by name, each scheduler's class. Its digest travels in the header; the receiver refuses another before any
tensor byte moves, and :func:`load` checks the payload against the model once more before it changes anything.
"""

from __future__ import annotations

import json
import random
from typing import Any, Iterator, Optional, Sequence

import torch
import xxhash

from lightning_fsdp._base.compat import dtensor_around
from lightning_fsdp.engine.fault_tolerance.transport import LayoutMismatch, LocalShard, PayloadError, freeze

PAYLOAD_KEYS = ("model", "optimizers", "schedulers", "loop", "strategy", "manager")


def _is_dtensor(t: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if _is_dtensor(t) else t


def _tensor_layout(t: torch.Tensor) -> list:
    entry = [str(t.dtype).removeprefix("torch."), list(t.shape)]
    if _is_dtensor(t):
        mesh = t.device_mesh
        entry += [list(t.to_local().shape), [str(p) for p in t.placements], list(mesh.shape),
                  list(mesh.mesh_dim_names or ()), mesh.get_coordinate()]
    return entry


def persistent_buffers(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The buffers a state dict holds: non-persistent ones (rotary tables, masks) are rebuilt, never healed."""
    seen = set()
    for prefix, module in model.named_modules():
        for name, buffer in module.named_buffers(recurse=False):
            if buffer is None or name in module._non_persistent_buffers_set or id(buffer) in seen:
                continue
            seen.add(id(buffer))
            yield (f"{prefix}.{name}" if prefix else name), buffer


def _qualname(obj: Any) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def layout_of(model: torch.nn.Module, optimizers: Sequence[torch.optim.Optimizer] = (),
              schedulers: Sequence[Any] = ()) -> dict:
    """``{"digest": hex, "entries": [...]}`` of this rank's model, optimizers and schedulers (see the module doc).
    Take it with every FSDP unit at rest (sharded), as at a window's start."""
    names = {}
    entries: list[list] = []
    for name, param in model.named_parameters():
        names[id(param)] = name
        entries.append(["param", name, *_tensor_layout(param)])
    for name, buffer in persistent_buffers(model):
        entries.append(["buffer", name, *_tensor_layout(buffer)])
    for i, optimizer in enumerate(optimizers):
        groups = [[names.get(id(p), f"(not a parameter of the model: {tuple(p.shape)})") for p in group["params"]]
                  for group in optimizer.param_groups]
        entries.append(["optimizer", i, _qualname(optimizer), groups])
    for i, scheduler in enumerate(schedulers):
        entries.append(["scheduler", i, _qualname(scheduler)])
    text = json.dumps(entries, separators=(",", ":"))
    # Returned as it comes out of JSON (tuples as lists), so that it equals a received one when the layouts agree.
    return {"digest": xxhash.xxh3_64_hexdigest(text.encode()), "entries": json.loads(text)}


def produce(model: torch.nn.Module, optimizers: Sequence[torch.optim.Optimizer] = (), schedulers: Sequence[Any] = (),
            *, loop: Any = None, strategy: Any = None, manager: Any = None) -> dict:
    """The heal payload of this rank now (see the module doc); raises ``TypeError`` naming the first value the
    transport cannot carry."""
    params = {}
    for name, param in model.named_parameters():
        params[name] = _local(param).detach()
    buffers = {name: _local(buffer).detach().clone() for name, buffer in persistent_buffers(model)}
    payload = {"model": {"params": params, "buffers": buffers},
               "optimizers": [optimizer.state_dict() for optimizer in optimizers],
               "schedulers": [scheduler.state_dict() for scheduler in schedulers],
               "loop": loop, "strategy": strategy, "manager": manager}
    return freeze(payload, "payload")


def state_bytes(payload: Any) -> int:
    """The bytes of every tensor in a payload (each tensor object once): what a heal must move at least."""
    seen: dict[int, int] = {}

    def walk(obj: Any) -> None:
        if isinstance(obj, LocalShard):
            obj = obj.local
        if isinstance(obj, torch.Tensor):
            local = _local(obj)
            seen[id(obj)] = local.numel() * local.element_size()
        elif isinstance(obj, dict):
            for value in obj.values():
                walk(value)
        elif isinstance(obj, (list, tuple)):
            for value in obj:
                walk(value)

    walk(payload)
    return sum(seen.values())


def _mismatch(what: str, here: Any, there: Any) -> LayoutMismatch:
    return LayoutMismatch(f"The heal payload does not fit this rank: {what}: here {here!r:.300}, in the payload"
                          f" {there!r:.300}. HINT: a replica group heals only from a group of the same size, model,"
                          " sharding, optimizers and LR schedulers; start every group with the same settings")


def _checked_tensor(source: Any, target: torch.Tensor, what: str) -> torch.Tensor:
    if not isinstance(source, torch.Tensor):
        raise _mismatch(what, "a tensor", type(source).__name__)
    if source.shape != target.shape or source.dtype != target.dtype:
        raise _mismatch(what, (target.dtype, tuple(target.shape)), (source.dtype, tuple(source.shape)))
    return source


def _same_names(what: str, here: Sequence[str], there: Any) -> None:
    if type(there) is not dict or list(there) != list(here):
        shown = sorted(map(str, set(here) ^ set(there))) if type(there) is dict else type(there).__name__
        raise _mismatch(f"{what} (names differing: {shown!r:.200})", list(here)[:5], list(there)[:5]
                        if type(there) is dict else there)


def _optimizer_state(saved: Any, optimizer: torch.optim.Optimizer, index: int) -> dict:
    """``saved`` (a payload's optimizer.state_dict()) checked against ``optimizer`` and with every received DTensor
    shard rewrapped around this rank's own parameter; nothing is applied yet."""
    what = f"optimizer {index}"
    if type(saved) is not dict or set(saved) != {"state", "param_groups"} or type(saved["state"]) is not dict \
            or type(saved["param_groups"]) is not list:
        raise _mismatch(what, "a state_dict with `state` and `param_groups`", saved)
    groups = optimizer.param_groups
    sizes = [len(group["params"]) if type(group) is dict and type(group.get("params")) is list else None
             for group in saved["param_groups"]]
    if sizes != [len(group["params"]) for group in groups]:
        raise _mismatch(f"{what}'s parameters per group", [len(group["params"]) for group in groups], sizes)
    ids = [i for group in saved["param_groups"] for i in group["params"]]
    if any(type(i) is not int for i in ids) or len(set(ids)) != len(ids):
        raise _mismatch(f"{what}'s parameter ids", "distinct ints", ids)
    params = [p for group in groups for p in group["params"]]
    by_id = dict(zip(ids, params))
    state = {}
    for key, values in saved["state"].items():
        if key not in by_id or type(values) is not dict:
            raise _mismatch(f"{what}'s state entry {key!r}", f"ids {sorted(by_id)[:8]}...", values)
        param = by_id[key]
        state[key] = {name: _rewrapped(value, param, f"{what}'s state {key}.{name}") for name, value in values.items()}
    return {"state": state, "param_groups": saved["param_groups"]}


def _rewrapped(value: Any, param: torch.Tensor, what: str) -> Any:
    """A received shard as a DTensor of this rank's ``param``'s spec (a DTensor of a payload made in this process is
    taken by its local shard alike)."""
    if isinstance(value, torch.Tensor) and _is_dtensor(value):
        value = LocalShard(value.to_local())
    if type(value) is not LocalShard:
        return value
    if not _is_dtensor(param):
        raise _mismatch(what, "a plain parameter", "the shard of a DTensor")
    local = _checked_tensor(value.local, param.to_local(), what)
    return dtensor_around(local.to(param.to_local().device), param)


def load(payload: Any, model: torch.nn.Module, optimizers: Sequence[torch.optim.Optimizer] = (),
         schedulers: Sequence[Any] = ()) -> dict:
    """Apply ``payload`` to this rank's ``model``, ``optimizers`` (with or without state yet) and ``schedulers``,
    built with the sender's layout and at rest. Everything is checked first, then applied: a payload that does not
    fit raises :class:`LayoutMismatch` with nothing changed. Returns ``{"loop", "strategy", "manager"}``."""
    if type(payload) is not dict or set(payload) != set(PAYLOAD_KEYS):
        raise PayloadError(f"A heal payload is a dict with the keys {list(PAYLOAD_KEYS)}, not {payload!r:.200}. HINT:"
                           " build it with lightning_fsdp.engine.fault_tolerance.heal.produce")
    saved_model = payload["model"]
    if type(saved_model) is not dict or set(saved_model) != {"params", "buffers"}:
        raise _mismatch("the model part", "{'params', 'buffers'}", saved_model)
    params = dict(model.named_parameters())
    buffers = dict(persistent_buffers(model))
    _same_names("parameters", list(params), saved_model["params"])
    _same_names("buffers", list(buffers), saved_model["buffers"])
    copies = [(_local(target), _checked_tensor(saved_model[part][name], _local(target), f"{part[:-1]} {name!r}"))
              for part, targets in (("params", params), ("buffers", buffers)) for name, target in targets.items()]
    if type(payload["optimizers"]) is not list or len(payload["optimizers"]) != len(optimizers):
        raise _mismatch("the number of optimizers", len(optimizers), payload["optimizers"])
    optimizer_states = [_optimizer_state(saved, optimizer, i)
                        for i, (saved, optimizer) in enumerate(zip(payload["optimizers"], optimizers))]
    if type(payload["schedulers"]) is not list or len(payload["schedulers"]) != len(schedulers) \
            or any(type(s) is not dict for s in payload["schedulers"]):
        raise _mismatch("the LR schedulers", len(schedulers), payload["schedulers"])
    for scheduler, state in zip(schedulers, payload["schedulers"]):
        # `load_state_dict` of torch's schedulers updates the object's __dict__ with every key: only its own keys.
        if set(state) != set(scheduler.state_dict()):
            raise _mismatch("an LR scheduler's state", sorted(scheduler.state_dict()), sorted(map(str, state)))
    with torch.no_grad():
        for target, source in copies:
            target.copy_(source)
    for optimizer, state in zip(optimizers, optimizer_states):
        optimizer.load_state_dict(state)
    for scheduler, state in zip(schedulers, payload["schedulers"]):
        scheduler.load_state_dict(state)
    return {key: payload[key] for key in ("loop", "strategy", "manager")}


def local_bytes(t: torch.Tensor) -> int:
    """The bytes of this rank's part of ``t`` (its local shard when it is a DTensor)."""
    local = _local(t)
    return local.numel() * local.element_size()


def check_rng_state(state: Any) -> None:
    """Refuse random states that :func:`restore_rng_state` could not apply whole, before a heal changes anything.
    torch's (CPU and CUDA) and Python's are each first set on a generator of their own, which checks what their
    restore checks; NumPy's fields are checked here, since its ``set_state`` takes a position past its 624 keys
    unchecked and then reads past them."""
    problem = _rng_problem(state)
    if problem is not None:
        raise _mismatch(f"the random states ({problem})", "torch's and Python's generator states, and NumPy's and"
                        " CUDA's as rng_state() takes them", state)


def _rng_problem(state: Any) -> Optional[str]:
    if type(state) is not dict or not {"torch", "python"} <= set(state) <= {"torch", "python", "cuda", "numpy"}:
        return "not a dict of `torch`, `python`, and optionally `cuda` and `numpy`"
    if not _cpu_tensor(state["torch"], torch.uint8) or _unsettable("cpu", state["torch"]):
        return "torch's is not a CPU generator state of this build"
    python = state["python"]
    if type(python) not in (list, tuple) or len(python) != 3 or type(python[1]) not in (list, tuple) \
            or not all(type(v) is int and 0 <= v < 2**32 for v in python[1]) \
            or (python[2] is not None and type(python[2]) is not float):
        return "Python's is not (version, 625 ints in [0, 2**32), None or a float)"
    try:
        random.Random().setstate((python[0], tuple(python[1]), python[2]))
    except (ValueError, TypeError) as err:  # another version, another length, a position past the state
        return f"Python's: {err}"
    numpy = state.get("numpy")
    if "numpy" in state and not (
            type(numpy) in (list, tuple) and len(numpy) == 5 and type(numpy[0]) is str and numpy[0] == "MT19937"
            and _cpu_tensor(numpy[1], torch.int64) and numpy[1].shape == (624,)
            and bool(((numpy[1] >= 0) & (numpy[1] < 2**32)).all()) and type(numpy[2]) is int and 0 <= numpy[2] <= 624
            and type(numpy[3]) is int and numpy[3] in (0, 1) and type(numpy[4]) is float):
        return "NumPy's is not ('MT19937', 624 keys in [0, 2**32), a position in [0, 624], 0 or 1, a float)"
    if "cuda" in state:
        cuda, devices = state["cuda"], torch.cuda.device_count()
        if type(cuda) not in (list, tuple) or len(cuda) != devices \
                or not all(_cpu_tensor(s, torch.uint8) for s in cuda):
            return f"CUDA's is not a list of {devices} CPU uint8 tensors, one per CUDA device of this rank"
        # Without CUDA initialized here (nothing of this rank on a GPU), a restore is deferred to its first use.
        if torch.cuda.is_initialized() and any(_unsettable(f"cuda:{i}", s) for i, s in enumerate(cuda)):
            return "CUDA's are not CUDA generator states of this build"
    return None


def _cpu_tensor(value: Any, dtype: torch.dtype) -> bool:
    return type(value) is torch.Tensor and value.dtype == dtype and value.device.type == "cpu" and value.dim() == 1


def _unsettable(device: str, state: torch.Tensor) -> bool:
    """Whether a fresh generator on ``device`` refuses ``state`` (the process's own generators are left alone)."""
    try:
        torch.Generator(device).set_state(state)
    except (RuntimeError, TypeError, ValueError):  # "RNG state is wrong size", "Invalid mt19937 state"
        return True
    return False


def rng_state() -> dict:
    """The random states a healed rank continues from: torch's CPU and accelerator generators, Python's ``random``
    and NumPy's global one, as tensors and plain values the transport carries."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    numpy = _numpy()
    if numpy is not None:
        kind, keys, pos, has_gauss, cached = numpy.random.get_state()
        state["numpy"] = (kind, torch.from_numpy(keys.astype("int64")), int(pos), int(has_gauss), float(cached))
    return state


def restore_rng_state(state: dict) -> None:
    """Set the states :func:`rng_state` took (a received copy: tuples and tensors as the transport returns them)."""
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])
    numpy = _numpy()
    if numpy is not None and "numpy" in state:
        kind, keys, pos, has_gauss, cached = state["numpy"]
        numpy.random.set_state((kind, keys.numpy().astype("uint32"), pos, has_gauss, cached))


def _numpy() -> Optional[Any]:
    try:
        import numpy
    except ImportError:
        return None
    return numpy
