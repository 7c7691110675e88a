"""What would make a plan fit a memory budget, cheapest first, each one planned too.

The order is by what each change costs a run: activation checkpointing costs one extra forward per unit; more ranks
cost devices; mixed precision changes the numerics; CPU offload is the slowest. If no single change fits, the
changes that keep the world size are combined in that order, and then four times the ranks on top.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lightning_fsdp.planner.plan import MAX_WORLD_SIZE, MemoryPlan, plan_memory
from lightning_fsdp.planner.step import BatchSource, ModelSource

__all__ = ["Suggestion", "suggest"]


@dataclass
class Suggestion:
    change: str  # what to change, in the strategy's own words, e.g. "activation_checkpointing_policy='auto'"
    plan: MemoryPlan
    fits: bool


def suggest(model: ModelSource, batch: BatchSource, plan: MemoryPlan, budget: int) -> list[Suggestion]:
    """Each single change that could lower ``plan``'s peak, planned; if none fits, the changes combined in order."""
    settings = dict(plan.settings)
    changes = _changes(settings, plan.world_size)
    out: list[Suggestion] = []
    for label, update in changes:
        candidate = _plan(model, batch, {**settings, **update}, plan)
        out.append(Suggestion(label, candidate, candidate.fits(budget)))
    if changes and not any(s.fits for s in out):
        same_size = [(label, update) for label, update in changes if "world_size" not in update]
        more_ranks = [(label, update) for label, update in changes if "world_size" in update][-1:]
        combined: dict[str, Any] = {}
        labels: list[str] = []
        for label, update in same_size + more_ranks:
            combined.update(update)
            labels.append(label)
            if len(labels) == 1:
                continue  # planned above already
            candidate = _plan(model, batch, {**settings, **combined}, plan)
            out.append(Suggestion(" + ".join(labels), candidate, candidate.fits(budget)))
            if candidate.fits(budget):
                break
    return out


def _changes(settings: dict[str, Any], world_size: int) -> list[tuple[str, dict[str, Any]]]:
    changes: list[tuple[str, dict[str, Any]]] = []
    if settings.get("activation_checkpointing_policy") is None:
        units = settings.get("auto_wrap_policy") or "auto"
        changes.append((f"activation_checkpointing_policy={units!r} (the FSDP units)",
                        {"activation_checkpointing_policy": units}))
    for factor in (2, 4):
        if world_size * factor <= MAX_WORLD_SIZE:  # beyond, the planner refuses the world size
            changes.append((f"world_size={world_size * factor}", {"world_size": world_size * factor}))
    if settings.get("precision") in ("32-true", "32", 32, None) and settings.get("mixed_precision") is None:
        changes.append(("precision='bf16-mixed'", {"precision": "bf16-mixed"}))
    if not settings.get("cpu_offload"):
        changes.append(("cpu_offload=True (accelerator memory)", {"cpu_offload": True}))
    return changes


def _plan(model: ModelSource, batch: BatchSource, settings: dict[str, Any], base: MemoryPlan) -> MemoryPlan:
    options = dict(settings)
    world_size = options.pop("world_size", base.world_size)
    precision = options.pop("precision")
    optimizer = options.pop("optimizer")
    if options.pop("loop", "fabric") != "fabric":
        optimizer = "adamw"  # the plan named the LightningModule's own (from `configure_optimizers`), which it uses again
    return plan_memory(model, batch, world_size=world_size, precision=precision, optimizer=optimizer, **options)
