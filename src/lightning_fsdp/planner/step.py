"""Run one training step of a model, sharded exactly as the strategy would shard it, without allocating anything.

How: a *fake* process group of the planned world size (collectives that move no data), torch's ``FakeTensorMode``
(tensors with shapes and dtypes but no storage), and torch's ``FSDPMemTracker``, which attributes every tensor that
would be alive to a category (sharded parameters, gathered parameters, gradients, optimizer state, activations,
communication buffers) and records the peak per FSDP unit, in forward and in backward (``tracker.py`` makes its
per-op bookkeeping cheaper, changing no number). The model goes through the
strategy's own :func:`~lightning_fsdp.engine.sharding.shard_model`, so units, activation checkpointing, resharding and
mixed precision are the ones a real run gets.

A LightningModule is planned as the Trainer runs it: ``configure_model``, sharding as a harness (its top-level models
are the roots, as on the Trainer front), the optimizer of ``configure_optimizers``, and ``training_step(batch, 0)`` in
place of forward.

The step is the one a training loop runs in its steady state, in the order of the loop that runs it (``loop.py``):
Fabric's (forward, backward of the output if it is a scalar, of its ``.loss`` if it has one, else of its sum; one
optimizer step; gradients set to ``None``), or the Trainer's (``training_step`` while the previous step's gradients
are still alive, then ``zero_grad``, backward and the optimizer step; ``accumulate_grad_batches`` batches per step;
manual optimization as ``training_step`` orders it). Steady state means the optimizer already holds its state
(AdamW's two moments) from earlier steps: the first step of a run peaks lower, since its optimizer state appears only
when its activations are gone.
"""

from __future__ import annotations

import copy
import logging
import os
import traceback
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable, Union

import torch
import torch.distributed as dist
from torch import nn

from lightning_fsdp._base.errors import bad_argument
from lightning_fsdp._base.compat import clear_dtensor_caches, data_dependent_errors, planner_tools
from lightning_fsdp.engine.config import FSDPConfig
from lightning_fsdp.engine.mesh import build_mesh, tensor_parallel_mesh
from lightning_fsdp.engine.precision import FSDPPrecision
from lightning_fsdp.engine.sharding import shard_model
from lightning_fsdp.planner.loop import attach_stand_in, cannot_follow, step_order
from lightning_fsdp.planner.real_mesh import RealMeshIndices
from lightning_fsdp.planner.tracker import StepMemTracker

__all__ = ["StepStats", "UnitStats", "run_step", "OPTIMIZERS", "PlanningError"]

FakeStore, FakeTensorMode, FSDPMemTracker, (PEAK_FW, PEAK_BW) = planner_tools()
# The tracker each planned step runs under: torch's, with cheaper bookkeeping (``tracker.py``; tests compare the two).
TRACKER: type = StepMemTracker

OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "adamw": torch.optim.AdamW,
    "adam": torch.optim.Adam,
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
}

ModelSource = Union[nn.Module, Callable[[], nn.Module]]
BatchSource = Union[Any, Callable[[], Any]]


class PlanningError(RuntimeError):
    """The user's code failed while the planner ran it: the model factory, the batch factory, or the model's forward
    or backward on fake tensors. ``phase`` says which; the original exception is the ``__cause__``."""

    def __init__(self, message: str, phase: str) -> None:
        super().__init__(message)
        self.phase = phase


# What to do when each phase fails, after the cause.
_HINTS = {
    "model factory": "make the factory build the model without arguments, e.g. `def build(): return GPT(config)`;"
                     " calling it in Python shows the whole traceback",
    "batch factory": "make the factory return one rank's batch without arguments, e.g."
                     " `def batch(): return torch.randint(0, 50304, (8, 1024))`",
    "forward": "make the batch fit the model's forward: a tensor is passed as the one positional argument, a tuple as"
               " the positional arguments, a dict as the keyword arguments",
    "configure_model": "make `configure_model` build the LightningModule's models without a Trainer (the planner"
                       " calls it on its own, with no Trainer attached)",
    "configure_optimizers": "make `configure_optimizers` return an optimizer over `self.parameters()`, e.g."
                            " `return torch.optim.AdamW(self.parameters())`",
    "training_step": "make the batch fit `training_step(batch, batch_idx)`: the planner passes the `--inputs` batch"
                     " as it is, with batch_idx 0",
    "backward": "check that the output the planner backpropagates (the output if a scalar, its `.loss`, else its"
                " sum) is differentiable",
}


@contextmanager
def _running(phase: str, root: str = "") -> Iterator[None]:
    """Turn a failure of the user's code in ``phase`` into a :class:`PlanningError` that says where and what to do;
    ``root`` names the FSDP root the step's tracker follows."""
    try:
        yield
    except PlanningError:
        raise
    except data_dependent_errors() as err:
        raise PlanningError(
            f"The planner cannot trace the model's {phase}{_user_line(err)}: it needs {_data_dependent(err)}, and"
            " the planner runs on fake tensors, which have shapes and dtypes but no values. HINT: keep data-dependent"
            " code out of the step when planning (e.g. put a `.item()` check behind a flag the factory turns off):"
            " the memory is that of the same step without it.", phase,
        ) from err
    except Exception as err:
        unfollowed = cannot_follow(phase, err, root, _user_line(err))
        if unfollowed is not None:
            raise PlanningError(unfollowed, phase) from err
        message = " ".join(str(err).split()) or "(no message)"
        if len(message) > 300:
            message = message[:297] + "..."
        what = f"The {phase}" if "factory" in phase else f"The model's {phase}"
        raise PlanningError(f"{what} failed{_user_line(err)}: {type(err).__name__}: {message.rstrip('.')}."
                            f" HINT: {_HINTS[phase]}.", phase) from err


def _data_dependent(err: Exception) -> str:
    if isinstance(err, data_dependent_errors()[1]):
        return f"an output whose shape depends on the data ({err}: `nonzero()`, a boolean mask, `unique()`)"
    return f"a Python value computed from the data ({err}: `.item()`, `if tensor:`, `int(tensor)`)"


_NOT_USER_CODE = ("torch", "lightning", "lightning_fsdp")


def _user_line(err: BaseException) -> str:
    """`` at FILE:LINE (`code`)`` for the innermost frame outside torch, Lightning and this package: the user's line
    that failed; empty if there is none (the failure is inside torch, called from here)."""
    frames = [f for f in traceback.extract_tb(err.__traceback__)
              if not any(f"{os.sep}{package}{os.sep}" in f.filename for package in _NOT_USER_CODE)]
    if not frames:
        return ""
    frame = frames[-1]
    code = f" (`{frame.line.strip()}`)" if frame.line else ""
    return f" at {frame.filename}:{frame.lineno}{code}"


@dataclass
class UnitStats:
    name: str  # the unit's qualified name in the model ("" for the root)
    forward_peak: int  # bytes alive at the unit's peak in forward
    backward_peak: int  # and in backward (0 if it ran no backward)


@dataclass
class StepStats:
    """What one rank holds. ``peak`` maps each category to its bytes at the moment of the overall peak; ``after_step``
    to its bytes once the optimizer has stepped (sharded parameters, gradients and optimizer state at rest)."""

    peak_bytes: int
    peak: dict[str, int]
    after_step: dict[str, int]
    units: list[UnitStats]
    peak_phase: str  # "forward", "backward" or "optimizer step"
    peak_unit: str
    optimizer: str = ""  # set when the model chose it: a LightningModule's `configure_optimizers`
    mesh: dict[str, int] = field(default_factory=dict)  # the planned mesh's axes and sizes, e.g. {"shard": 2, "tp": 2}
    loop: str = "fabric"  # whose order the step followed: "fabric", "trainer", "trainer (manual optimization)"


def run_step(
    model: ModelSource, batch: BatchSource, config: FSDPConfig, precision: str, optimizer: str, world_size: int,
    rank: int, num_nodes: int = 1, accumulate_grad_batches: int = 1,
) -> StepStats:
    """Plan rank ``rank`` of ``world_size`` (see the module docstring)."""
    device = torch.device("cpu")
    plugin = FSDPPrecision(precision)
    plugin.set_device_type(device.type)
    with _fake_process_group(rank, world_size), warnings.catch_warnings():
        # FSDP's note on root outputs that are views concerns in-place use of the output; the planner makes none.
        warnings.filterwarnings("ignore", message=".*returned a view tensor.*")
        mesh = build_mesh(config, device, world_size, num_nodes)
        tensor_parallel = tensor_parallel_mesh(mesh) is not None
        # Tensor parallelism makes meshes inside the fake step, whose rank table must stay real (see `real_mesh`).
        # Only then: the dispatch mode sees every op, which costs a plan without it about a tenth more time.
        real_mesh = RealMeshIndices(mesh) if tensor_parallel else nullcontext()
        with _quiet_fake_tensor_log(), FakeTensorMode(allow_non_fake_inputs=True) as mode, real_mesh:
            module = _fake_model(model, mode)
            lightning_module = is_lightning_module(module)
            if lightning_module:
                with _running("configure_model"):
                    module.configure_model()
            sharded = shard_model(module, config, mesh, device,
                                  config.mixed_precision or plugin.mixed_precision_policy(), harness=lightning_module)
            optimizers = _lightning_optimizers(module) if lightning_module else [OPTIMIZERS[optimizer](module.parameters())]
            opt = optimizers[0]
            fake_batch = _fake_batch(batch, mode)
            # A LightningModule's step is its `training_step`, as the Trainer runs it (the strategy shards it as a
            # harness, the same as the Trainer front does); any other module's step is its forward.
            step = module.training_step if lightning_module else module
            phase = "training_step" if lightning_module else "forward"
            root = _tracked_root(sharded.roots, module)
            # Manual optimization reaches the optimizers and `manual_backward` through the Trainer: a stand-in follows.
            stand_in = attach_stand_in(module, optimizers, world_size, rank) if lightning_module else None
            _refuse_manual_accumulation(module, stand_in, accumulate_grad_batches)

            def forward(batch_idx: int) -> Any:
                args, kwargs = ((fake_batch, batch_idx), {}) if lightning_module else _as_call(fake_batch)
                with plugin.forward_context(), _running(phase, root=_name_of(root, module)):
                    return step(*plugin.convert_input(args), **plugin.convert_input(kwargs))

            def backward(output: Any) -> None:
                loss = _loss_of(output)
                with _running("backward"):
                    loss.backward()

            order = step_order(module, lightning_module, opt, forward, backward, config, accumulate_grad_batches)
            order.prepare()
            if tensor_parallel:
                # The steady state of a tensor-parallel step: DTensor caches the sharding of each op it has seen
                # once, and the first step's propagation allocates tensors of the ops' global shapes that no later
                # step does. One whole step before the tracked one, as in training.
                order.run(_Untracked())
            tracker = TRACKER(root, opt)
            tracker.track_inputs((fake_batch,))
            moments = _TrackedMoments(tracker, module)
            with tracker:
                order.run(moments)
            peak = tracker.get_tracker_snapshot("peak")
            units = moments.units()
            before_step, after = moments.before, moments.after
    peak_dev = _one_device(peak)
    phase, unit = _where(peak_dev["Total"], _one_device(before_step)["Total"], units)
    return StepStats(
        peak_bytes=peak_dev["Total"], peak=_categories(peak_dev), after_step=_categories(_one_device(after)),
        units=units, peak_phase=phase, peak_unit=unit, mesh=dict(zip(mesh.mesh_dim_names or (), mesh.shape)),
        optimizer=f"{type(opt).__name__} from configure_optimizers" if lightning_module else "", loop=order.name,
    )


def is_lightning_module(module: nn.Module) -> bool:
    """A LightningModule, told by its steps (importing Lightning's Trainer package only to ask would cost seconds)."""
    return callable(getattr(module, "training_step", None)) and callable(getattr(module, "configure_optimizers", None))


def _lightning_optimizers(module: nn.Module) -> list[torch.optim.Optimizer]:
    """The optimizers ``configure_optimizers`` returns, in any of the forms the Trainer accepts (an optimizer, a list
    of them, ``([optimizers], [schedulers])``, a dict with ``"optimizer"`` or a list of such dicts). Called after
    sharding, as the Trainer calls it, so they are built over the sharded parameters. The first is the one tracked."""
    with _running("configure_optimizers"):
        found = module.configure_optimizers()
    optimizers = _optimizers_in(found)
    if not optimizers:
        raise PlanningError(
            f"`{type(module).__name__}.configure_optimizers()` returned {type(found).__name__}, in which the"
            " planner finds no optimizer. HINT: return an optimizer, e.g."
            " `return torch.optim.AdamW(self.parameters())`, or a dict with an 'optimizer' entry.",
            phase="configure_optimizers",
        )
    return optimizers


def _optimizers_in(found: Any) -> list[torch.optim.Optimizer]:
    if isinstance(found, torch.optim.Optimizer):
        return [found]
    if isinstance(found, Mapping):
        return _optimizers_in(found.get("optimizer"))
    if isinstance(found, (list, tuple)) and found:
        if isinstance(found[0], (list, tuple)):  # ([optimizers], [schedulers])
            return _optimizers_in(found[0])
        return [opt for item in found for opt in _optimizers_in(item)]
    return []


def _refuse_manual_accumulation(module: nn.Module, stand_in: Any, accumulate_grad_batches: int) -> None:
    if stand_in is not None and accumulate_grad_batches != 1:
        raise ValueError(bad_argument(
            "accumulate_grad_batches", accumulate_grad_batches, "1 for a LightningModule in manual optimization",
            "Pass `accumulate_grad_batches=1`: the Trainer refuses automatic accumulation with manual optimization,"
            f" and `{type(module).__name__}.training_step` decides itself when to step.",
        ))


class _Untracked:
    def before_step(self) -> None: ...
    def after_step(self) -> None: ...
    def between(self) -> None: ...


class _TrackedMoments:
    """Takes the tracker's snapshots at the step's moments (see :class:`~lightning_fsdp.planner.loop.Moments`).
    Between the batches of an accumulation window the per-unit statistics are kept and cleared: torch's tracker
    follows each root once (``reset_mod_stats``); the overall peak runs on."""

    def __init__(self, tracker: Any, module: nn.Module) -> None:
        self.tracker, self.module = tracker, module
        self.before: dict = {}
        self.after: dict = {}
        self._windows: list[list[UnitStats]] = []

    def before_step(self) -> None:
        self.before = self.tracker.get_tracker_snapshot("peak")

    def after_step(self) -> None:
        self.after = self.tracker.get_tracker_snapshot("current")  # params, grads and optimizer state at rest

    def between(self) -> None:
        self._windows.append(_unit_stats(self.tracker, self.module))
        self.tracker.reset_mod_stats()

    def units(self) -> list[UnitStats]:
        """Each unit's peaks over every batch of the window, in the model's order."""
        merged: dict[str, UnitStats] = {}
        for unit in [u for window in [*self._windows, _unit_stats(self.tracker, self.module)] for u in window]:
            seen = merged.setdefault(unit.name, UnitStats(unit.name, 0, 0))
            seen.forward_peak = max(seen.forward_peak, unit.forward_peak)
            seen.backward_peak = max(seen.backward_peak, unit.backward_peak)
        order = {n: i for i, (n, _) in enumerate(self.module.named_modules())}
        return sorted(merged.values(), key=lambda u: order.get(u.name, 0))


def _name_of(root: nn.Module, module: nn.Module) -> str:
    return next((n for n, m in module.named_modules() if m is root), "") or type(root).__name__


def _tracked_root(roots: list[nn.Module], module: nn.Module) -> nn.Module:
    """The one FSDP root the tracker follows: the model itself, or a LightningModule's one top-level model."""
    if len(roots) == 1:
        return roots[0]
    names = {id(m): n for n, m in module.named_modules()}
    raise PlanningError(
        f"`{type(module).__name__}` has {len(roots)} top-level models ({', '.join(names[id(r)] for r in roots)}), and"
        " the planner follows one FSDP root. HINT: plan each model on its own (`--model` a factory that returns it),"
        " or hold them in one module that `training_step` calls.", phase="configure_model",
    )


@contextmanager
def _quiet_fake_tensor_log() -> Iterator[None]:
    """Fake tensors log a whole traceback for an op that fails on the shapes (a batch that does not fit the model)
    before raising; the error itself reaches the user as one :class:`PlanningError`, so the log only repeats it."""
    log = logging.getLogger("torch._subclasses.fake_tensor")
    disabled, log.disabled = log.disabled, True
    try:
        yield
    finally:
        log.disabled = disabled


@contextmanager
def _fake_process_group(rank: int, world_size: int) -> Iterator[None]:
    if dist.is_initialized():
        raise RuntimeError(
            "A memory plan needs a process group of its own, and this process already has one. HINT: plan before"
            " launching, e.g. in the script that calls `fabric.launch()`, before that call, or run"
            " `lightning-fsdp plan ...` from a shell."
        )
    clear_dtensor_caches()  # each plan's meshes are its own: no cached DTensor sharding may point at another world
    dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()
        clear_dtensor_caches()


def _fake_model(source: ModelSource, mode: FakeTensorMode) -> nn.Module:
    if isinstance(source, nn.Module):
        # A copy whose tensors are shapes only: no storage is copied, and the caller's module is left alone.
        memo = {id(t): _meta_like(t) for t in [*source.parameters(), *source.buffers()]}
        module = copy.deepcopy(source, memo)
    else:
        with _running("model factory"):
            module = source()  # built under fake mode: its tensors already have no storage
        if not isinstance(module, nn.Module):
            raise TypeError(f"The model factory returned a {type(module).__name__}, not an nn.Module. HINT: return the"
                            " model itself, e.g. `def build(): return GPT(config)`.")
    if any(t.is_meta for t in [*module.parameters(), *module.buffers()]):
        module.to_empty(device="cpu")  # fake tensors, since fake mode is active
    return module


def _meta_like(tensor: torch.Tensor) -> torch.Tensor:
    meta = torch.empty_like(tensor, device="meta")
    return nn.Parameter(meta, requires_grad=tensor.requires_grad) if isinstance(tensor, nn.Parameter) else meta


def _fake_batch(source: BatchSource, mode: FakeTensorMode) -> Any:
    with _running("batch factory"):
        batch = source() if callable(source) else source
    return _map_tensors(batch, lambda t: t if mode.is_our_fake(t) else mode.from_tensor(t))


def _map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, Mapping):
        return {k: _map_tensors(v, fn) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map_tensors(v, fn) for v in obj)
    return obj


def _as_call(batch: Any) -> tuple[tuple, dict]:
    """A tensor is one positional argument, a tuple the positional arguments, a dict the keyword arguments."""
    if isinstance(batch, Mapping):
        return (), dict(batch)
    if isinstance(batch, tuple):
        return batch, {}
    return (batch,), {}


def _loss_of(output: Any) -> torch.Tensor:
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    if isinstance(output, Mapping) and isinstance(output.get("loss"), torch.Tensor):
        return output["loss"]
    if isinstance(output, (list, tuple)):
        output = output[0]
    if not isinstance(output, torch.Tensor):
        raise TypeError(
            f"The model returned a {type(output).__name__}; the planner backpropagates a tensor (the output if it is"
            " a scalar, else its sum), or the output's `.loss`. HINT: make the model factory return a module whose"
            " forward returns a tensor or an object with `.loss`."
        )
    return output if output.ndim == 0 else output.float().sum()


def _one_device(snapshot: dict) -> dict[str, int]:
    """The tracker keeps one table per device; a CPU plan has one."""
    totals: dict[str, int] = {}
    for table in snapshot.values():
        for key, value in table.items():
            name = getattr(key, "name", str(key))
            totals[name] = totals.get(name, 0) + value
    return totals


def _categories(table: dict[str, int]) -> dict[str, int]:
    return {k.lower(): v for k, v in table.items() if k != "Total"}


def _unit_stats(tracker: FSDPMemTracker, module: nn.Module) -> list[UnitStats]:
    names = {id(m): n for n, m in module.named_modules()}
    stats = []
    for unit, record in tracker.memory_tracking.items():
        if id(unit) not in names:
            continue
        fw = record.snapshots.get(PEAK_FW, [])
        bw = record.snapshots.get(PEAK_BW, [])
        stats.append(UnitStats(
            name=names[id(unit)],
            forward_peak=max((_one_device(s)["Total"] for s in fw), default=0),
            backward_peak=max((_one_device(s)["Total"] for s in bw), default=0),
        ))
    order = {n: i for i, n in enumerate(names.values())}
    return sorted(stats, key=lambda u: order.get(u.name, 0))


def _where(peak: int, before_step: int, units: list[UnitStats]) -> tuple[str, str]:
    """The phase and the innermost unit at whose peak the overall peak was reached."""
    if peak > before_step:
        return "optimizer step", ""
    candidates = [(u.backward_peak, "backward", u.name) for u in units] + [(u.forward_peak, "forward", u.name) for u in units]
    top = max(c[0] for c in candidates)
    # The root's peak contains its children's; the deepest unit with the same peak is the one to name.
    _, phase, name = max((c for c in candidates if c[0] == top), key=lambda c: c[2].count(".") + (c[2] != ""))
    return phase, name
