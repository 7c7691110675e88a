"""Which samples a Trainer group trains on under fault tolerance (``_fronts/trainer_heal.py``), in this process with a
plain single-device Trainer and the strategy's own data wiring (``FSDPStrategy.process_dataloader`` and its batch
hook): the same samples as Lightning without fault tolerance, or a refusal with the fix, never other samples in
silence. Reviewer findings F1-F4 (2026-11-29); each test failed on the code before its fix."""

from __future__ import annotations

import copy
import re
from types import SimpleNamespace

import pytest
import torch
from torch.utils.data import (DataLoader, Dataset, DistributedSampler, RandomSampler, SequentialSampler,
                              SubsetRandomSampler)

from lightning_fsdp._fronts.trainer_heal import LoopPosition
from lightning_fsdp.engine.fault_tolerance.data import CursorSampler

pytestmark = pytest.mark.single_process


class _Indices(Dataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        return index


class _Group:
    """No torchft: what the strategy's hooks read of a replica group. The fit loop's wrapper opens the first window
    before the loop starts; this one stays open (no vote closes it), so no batch takes a snapshot."""

    window_open, manager = True, None

    def begin_window(self) -> None:
        self.window_open = True


def _trainer(callbacks=(), **kwargs):
    from lightning.pytorch import Trainer

    return Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                   enable_model_summary=False, num_sanity_val_steps=0, callbacks=list(callbacks), **kwargs)


def _module():
    from lightning.pytorch import LightningModule

    class Lit(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(1, 1)
            self.seen: list[tuple] = []
            self.validated: list[list] = []

        def training_step(self, batch, batch_idx):
            parts = batch.values() if isinstance(batch, dict) else [batch]
            self.seen.append((self.current_epoch, batch_idx, *(part.tolist() for part in parts)))
            return sum(self.layer(part.float()[:, None]).sum() for part in parts)

        def validation_step(self, batch, batch_idx):
            self.validated.append(batch.tolist())

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    return Lit()


def _with_fault_tolerance(trainer, position: LoopPosition) -> None:
    """The strategy's fault-tolerance data wiring on this Trainer: its `process_dataloader` and train hooks."""
    from lightning.pytorch import Callback

    from lightning_fsdp.trainer import FSDPStrategy

    ft = SimpleNamespace(lightning_module=None, _loop_position=position, replica_group=_Group())
    original = trainer.strategy.process_dataloader

    def process_dataloader(dataloader):
        ft.lightning_module = trainer.lightning_module
        return FSDPStrategy.process_dataloader(ft, original(dataloader))

    class Hooks(Callback):
        def on_train_start(self, trainer, pl_module) -> None:
            FSDPStrategy.on_train_start(ft)

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            FSDPStrategy.on_train_batch_start(ft, batch, batch_idx)

    trainer.strategy.process_dataloader = process_dataloader
    trainer.callbacks.append(Hooks())


def test_a_resume_after_an_epochs_last_short_batch_reads_the_next_epoch_from_its_first_sample():
    """F1: 11 samples in batches of 2; a checkpoint after batch 5 (one sample) held 6 batches, 12 > 11 samples: the
    cursor was put 12 samples in, carried to sample 1 of epoch 1, and the resumed run skipped the sample live
    Lightning trains first there."""
    from lightning.pytorch import Callback

    data = _Indices(11)
    saved = {}

    class Saver(Callback):  # what ModelCheckpoint(every_n_train_steps=...) saves at the epoch's last batch
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if batch_idx == 5:
                saved["state"] = copy.deepcopy(trainer.fit_loop.state_dict())

    def loader():
        return DataLoader(data, batch_size=2, sampler=DistributedSampler(data, num_replicas=1, rank=0, seed=0))

    live = _module()
    _trainer([Saver()], max_steps=9, limit_val_batches=0).fit(live, loader())
    trainer = _trainer(max_steps=9, limit_val_batches=0)
    trainer.fit_loop.load_state_dict(saved["state"])  # as Lightning restores `ckpt_path`'s loops
    position = LoopPosition(trainer)
    position.align_cursor_with_loop()  # what the fit loop's wrapper does for a restored loop
    resumed = _module()
    trainer.fit(resumed, position.wrap_training_loader(loader()))
    assert resumed.seen == live.seen[6:], (resumed.seen[:2], live.seen[6:8])


def test_more_than_one_training_loader_is_refused_with_the_fix():
    """F2: two loaders (a CombinedLoader) each read through the one cursor: every other batch of each, mispaired."""
    def loader():
        data = _Indices(8)
        return DataLoader(data, batch_size=2, sampler=SequentialSampler(data))

    from lightning.pytorch.utilities import CombinedLoader

    refusal = (r"Invalid `train_dataloaders='dict of 2 DataLoaders'`\. Every training loader would read through the"
               r" one data position.*Allowed: one training DataLoader under fault_tolerance\. HINT: Train from one"
               r" DataLoader")
    trainer = _trainer(max_epochs=1, limit_val_batches=0)
    position = LoopPosition(trainer)
    _with_fault_tolerance(trainer, position)
    module = _module()
    with pytest.raises(ValueError, match=refusal):
        trainer.fit(module, {"a": loader(), "b": loader()})
    assert module.seen == []  # refused before the first training step
    # Loaders reloaded at an epoch's start (`reload_dataloaders_every_n_epochs`): refused at the next window.
    trainer.fit_loop._combined_loader = CombinedLoader({"a": loader(), "b": loader()})
    with pytest.raises(ValueError, match=refusal):
        position.snapshot(at_batch_start=True)


def test_a_loader_given_for_training_and_validation_reads_its_own_sampler_in_validation():
    """F3: the sampler was swapped on the user's loader object, so the validation loop iterating the same object
    read through the training cursor and moved it: 4 of the epoch's 6 batches were trained."""
    data = _Indices(12)

    def run(fault_tolerant: bool):
        trainer = _trainer(max_epochs=1, val_check_interval=2, limit_val_batches=1)
        loader = DataLoader(data, batch_size=2, sampler=SequentialSampler(data))
        own = loader.batch_sampler.sampler
        if fault_tolerant:
            _with_fault_tolerance(trainer, LoopPosition(trainer))
        module = _module()
        trainer.fit(module, loader, loader)
        return module, loader.batch_sampler.sampler is own

    (plain, _), (fault_tolerant, left_as_it_was) = run(False), run(True)
    assert fault_tolerant.seen == plain.seen and len(plain.seen) == 6, fault_tolerant.seen
    assert fault_tolerant.validated == plain.validated == [[0, 1]] * 3
    assert left_as_it_was  # the fit read a copy of the user's loader


def _wrapper(sampler):
    from lightning.fabric.utilities.distributed import DistributedSamplerWrapper

    return DistributedSamplerWrapper(sampler, num_replicas=1, rank=0, seed=0)


class _ShuffledDistributedSampler(DistributedSampler):
    def __iter__(self):
        return iter(torch.randperm(len(self)).tolist())


_DATA = _Indices(6)


# Samplers whose order is not fixed by the epoch, with how an error names them.
_NOT_FIXED = pytest.mark.parametrize("sampler, shown", [
    (RandomSampler(_DATA), "RandomSampler"),
    (RandomSampler(_DATA, generator=torch.Generator().manual_seed(0)), "RandomSampler"),
    (_wrapper(SubsetRandomSampler(range(6))), "DistributedSamplerWrapper(SubsetRandomSampler)"),
    (_ShuffledDistributedSampler(_DATA, num_replicas=1, rank=0), "_ShuffledDistributedSampler"),
], ids=["random", "seeded-random", "wrapped-subset-random", "distributed-subclass-own-order"])


@_NOT_FIXED
def test_a_sampler_whose_order_is_not_fixed_by_the_epoch_is_refused_with_the_fix(sampler, shown):
    """F4: a healed group draws such an order anew at the heal, from a generator in another state than the live ones:
    8 of 8 heals of a RandomSampler, 5 of 8 of a seeded one, trained on other samples than the live run."""
    with pytest.raises(ValueError, match=rf"Invalid `train_dataloaders='DataLoader\(sampler={re.escape(shown)}\)'`\. A healed"
                                         r" group draws this sampler's order anew at the heal.*Allowed: a training sampler"
                                         r" whose order depends only on the epoch.*HINT: use DistributedSampler\("
                                         r"dataset, shuffle=True, seed=\.\.\.\)"):
        LoopPosition(None).wrap_training_loader(DataLoader(_DATA, batch_size=2, sampler=sampler))


@_NOT_FIXED
def test_a_fabric_scripts_cursor_over_a_sampler_not_fixed_by_the_epoch_is_refused_with_the_fix(sampler, shown):
    """The Fabric front: a script builds its CursorSampler itself, so the class refuses such a sampler as the Trainer
    does (it took any, and a heal then trained on other samples than the live groups')."""
    with pytest.raises(ValueError, match=rf"Invalid `sampler='{re.escape(shown)}'`\. A healed group draws the"
                                         r" sampler's order anew at the heal.*HINT: build it with"
                                         r" `fault_tolerant_sampler\("):
        CursorSampler(sampler)


def test_samplers_whose_order_is_fixed_by_the_epoch_are_read_through_the_cursor():
    from torchft.data import DistributedSampler as TorchftSampler

    for sampler in (SequentialSampler(_DATA), DistributedSampler(_DATA, num_replicas=1, rank=0, seed=3),
                    _wrapper(SequentialSampler(_DATA)), _wrapper(DistributedSampler(_DATA, num_replicas=1, rank=0)),
                    TorchftSampler(_DATA, replica_rank=0, num_replica_groups=1, group_rank=0, num_replicas=1),
                    CursorSampler(DistributedSampler(_DATA, num_replicas=1, rank=0))):
        position = LoopPosition(None)
        loader = position.wrap_training_loader(DataLoader(_DATA, batch_size=2, sampler=sampler))
        assert loader.batch_sampler.sampler is position.sampler and len(list(loader)) == 3
