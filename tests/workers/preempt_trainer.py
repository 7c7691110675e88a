"""A Trainer fit with :class:`PreemptionCallback`, signalled at a chosen step; run one process per rank.

Environment: ``LFSDP_PRE_ROOT`` (``default_root_dir``); ``LFSDP_PRE_SIGNAL`` = ``<signal>:<ranks>:<global_step>``
(sent by the rank to itself at the start of that training step; ranks ``0``, ``1`` or ``0+1``);
``LFSDP_PRE_RESUME`` = ``auto`` (no ``ckpt_path``: under SLURM Lightning picks the hpc checkpoint) or a
``ckpt_path`` such as ``last``. Rank 0 writes ``<root>/result.json`` (where it started, the final global step) and
``<root>/final.pt`` (the full weights) when ``fit`` returns.

The data: 2 batches per rank and epoch, shuffled by the injected ``DistributedSampler``. The signals in the tests land
in the last step of an epoch, because Lightning restores a mid-epoch position only for stateful data loaders.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import torch
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from common import full, loss_fn
from harness import TIMEOUT
from lightning_fsdp.trainer import FSDPStrategy
from lightning_fsdp.trainer_preemption import PreemptionCallback
from models import TinyTransformer

ROOT = Path(os.environ["LFSDP_PRE_ROOT"])
RANK = int(os.environ.get("SLURM_PROCID", os.environ.get("RANK", "0")))
SIGNAL = os.environ.get("LFSDP_PRE_SIGNAL", "")
RESUME = os.environ.get("LFSDP_PRE_RESUME", "auto")


class Lit(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = TinyTransformer()
        self.started_at = None

    def training_step(self, batch, batch_idx):
        if self.started_at is None:
            self.started_at = self.global_step
        if SIGNAL:
            name, ranks, step = SIGNAL.split(":")
            if int(step) == self.global_step and str(RANK) in ranks.split("+"):
                (ROOT / f"signalled.rank{RANK}").write_text(str(self.global_step))
                os.kill(os.getpid(), getattr(signal, name))
        return loss_fn(self.model, batch[0])

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def train_dataloader(self):
        data = torch.randint(0, 32, (8, 9), generator=torch.Generator().manual_seed(7))
        return DataLoader(TensorDataset(data), batch_size=2)


def main() -> None:
    torch.set_num_threads(1)
    plugins = [SLURMEnvironment(auto_requeue=True)] if "SLURM_JOB_ID" in os.environ else []
    trainer = Trainer(
        accelerator="cpu", devices=2, max_epochs=5, default_root_dir=ROOT, plugins=plugins,
        strategy=FSDPStrategy(state_dict_type="sharded", timeout=TIMEOUT),
        callbacks=[PreemptionCallback(), ModelCheckpoint(dirpath=ROOT / "checkpoints", save_last=False)],
        logger=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    )
    lit = Lit()
    trainer.fit(lit, ckpt_path=None if RESUME == "auto" else RESUME)
    weights = {k: full(v).detach().clone() for k, v in lit.model.state_dict().items()}
    if RANK == 0:
        torch.save(weights, ROOT / "final.pt")
        (ROOT / "result.json").write_text(json.dumps({"started_at": lit.started_at, "global_step": trainer.global_step}))


if __name__ == "__main__":
    main()
