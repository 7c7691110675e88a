"""How long `lightning-fsdp plan` takes with its own tracker against torch's ``FSDPMemTracker``.

The planner runs one fake step under ``lightning_fsdp.planner.tracker.StepMemTracker``, which keeps torch's
bookkeeping but visits only the running modules after each op (torch's walks every module it has seen). Both
trackers plan the same model in this one process, alternating from round to round after one warm-up plan each; each
round gives one ratio of the two plan times. The plans themselves are identical (``tests/test_planner.py``).

    python benchmarks/plan_speed.py [--rounds 3] [--json rows.json]
    python benchmarks/plan_speed.py --quick          # a 4-layer model, to check that it works
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "examples"))
sys.path.insert(0, str(HERE))

import train_gpt  # noqa: E402 - the example GPT of the README
from rows import alternate, emit, figure, ratios, timed  # noqa: E402

from lightning_fsdp.planner import plan_memory, step, tracker  # noqa: E402

# name -> (GPT config, tokens per sequence, world size, activation checkpointing)
CONFIGS = {
    "6.5B GPT, 32 checkpointed blocks, 8 ranks": (dict(vocab_size=50304, block_size=2048, n_layer=32, n_head=32,
                                                       n_embd=4096), 2048, 8, True),
    "6.5B GPT, 32 blocks, 8 ranks": (dict(vocab_size=50304, block_size=2048, n_layer=32, n_head=32, n_embd=4096),
                                     2048, 8, False),
}
QUICK = {"4-layer GPT, checkpointed, 2 ranks": (dict(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=64),
                                                64, 2, True)}


def plan_time(config: dict, tokens: int, world_size: int, checkpointed: bool, kind: type) -> float:
    step.TRACKER = kind
    policy = {train_gpt.Block}
    return timed(lambda: plan_memory(lambda: train_gpt.GPT(train_gpt.GPTConfig(**config)),
                                     lambda: torch.randint(0, config["vocab_size"], (1, tokens)),
                                     world_size=world_size, auto_wrap_policy=policy,
                                     activation_checkpointing_policy=policy if checkpointed else None))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="a small model, to check that the script works")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    start = time.perf_counter()
    rows = []
    for name, (config, tokens, world_size, checkpointed) in (QUICK if args.quick else CONFIGS).items():
        sides = {kind.__name__: (lambda k=kind: plan_time(config, tokens, world_size, checkpointed, k))
                 for kind in (tracker.StepMemTracker, tracker.TorchMemTracker)}
        for side in sides.values():  # warm-up: first-use imports and caches
            side()
        seconds = alternate(args.rounds, sides)
        rows.append(figure(f"plan time, planner's tracker vs torch's ({name})",
                           ratios(seconds["StepMemTracker"], seconds["FSDPMemTracker"]),
                           baseline="torch's FSDPMemTracker, same plan", target=("<=", 1.0),
                           detail={"seconds": seconds["StepMemTracker"],
                                   "baseline_seconds": seconds["FSDPMemTracker"]}))
    step.TRACKER = tracker.StepMemTracker
    print(f"{args.rounds} rounds, {time.perf_counter() - start:.0f} s")
    emit(rows, args.json)


if __name__ == "__main__":
    main()
