"""The real Trainer steps that ``tests/test_planner.py`` holds the plans of LightningModules against, to 3%: each case
trains one of ``planned_lit.MEASURED`` with the Trainer on this launch's world size (1, 2 and 4 ranks: the script runs
in a launch of each) and returns the peak torch's ``FSDPMemTracker`` saw over one steady-state step (an accumulation
window, for ``accumulate_grad_batches > 1``). ``FSDPMemTracker`` counts the tensors of the step it watches, not the
process, so the script shares the pools of its world sizes: what earlier cases left behind does not enter the figure.
"""

from __future__ import annotations

import os

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader

from harness import TIMEOUT, case, run_cases
from lightning_fsdp._base.compat import planner_tools
from lightning_fsdp.trainer import FSDPStrategy
from planned_lit import MEASURED

# The cases beyond the three modules run on 2 ranks only: the suite's time is short.
TWO_RANKS_ONLY = ("mlp_blocks_accumulating_3", "gpt_manual_optimization")


class WindowPeak(Callback):
    """torch's ``FSDPMemTracker`` over each accumulation window after the first (the optimizer holds its state then,
    and the previous window's gradients are alive, as in every later step), from the window's first
    ``on_train_batch_start`` to its last ``on_train_batch_end``: ``training_step``, ``zero_grad``, backward and
    the optimizer step, as the Trainer orders them. Per-module statistics are cleared between the batches of a
    window, since the tracker follows a root once (the overall peak runs on)."""

    def __init__(self, accumulate: int) -> None:
        self.accumulate = accumulate
        self.peaks: list[int] = []
        self.tracker = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch_idx >= self.accumulate and batch_idx % self.accumulate == 0:
            self.tracker = planner_tools()[2](pl_module.model, trainer.optimizers[0])
            self.tracker.track_inputs((batch,))
            self.tracker.__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.tracker is None:
            return
        if batch_idx % self.accumulate < self.accumulate - 1:
            self.tracker.reset_mod_stats()
            return
        self.tracker.__exit__(None, None, None)
        self.peaks.append(sum(table["Total"] for table in self.tracker.get_tracker_snapshot("peak").values()))
        self.tracker = None


def measure(name: str) -> dict:
    world = int(os.environ["WORLD_SIZE"])
    if name in TWO_RANKS_ONLY and world != 2:
        return {"not_run": "2 ranks only"}
    module_class, batch_fn, policy, accumulate = MEASURED[name]
    torch.manual_seed(0)
    lit = module_class()
    batches = [batch_fn() for _ in range(3 * accumulate)]
    lit.train_dataloader = lambda: DataLoader(batches, batch_size=None)
    peak = WindowPeak(accumulate)
    trainer = L.Trainer(
        accelerator="cpu", devices=world, max_steps=3, accumulate_grad_batches=accumulate, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=False, callbacks=[peak],
        strategy=FSDPStrategy(auto_wrap_policy=policy, timeout=TIMEOUT),
    )
    trainer.fit(lit)
    # The lowest of the two steady-state windows over every rank: gloo's late frees only ever add.
    floor = torch.tensor(min(peak.peaks))
    if world > 1:
        torch.distributed.all_reduce(floor, op=torch.distributed.ReduceOp.MIN)
    return {"tracker_peak": int(floor), "tracker_peaks": peak.peaks, "world_size": world}


@case
def mlp_blocks():
    return measure("mlp_blocks")


@case
def gpt():
    return measure("gpt")


@case
def wide():
    return measure("wide")


@case
def mlp_blocks_accumulating_3():
    return measure("mlp_blocks_accumulating_3")


@case
def gpt_manual_optimization():
    return measure("gpt_manual_optimization")


if __name__ == "__main__":
    run_cases()
