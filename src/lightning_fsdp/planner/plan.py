"""``plan_memory``: the memory one training step needs on each rank, before anything is allocated, and
``MemoryPlan``, what it returns (text and JSON renderings included)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lightning_fsdp._base.errors import bad_argument
from lightning_fsdp.engine.config import FSDPConfig
from lightning_fsdp.engine.precision import FSDPPrecision
from lightning_fsdp.planner.step import OPTIMIZERS, BatchSource, ModelSource, StepStats, run_step

__all__ = ["plan_memory", "MemoryPlan", "STRATEGY_OPTIONS", "MAX_WORLD_SIZE"]

# The strategy arguments a plan takes, with the names and spellings of `FSDPStrategy` (and the YAML).
STRATEGY_OPTIONS = (
    "sharding_strategy", "auto_wrap_policy", "activation_checkpointing_policy", "cpu_offload", "mixed_precision",
    "device_mesh", "reshard_after_forward", "forward_prefetch", "backward_prefetch", "tensor_parallel_size",
    "tensor_parallel_plan",
)

# The largest world the planner takes. Only ranks 0 and the last are planned, and nothing of the planner's own grows
# with the world; but the sharding is torch's own, run for real on fake tensors: `fully_shard` makes one (empty or
# view) tensor per rank of the shard axis for every parameter, and DeviceMesh holds every rank's index. So a plan's
# time grows with the shard-axis size: measured for a 3-block model with FULL_SHARD, 0.26 s at 2 ranks, 2.3 s at
# 1,024, 137 s at 65,536 (HYBRID_SHARD with a shard axis of 8: 0.7 s at 65,536), in bounded memory. 2**16 keeps a
# plan within minutes and covers any FSDP run there is; `--world-size 1000000000` used to grow memory without bound.
MAX_WORLD_SIZE = 2**16

# Categories of FSDPMemTracker, grouped the way the report speaks of them.
_AT_REST = {"sharded params": ("sharded_param",), "grads": ("sharded_grad", "unsharded_grad"), "optimizer state": ("opt",)}
_IN_FLIGHT = ("unsharded_param", "all_gather", "reduce_scatter")
_ACTIVATIONS = ("act", "temp", "inp")
# What CPU offload keeps in host memory: the device peak leaves it out.
_HOST_WHEN_OFFLOADED = ("sharded_param", "sharded_grad", "opt")


@dataclass
class MemoryPlan:
    """The plan of one step per rank. ``ranks`` and ``peak_bytes`` hold the planned ranks (0 and the last): FSDP pads
    every shard to the same size, so every other rank holds what rank 0 holds (:meth:`peak_of` answers for any
    rank), and a plan's size does not grow with the world size. With CPU offload the peak is the accelerator's, and
    the breakdown's ``host memory (offloaded)`` what stays in host memory."""

    world_size: int
    settings: dict[str, Any]
    ranks: dict[int, StepStats]
    planned_ranks: list[int] = field(default_factory=list)

    @property
    def cpu_offload(self) -> bool:
        return bool(self.settings.get("cpu_offload"))

    @property
    def mesh(self) -> dict[str, int]:
        """The planned mesh's axes and their sizes: ``{"shard": 4}``, ``{"replicate": 2, "shard": 4}``, or with
        tensor parallelism ``{"shard": 2, "tp": 2}``."""
        return self.ranks[min(self.ranks)].mesh

    @property
    def peak_bytes(self) -> dict[int, int]:
        return {rank: self._device_peak(stats) for rank, stats in self.ranks.items()}

    def peak_of(self, rank: int) -> int:
        """The planned peak of any rank of the world."""
        if not 0 <= rank < self.world_size:
            raise ValueError(bad_argument("rank", rank, f"0 to {self.world_size - 1}", "Ask for a rank of the plan."))
        return self._device_peak(self.ranks.get(rank, self.ranks[min(self.ranks)]))

    @property
    def max_peak_bytes(self) -> int:
        return max(self.peak_bytes.values())

    def fits(self, budget: int) -> bool:
        return self.max_peak_bytes <= budget

    def _device_peak(self, stats: StepStats) -> int:
        if not self.cpu_offload:
            return stats.peak_bytes
        return stats.peak_bytes - sum(stats.peak.get(k, 0) for k in _HOST_WHEN_OFFLOADED)

    def breakdown(self, rank: int = 0) -> dict[str, int]:
        stats = self.ranks[rank]
        out = {name: sum(stats.after_step.get(k, 0) for k in keys) for name, keys in _AT_REST.items()}
        out["gathered units in flight at the peak"] = sum(stats.peak.get(k, 0) for k in _IN_FLIGHT)
        out["activations at the peak"] = sum(stats.peak.get(k, 0) for k in _ACTIVATIONS)
        out["peak"] = self._device_peak(stats)
        if self.cpu_offload:
            out["host memory (offloaded)"] = sum(stats.after_step.get(k, 0) for k in _HOST_WHEN_OFFLOADED)
        return out

    def to_dict(self) -> dict[str, Any]:
        first = self.ranks[min(self.ranks)]
        return {
            "peak_bytes": {str(r): b for r, b in self.peak_bytes.items()},
            "world_size": self.world_size,
            "mesh": self.mesh,
            "settings": {k: _jsonable(v) for k, v in self.settings.items()},
            "planned_ranks": self.planned_ranks,
            "breakdown": self.breakdown(min(self.ranks)),
            "peak_categories": first.peak,
            "peak_at": {"phase": first.peak_phase, "unit": first.peak_unit},
            "units": [{"unit": u.name or "(root)", "forward_peak": u.forward_peak, "backward_peak": u.backward_peak}
                      for u in first.units],
        }

    def render(self) -> str:
        rank = min(self.ranks)
        stats = self.ranks[rank]
        shown = ", ".join(f"{k}={_jsonable(v)}" for k, v in self.settings.items() if v not in (None, False))
        on = f"{self.world_size} rank(s)"
        if "tp" in self.mesh:  # the tensor-parallel axis changes what a rank holds: name the mesh
            on += " as a (" + ", ".join(f"{axis}={size}" for axis, size in self.mesh.items()) + ") mesh"
        lines = [f"Memory plan for one training step on {on}: {shown}", ""]
        width = max(len(k) for k in self.breakdown(rank))
        lines += [f"  {k:<{width}}  {_human(v):>10}" for k, v in self.breakdown(rank).items()]
        where = stats.peak_phase
        if stats.peak_phase != "optimizer step":
            where += f" of unit {stats.peak_unit or '(root)'}"
        lines += ["", f"  the peak is reached in {where}", "", "  per unit (bytes alive at its peak):"]
        name_width = max([len(u.name or "(root)") for u in stats.units] + [4])
        lines.append(f"    {'unit':<{name_width}}  {'forward':>10}  {'backward':>10}")
        for unit in stats.units:
            lines.append(f"    {unit.name or '(root)':<{name_width}}  {_human(unit.forward_peak):>10}"
                         f"  {_human(unit.backward_peak):>10}")
        peaks = self.peak_bytes
        lines += ["", "  peak per rank: " + ", ".join(f"{r}: {_human(b)}" for r, b in peaks.items())]
        if len(peaks) < self.world_size:
            lines.append(f"  (ranks {self.planned_ranks} planned; FSDP pads every shard to the same size, so the"
                         " others hold what rank 0 holds)")
        return "\n".join(lines)


def plan_memory(
    model: ModelSource,
    batch: BatchSource,
    *,
    world_size: int,
    num_nodes: int = 1,
    precision: str = "32-true",
    optimizer: str = "adamw",
    accumulate_grad_batches: int = 1,
    **strategy_options: Any,
) -> MemoryPlan:
    """Plan the memory of one training step on each of ``world_size`` ranks, allocating nothing.

    Args:
        model: an ``nn.Module`` (its tensors are not copied; a meta-device model is fine) or a callable that
            builds one (called under fake tensors, so a model of any size costs nothing to build). A
            ``LightningModule`` (or its class) is planned as the Trainer runs it: ``configure_model``, its top-level
            models as the roots, ``training_step(batch, 0)``, and the optimizer of ``configure_optimizers`` (which
            then replaces ``optimizer``).
        batch: one rank's batch, or a callable that returns it: a tensor (the one positional argument), a tuple
            (positional arguments) or a dict (keyword arguments); for a LightningModule, the batch
            ``training_step`` receives.
        world_size: the number of ranks of the run to plan.
        num_nodes: the number of nodes of the run to plan.
        precision: as in ``Fabric(precision=...)``.
        optimizer: ``"adamw"``, ``"adam"`` or ``"sgd"`` (with momentum).
        accumulate_grad_batches: batches per optimizer step, as ``Trainer(accumulate_grad_batches=...)`` (or a
            Fabric loop under ``fabric.no_backward_sync`` for all but the last): the batches before the last keep
            FSDP's unsharded gradients from one backward to the next.
        **strategy_options: ``FSDPStrategy``'s own arguments: ``sharding_strategy``, ``auto_wrap_policy``,
            ``activation_checkpointing_policy``, ``cpu_offload``, ``mixed_precision``, ``device_mesh``,
            ``reshard_after_forward``, ``forward_prefetch``, ``backward_prefetch``, ``tensor_parallel_size`` and
            ``tensor_parallel_plan`` (the mesh becomes ``(shard, tp)``, and each rank's plan holds its pieces of the
            split layers: see ``docs/guides/tensor-parallel.md``).

    Call it before launching (it runs on a process group of its own, with the planned world size).
    """
    _check(world_size, num_nodes, precision, optimizer, strategy_options)
    if not isinstance(accumulate_grad_batches, int) or isinstance(accumulate_grad_batches, bool) \
            or accumulate_grad_batches < 1:
        raise ValueError(bad_argument("accumulate_grad_batches", accumulate_grad_batches, "an int >= 1",
                                      "Pass the Trainer's value, e.g. `accumulate_grad_batches=4`."))
    config = FSDPConfig.from_arguments(**strategy_options)
    ranks = [0] if world_size == 1 else [0, world_size - 1]
    planned = {r: run_step(model, batch, config, precision, optimizer, world_size, r, num_nodes,
                           accumulate_grad_batches) for r in ranks}
    chosen = planned[min(planned)].optimizer  # a LightningModule's own, from `configure_optimizers`
    loop = planned[min(planned)].loop  # a LightningModule's step follows the Trainer's order
    settings = {"precision": precision, "optimizer": chosen or optimizer, **({"loop": loop} if loop != "fabric" else {}),
                **({"accumulate_grad_batches": accumulate_grad_batches} if accumulate_grad_batches > 1 else {}),
                **strategy_options}
    return MemoryPlan(world_size=world_size, settings=settings, ranks=planned, planned_ranks=ranks)


def _check(world_size: Any, num_nodes: Any, precision: Any, optimizer: Any, options: dict[str, Any]) -> None:
    for name, value in (("world_size", world_size), ("num_nodes", num_nodes)):
        if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_WORLD_SIZE:
            raise ValueError(bad_argument(
                name, value, f"an int from 1 to {MAX_WORLD_SIZE:,} (2**16)",
                f"Pass e.g. `{name}=2`; for a larger run, plan {MAX_WORLD_SIZE:,} ranks: the sharded state per rank"
                " only shrinks beyond that.",
                problem=(f"{value:,} ranks is more than the planner represents" if isinstance(value, int)
                         and not isinstance(value, bool) and value > MAX_WORLD_SIZE else "")))
    if world_size % num_nodes:
        raise ValueError(bad_argument("num_nodes", num_nodes, f"a divisor of world_size={world_size}",
                                      "Pass the number of nodes the ranks are spread over."))
    FSDPPrecision(precision)  # raises the precision error of the strategy
    tp = options.get("tensor_parallel_size", 1)
    if isinstance(tp, int) and not isinstance(tp, bool) and tp > 1 and world_size % tp:
        divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
        shown = ", ".join(map(str, divisors[:12])) + (", ..." if len(divisors) > 12 else "")
        raise ValueError(bad_argument(
            "tensor_parallel_size", tp, f"a divisor of world_size={world_size}: {shown}",
            f"Pass e.g. `tensor_parallel_size={max(d for d in divisors if d <= tp)}`, or plan a world the groups"
            f" fill, e.g. `world_size={-(-world_size // tp) * tp}`.",
            problem=f"{world_size} ranks cannot form tensor-parallel groups of {tp}"))
    if optimizer not in OPTIMIZERS:
        raise ValueError(bad_argument("optimizer", optimizer, ", ".join(map(repr, OPTIMIZERS)),
                                      "Pick the optimizer family closest to yours, e.g. `optimizer='adamw'`."))
    unknown = [k for k in options if k not in STRATEGY_OPTIONS]
    if unknown:
        raise TypeError(bad_argument(unknown[0], options[unknown[0]], ", ".join(STRATEGY_OPTIONS),
                                     "Pass only the strategy's sharding arguments to the planner.",
                                     problem=f"`{unknown[0]}` is not a planner option"))


def _human(count: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(count) < 1024 or unit == "TiB":
            return f"{count:.1f} {unit}" if unit != "B" else f"{int(count)} B"
        count /= 1024
    return f"{count:.1f} TiB"


def _jsonable(value: Any) -> Any:
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, (list, tuple, set)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):  # per-unit reshard_after_forward, the mapping form of activation checkpointing
        return {k if isinstance(k, str) else _jsonable(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, type):
        return f"{value.__module__}.{value.__qualname__}"
    return repr(value)
