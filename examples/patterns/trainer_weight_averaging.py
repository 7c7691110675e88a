"""Lightning's own EMAWeightAveraging callback with the Trainer on 2 CPU processes, unchanged. The averaged copy is
sharded like the model (1/N per rank), updated shard by shard without communication, swapped in for validation,
copied into the model at the end of fit, and saved and restored with the checkpoints.

    python examples/patterns/trainer_weight_averaging.py
"""

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import EMAWeightAveraging
from torch.utils.data import DataLoader

import lightning_fsdp  # noqa: F401 - registers "fsdp", usable on CPU
from common import TinyLM, batch, lm_loss


class LitLM(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = TinyLM()

    def training_step(self, tokens: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return lm_loss(self.model, tokens)

    def validation_step(self, tokens: torch.Tensor, batch_idx: int) -> None:
        self.log("val_loss", lm_loss(self.model, tokens), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


data = [row for step in range(8) for row in batch(step, 0)]
trainer = Trainer(
    accelerator="cpu", devices=2, strategy="fsdp", max_epochs=2, callbacks=[EMAWeightAveraging(decay=0.9)],
    default_root_dir="checkpoints/weight_averaging", enable_progress_bar=False, logger=False,
)
torch.manual_seed(0)
trainer.fit(LitLM(), DataLoader(data, batch_size=4), DataLoader(data[:8], batch_size=4))
trainer.print(f"validation loss of the averaged weights: {trainer.callback_metrics['val_loss'].item():.4f}")
