"""One replica group of one rank, trained with ``Trainer(strategy=FSDPStrategy(fault_tolerance=...))``, for
``tests/test_ft_trainer_fault.py``'s fault run.

    python ft_trainer_fault.py REPLICA_ID OUT_DIR MAX_STEPS [KILL]

``KILL`` is ``PHASE@N`` with PHASE backward or optimizer: the process SIGKILLs itself N committed steps after its first
window (where a restarted attempt heals), in the backward of the window's second batch (a hook on an activation's
gradient, before the window's cross-group average) or in the optimizer step (a step pre-hook, after the vote).

Every group reads the same data: 16 samples, a sampler of its own that shuffles each epoch (seed 0), 2 samples a
batch, 2 batches a window (``accumulate_grad_batches=2``), momentum SGD and a StepLR stepped per optimizer step. A
sample's input is a function of its index alone, so two groups at the same batch compute the same gradient and their
average is exact: a healed group trains on the live group's batches only if its data position was healed too. A
restarted attempt of group 1 starts from other weights (each parameter + 1) and at step 0, so only a heal makes it
equal. ``min_replicas=2``: a step needs both groups, so group 0 waits in its quorum while group 1 restarts.

Each process appends its pid to ``OUT_DIR/pids<id>``, and at the end writes ``OUT_DIR/group<id>.pt``: the full
weights, ``global_step``, its loop counters, whether it healed its loop before the fit loop started, and one record
per window (epoch, batch indices, each batch's sample indices, the vote).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from ft_common import Net, fault_tolerance, full_weights, record_pid, start_from_other_weights, wait_for, write_record
from lightning_fsdp.trainer import FSDPStrategy

SAMPLES, BATCH, ACCUMULATE = 16, 2, 2


class Indices(Dataset):
    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int) -> int:
        return index


def inputs(ids: torch.Tensor) -> torch.Tensor:
    return torch.stack([torch.randn(6, generator=torch.Generator().manual_seed(int(i))) for i in ids])


def loader() -> DataLoader:
    dataset = Indices()
    return DataLoader(dataset, batch_size=BATCH, sampler=DistributedSampler(dataset, num_replicas=1, rank=0, seed=0))


def optimizers(params):
    optimizer = torch.optim.SGD(params, lr=0.1, momentum=0.9)  # momentum: optimizer state to heal
    return optimizer, torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)


class Lit(LightningModule):
    def __init__(self, kill: str) -> None:
        super().__init__()
        self.net = Net()
        self.phase, _, after = kill.partition("@")
        self.after = int(after) if after else None
        self.first_step = None
        self.batches: list[dict] = []

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        step = self.trainer.global_step
        if self.first_step is None:
            self.first_step = step  # a restarted attempt's first window is its heal
        killing = self.after is not None and step == self.first_step + self.after and batch_idx % ACCUMULATE == 1
        self.net.kill_in = "backward" if killing and self.phase == "backward" else ""
        if killing and self.phase == "optimizer":
            self.trainer.optimizers[0].register_step_pre_hook(lambda *args: os.kill(os.getpid(), signal.SIGKILL))
        self.batches.append({"epoch": self.current_epoch, "batch_idx": batch_idx, "ids": batch.tolist(),
                             "global_step": step})
        return self.net(inputs(batch)).square().mean()

    def configure_optimizers(self):
        optimizer, scheduler = optimizers(self.parameters())
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class Windows(Callback):
    """Each window's vote, at its last batch; group 0 stays in the quorum until group 1 has finished."""

    def __init__(self, replica_id: int, out: Path) -> None:
        self.replica_id, self.out = replica_id, out
        self.votes: list[bool] = []
        self.longest, self._started = 0.0, None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self._started is None:
            self._started = time.monotonic()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.fit_loop._should_accumulate():
            return
        self.votes.append(bool(trainer.strategy.replica_group.committed))
        self.longest = max(self.longest, time.monotonic() - self._started)
        self._started = None

    def on_train_end(self, trainer, pl_module) -> None:
        (self.out / f"done{self.replica_id}").write_text("")
        if self.replica_id == 0:  # the group leaves the quorum at teardown: not before group 1's last step
            wait_for(self.out / "done1")


def main(replica_id: int, out: Path, max_steps: int, kill: str) -> None:
    attempt = record_pid(out, replica_id)
    strategy = FSDPStrategy(fault_tolerance=fault_tolerance(out, replica_id),
                            auto_wrap_policy={nn.Linear})  # units a, b, root net
    windows = Windows(replica_id, out)
    trainer = Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=max_steps,
                      accumulate_grad_batches=ACCUMULATE, use_distributed_sampler=False, callbacks=[windows],
                      logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      num_sanity_val_steps=0)
    torch.manual_seed(0)
    model = Lit(kill)
    if replica_id == 1 and attempt > 1:
        start_from_other_weights(model)
    trainer.fit(model, loader())
    loop = trainer.fit_loop
    write_record(out, replica_id, {
        "weights": full_weights(model.net.state_dict()), "global_step": trainer.global_step, "votes": windows.votes,
        "batches": model.batches,
        "healed": strategy._loop_position.healed, "longest_window_s": windows.longest,
        "loop": {"epoch": trainer.current_epoch, "batches": loop.epoch_loop.batch_progress.state_dict(),
                 "batches_that_stepped": loop.epoch_loop._batches_that_stepped,
                 "lr": trainer.optimizers[0].param_groups[0]["lr"]},
    })


if __name__ == "__main__":
    os.environ.setdefault("RUST_LOG", "warn")
    main(int(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4] if len(sys.argv) > 4 else "")
