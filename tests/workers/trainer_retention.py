"""``ModelCheckpoint(save_top_k=1)`` with ``async_save=True`` deletes the previous checkpoint only after the new one is
committed. Each background write is held for a moment, so a deletion that did not wait would be seen."""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

from common import loss_fn
from harness import TIMEOUT, case, run_cases
from lightning_fsdp.checkpoint.formats.layout import is_sharded_checkpoint
from lightning_fsdp.checkpoint.integrity.sharded_write import ChecksumWriter
from lightning_fsdp.trainer import FSDPStrategy
from models import TinyTransformer


class Lit(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = TinyTransformer()

    def training_step(self, batch, batch_idx):
        return loss_fn(self.model, batch[0])

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.randint(0, 32, (8, 9))), batch_size=2)


class Look(Callback):
    """At each step's end, before that step's ModelCheckpoint: the committed checkpoints on disk."""

    def __init__(self, directory: Path) -> None:
        self.directory, self.seen = directory, []

    def on_train_batch_end(self, trainer, *args) -> None:
        trainer.strategy.barrier()
        self.seen.append(sorted(p.name for p in self.directory.glob("*.ckpt") if is_sharded_checkpoint(p)))


@case
def save_top_k_waits_for_the_commit():
    original = ChecksumWriter.write_data

    def slow(self, plan, planner):
        time.sleep(0.5)  # in DCP's background thread: the commit comes half a second later
        return original(self, plan, planner)

    ChecksumWriter.write_data = slow
    directory = Path(os.environ["LFSDP_TEST_OUT"]) / "ckpts"
    look = Look(directory)
    checkpoint = ModelCheckpoint(dirpath=directory, save_top_k=1, every_n_train_steps=1, monitor=None)
    trainer = Trainer(accelerator="cpu", devices=2, max_steps=4, strategy=FSDPStrategy(state_dict_type="sharded",
                      async_save=True, timeout=TIMEOUT), callbacks=[checkpoint, look], logger=False,
                      enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Lit())
    ChecksumWriter.write_data = original
    # Lightning runs checkpoint callbacks last, so `seen[i]` is the disk after step i-1's ModelCheckpoint: from the
    # second save on, which deletes the first, a committed checkpoint must always be there.
    assert len(look.seen) == 4 and all(look.seen[2:]), look.seen
    return look.seen


@case
def save_top_k_leaves_exactly_k_in_both_save_modes():
    """``ModelCheckpoint(save_top_k=2)`` over 5 steps leaves exactly the 2 best (here: the newest, monitoring the
    step) once fit returns, with background and synchronous saves; each background write is held a moment, so a
    removal that ran before the commit of the save superseding it, or one lost when it was queued, would show."""
    original = ChecksumWriter.write_data

    def slow(self, plan, planner):
        time.sleep(0.2)
        return original(self, plan, planner)

    report = {}
    for label, background in (("async", True), ("sync", False)):
        ChecksumWriter.write_data = slow if background else original
        directory = Path(os.environ["LFSDP_TEST_OUT"]) / f"top-k-{label}"
        look = Look(directory)
        checkpoint = ModelCheckpoint(dirpath=directory, save_top_k=2, every_n_train_steps=1, monitor="step",
                                     mode="max")
        trainer = Trainer(accelerator="cpu", devices=2, max_steps=5,
                          strategy=FSDPStrategy(state_dict_type="sharded", async_save=background, timeout=TIMEOUT),
                          callbacks=[checkpoint, look], logger=False, enable_progress_bar=False,
                          enable_model_summary=False)
        trainer.fit(Lit())
        ChecksumWriter.write_data = original
        trainer.strategy.barrier()
        left = sorted(p.name for p in directory.iterdir())
        steps = sorted(int(name.split("step=")[1].split(".")[0]) for name in left)
        assert steps == [4, 5] and all(is_sharded_checkpoint(directory / n) for n in left), (label, left)
        # `seen[i]` is the disk after step i-1's save (the first may still be in flight at seen[1]): from the second
        # save on, a committed checkpoint is always there, and never more than k.
        assert len(look.seen) == 5 and all(1 <= len(names) <= 2 for names in look.seen[2:]), (label, look.seen)
        report[label] = {"left": left, "seen": look.seen}
    return report


def _full_weights(module) -> dict:
    """Every parameter and buffer gathered whole (a collective: every rank calls it)."""
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
            for k, v in module.state_dict().items()}


class SeenStep(Callback):
    """The step a fit resumed from, and the weights it started from (after the restore) and ended with."""

    def __init__(self) -> None:
        self.loaded = None
        self.start = self.end = None

    def on_load_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        self.loaded = checkpoint["global_step"]

    def on_train_start(self, trainer, pl_module) -> None:
        self.start = _full_weights(pl_module)

    def on_train_end(self, trainer, pl_module) -> None:
        self.end = _full_weights(pl_module)


@case
def latest_after_a_rollback_is_the_save_the_run_went_on_from():
    """Issue 37 item 3 on the Trainer front, sharded and full: save steps 2 and 4, roll back to step 2 by path and
    save step 3; `ckpt_path="<dir>/latest"` resumes from step 3 (committed last), not from the abandoned step 4."""
    report = {}
    for kind in ("sharded", "full"):
        directory = Path(os.environ["LFSDP_TEST_OUT"]) / f"rollback-{kind}"

        def fit(max_steps, ckpt_path=None) -> SeenStep:
            seen = SeenStep()
            checkpoint = ModelCheckpoint(dirpath=directory, filename="{step}", save_top_k=-1, every_n_train_steps=1,
                                         monitor=None)
            trainer = Trainer(accelerator="cpu", devices=2, max_steps=max_steps,
                              strategy=FSDPStrategy(state_dict_type=kind, timeout=TIMEOUT), callbacks=[checkpoint, seen],
                              logger=False, enable_progress_bar=False, enable_model_summary=False)
            trainer.fit(Lit(), ckpt_path=ckpt_path)
            trainer.strategy.barrier()
            return seen

        # One run saves steps 1 to 4 (the commits 1, 2, 3, 4, as a run to step 2 and its resume to step 4 would
        # make them, one Trainer start cheaper); step 4 is the one the rollback abandons.
        abandoned = fit(4).end
        rolled_back = fit(3, directory / "step=2.ckpt").end  # the rollback: step 3 again, committed last
        resumed = fit(4, directory / "latest")
        report[kind] = {"loaded": resumed.loaded, "files": sorted(p.name for p in directory.iterdir())}
        assert resumed.loaded == 3, (kind, resumed.loaded, sorted(p.name for p in directory.iterdir()))
        # The step counter alone would pass a resume that restored the step and not the weights: the run starts
        # from exactly the weights the rollback saved at step 3, which are not the abandoned step 4's.
        assert not all(torch.equal(abandoned[k], rolled_back[k]) for k in rolled_back), kind
        different = sorted(k for k in rolled_back if not torch.equal(resumed.start[k], rolled_back[k]))
        assert resumed.start.keys() == rolled_back.keys() and not different, (kind, different[:5])
    return report


if __name__ == "__main__":
    run_cases()
