"""The Trainer's loop position under fault tolerance (``_fronts/trainer_heal.py``), in this process, with a plain
single-device Trainer: the loop state a live group sends at a window's start, loaded into a fresh Trainer as a heal
loads it, resumes at that window's batch with the counters and the samples of a run that never stopped (mid-epoch and
at an epoch's first batch, on both supported Lightning versions); a group healed inside a window takes the sender's
step count; a loader no cursor can position is refused. The real fault run is tests/test_ft_trainer_fault.py."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset

from lightning_fsdp._fronts.trainer_heal import LoopPosition
from lightning_fsdp.engine.fault_tolerance.config import FaultToleranceError

pytestmark = pytest.mark.single_process

SAMPLES, BATCH, ACCUMULATE, MAX_STEPS = 12, 2, 2, 8  # 6 batches, 3 windows an epoch; 8 steps end in epoch 2


class _Indices(Dataset):
    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int) -> int:
        return index


def _loader() -> DataLoader:
    data = _Indices()
    return DataLoader(data, batch_size=BATCH, sampler=DistributedSampler(data, num_replicas=1, rank=0, seed=0))


def _trainer(callbacks=()):
    from lightning.pytorch import Trainer

    # A validation every window, so one is due where a heal lands (the sender ran it; the healed group must not).
    return Trainer(accelerator="cpu", devices=1, max_steps=MAX_STEPS, accumulate_grad_batches=ACCUMULATE,
                   logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                   callbacks=list(callbacks), val_check_interval=ACCUMULATE, limit_val_batches=1,
                   num_sanity_val_steps=0)


def _fit(trainer, module, loader) -> None:
    trainer.fit(module, loader, DataLoader(list(range(2)), batch_size=2))


def _module():
    from lightning.pytorch import LightningModule

    class Lit(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(1, 1)
            self.seen: list[tuple] = []
            self.validated: list[tuple] = []

        def training_step(self, batch, batch_idx):
            self.seen.append((self.current_epoch, batch_idx, batch.tolist(), self.trainer.global_step))
            return self.layer(batch.float()[:, None]).sum()

        def validation_step(self, batch, batch_idx):
            loop = self.trainer.fit_loop.epoch_loop
            self.validated.append((self.current_epoch, loop.batch_progress.current.completed, self.trainer.global_step,
                                   loop._batches_that_stepped))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    return Lit()


def _counters(trainer) -> dict:
    loop = trainer.fit_loop
    return {"global_step": trainer.global_step, "epoch": trainer.current_epoch,
            "batches": loop.epoch_loop.batch_progress.state_dict(),
            "batches_that_stepped": loop.epoch_loop._batches_that_stepped}


def _live_run() -> tuple[dict, Any, dict]:
    """A run that never stops, sending (as a live group would) the loop state at each window's first batch."""
    from lightning.pytorch import Callback

    sent = {}

    class Sender(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            if batch_idx % ACCUMULATE == 0:  # the strategy takes it at every batch; a window's first one is sent
                position.snapshot(at_batch_start=True)
                sent[trainer.current_epoch, batch_idx] = copy.deepcopy(position.produce())

    trainer = _trainer([Sender()])
    position = LoopPosition(trainer)
    module = _module()
    _fit(trainer, module, _loader())
    return sent, module, _counters(trainer)


@pytest.mark.parametrize("window", [(1, 2), (1, 0)], ids=["mid-epoch", "epoch-start"])
def test_a_healed_loop_resumes_at_the_senders_batch_with_its_counters_and_samples(window):
    sent, live, final = _live_run()
    trainer = _trainer()
    healed = LoopPosition(trainer)
    healed.load(sent[window])  # before the fit loop runs, as at the first window's quorum
    loader = healed.wrap_training_loader(_loader())  # what `FSDPStrategy.process_dataloader` does
    module = _module()
    _fit(trainer, module, loader)
    start = next(i for i, (epoch, batch_idx, *_) in enumerate(live.seen) if (epoch, batch_idx) == window)
    assert module.seen == live.seen[start:], (module.seen[:3], live.seen[start:start + 3])
    # The validations after the heal's first batch, with their counters; not the one due before it, which ran there.
    assert module.validated == [v for v in live.validated if v[:2] > window], (module.validated, live.validated)
    assert module.validated and _counters(trainer) == final
    assert healed.healed


def test_a_loop_restored_from_a_mid_epoch_checkpoint_reads_on_from_its_batch():
    # What `_FitLoop.run`'s wrapper does for a group that did not heal but resumes from `ckpt_path`: Lightning loaded
    # the loops (a mid-epoch ModelCheckpoint's state is the form a heal sends); without the cursor it would read the
    # epoch from its first batch again.
    sent, live, final = _live_run()
    trainer = _trainer()
    trainer.fit_loop.load_state_dict(sent[1, 4])
    position = LoopPosition(trainer)
    position.align_cursor_with_loop()
    module = _module()
    _fit(trainer, module, position.wrap_training_loader(_loader()))
    start = next(i for i, (epoch, batch_idx, *_) in enumerate(live.seen) if (epoch, batch_idx) == (1, 4))
    assert module.seen == live.seen[start:] and _counters(trainer) == final
    assert not position.healed


def test_a_group_healed_inside_a_window_counts_the_senders_steps():
    sent, _, _ = _live_run()
    trainer = _trainer()
    lagging = LoopPosition(trainer)
    lagging._snapshot = copy.deepcopy(sent[1, 2])  # its own window started at the same batch
    lagging._running = True
    from lightning.pytorch.loops.progress import _ReadyCompletedTracker, _Progress

    for committed, want in ((True, 5), (False, 4)):
        lagging.load(sent[1, 2])
        step = _Progress.from_defaults(_ReadyCompletedTracker, ready=3, completed=3)  # a step behind the sender's 4
        lagging.after_vote(step, committed)
        assert step.total.completed == step.total.ready == want, step
    lagging.after_vote(step, True)  # nothing healed in this window: the count is left alone
    assert step.total.completed == want
    elsewhere = copy.deepcopy(sent[1, 4])
    with pytest.raises(FaultToleranceError, match=r"its loop is at \(epoch, batches\) \(1, 8\) while the group it heals"
                                                  r" from is at \(1, 10\).*HINT: let this group's launcher restart it"):
        lagging.load(elsewhere)


def test_a_loop_state_of_another_shape_is_refused_before_anything_is_loaded():
    sent, _, _ = _live_run()
    trainer = _trainer()
    position = LoopPosition(trainer)
    broken = copy.deepcopy(sent[1, 2])
    broken["epoch_loop.batch_progress"]["total"]["ready"] = "12"
    with pytest.raises(FaultToleranceError, match=r"epoch_loop\.batch_progress\.total\.ready is '12' \(str\); this"
                                                  r" Trainer's loop holds an int"):
        position.load(broken)
    del broken["epoch_progress"]
    with pytest.raises(FaultToleranceError, match=r"The healed loop state at loop has keys"):
        position.load(broken)
    assert trainer.global_step == 0 and not trainer.fit_loop.restarting and not position.healed


def test_a_training_loader_no_cursor_can_position_is_refused_with_the_fix():
    class Stream(IterableDataset):
        def __iter__(self):
            return iter(range(4))

    with pytest.raises(ValueError, match=r"Invalid `train_dataloaders='DataLoader\(batch_sampler=BatchSampler,"
                                         r" sampler=_InfiniteConstantSampler\)'`"
                                         r".*only a sampler of indices can be"
                                         r" positioned.*HINT: Train from a map-style Dataset"):
        LoopPosition(None).wrap_training_loader(DataLoader(Stream(), batch_size=2))


def test_a_second_fit_wraps_the_loaders_own_sampler_again_not_the_cursor():
    position = LoopPosition(None)
    loader = _loader()
    inner = loader.batch_sampler.sampler
    wrapped = position.wrap_training_loader(position.wrap_training_loader(loader))
    assert wrapped.batch_sampler.sampler is position.sampler and position.sampler.sampler is inner
    assert loader.batch_sampler.sampler is inner  # the fit reads a copy; the user's loader is left as it is


# Review of this session's diff (2026-11-29): the fixes below each failed on the code before them.

class _Group:
    """A replica group's window, with no torchft: what the strategy's batch hook and the fit loop's wrapper use."""

    def __init__(self) -> None:
        self.window_open, self.windows, self.manager = False, 0, None

    def begin_window(self) -> None:
        if not self.window_open:
            self.window_open, self.windows = True, self.windows + 1

    def commit(self) -> bool:
        self.window_open = False
        return True


def test_the_strategy_snapshots_the_loop_only_when_a_window_opens():
    """With gradient accumulation, a live group heals at its window's vote (the window's last batch) and compares its
    own snapshot with the sender's, taken at the window's first batch: a snapshot at every batch made the two differ
    and the heal was refused."""
    from types import SimpleNamespace

    from lightning_fsdp.trainer import FSDPStrategy

    taken = []
    position = SimpleNamespace(snapshot=lambda at_batch_start: taken.append(group.windows))
    group = _Group()
    strategy = SimpleNamespace(replica_group=group, _loop_position=position)
    for batch_idx in range(4):  # two windows of two batches, each ended by its vote
        FSDPStrategy.on_train_batch_start(strategy, None, batch_idx)
        if batch_idx % 2 == 1:
            group.commit()
    assert taken == [0, 1], taken  # once before each window's quorum, not at its second batch


def test_a_peers_loop_counter_out_of_range_is_refused_before_anything_is_loaded():
    sent, _, _ = _live_run()
    trainer = _trainer()
    position = LoopPosition(trainer)
    for value in (-2, 10**30):
        broken = copy.deepcopy(sent[1, 2])
        broken["epoch_progress"]["current"]["processed"] = value
        with pytest.raises(FaultToleranceError, match=r"epoch_progress\.current\.processed is -?\d+; a loop counter is"
                                                      r" an int in \[-1, "):
            position.load(broken)
    assert trainer.global_step == 0 and not trainer.fit_loop.restarting and not position.healed


def test_the_users_loader_gets_its_own_sampler_back_after_the_fit():
    from types import SimpleNamespace

    from lightning_fsdp._fronts.trainer_heal import _first_window_before_the_loop

    position = LoopPosition(None)
    loader = _loader()
    inner = loader.batch_sampler.sampler
    seen = []

    def fit_loop_run(self):  # the fit: the strategy wraps the loader, then the loop stops mid-epoch
        wrapped = position.wrap_training_loader(loader)
        position.sampler.seek(0, 4)
        seen.append(wrapped.batch_sampler.sampler is position.sampler and loader.batch_sampler.sampler is inner)

    finished = SimpleNamespace(max_steps=1, max_epochs=-1, epoch_loop=SimpleNamespace(global_step=1))
    finished.trainer = SimpleNamespace(strategy=SimpleNamespace(_loop_position=position,
                                                                replica_group=_Group()))
    _first_window_before_the_loop(fit_loop_run)(finished)
    assert seen == [True] and loader.batch_sampler.sampler is inner and position.sampler is None
    assert sum(len(b) for b in loader) == len(inner)  # iterated again, the whole epoch
