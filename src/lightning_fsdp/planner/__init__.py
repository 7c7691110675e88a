"""Know before launch whether a model fits: the memory of one training step on each rank, planned on fake tensors.

    from lightning_fsdp.planner import plan_memory
    plan = plan_memory(lambda: GPT(config), lambda: torch.randint(0, 50304, (8, 1024)), world_size=8,
                       precision="bf16-mixed", auto_wrap_policy={Block})
    print(plan.render())          # breakdown, where the peak is, per-unit table
    plan.peak_bytes               # {rank: bytes} of the planned ranks, 0 and the last; plan.peak_of(rank)

From a shell: ``lightning-fsdp plan --model mypkg.models:build --inputs mypkg.models:batch --world-size 8``
(``--help`` lists the options, named as the strategy's arguments). :mod:`.step` runs the planned step,
:mod:`.plan` reports it, :mod:`.suggest` finds what would make it fit a budget.

A feature. May import: the checkpoint layer (for the command's shared option parsing), the engine (it shards the
model with the strategy's own code) and ``lightning_fsdp._base``. Never the fronts.
"""

from lightning_fsdp.planner.plan import MAX_WORLD_SIZE, STRATEGY_OPTIONS, MemoryPlan, plan_memory
from lightning_fsdp.planner.step import PlanningError
from lightning_fsdp.planner.suggest import Suggestion, suggest

__all__ = ["plan_memory", "MemoryPlan", "suggest", "Suggestion", "STRATEGY_OPTIONS", "MAX_WORLD_SIZE", "PlanningError"]
