"""A LightningModule that ``lightning-fsdp plan`` plans and ``workers/sharded_memory.py`` trains for real, so the
plan of a LightningModule can be held against the measured Trainer step. It imports nothing of the test harness:
the pytest process plans it (a plan needs a process of its own, without a process group)."""

from __future__ import annotations

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn

WIDTH = 128
BATCH, SEQ = 4, 16


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(x)))


class PlannedLit(L.LightningModule):
    """Every parameter inside a ``ModuleList`` of blocks held by ``self.model``, built in ``configure_model``: the
    layout whose units were all roots before."""

    def configure_model(self) -> None:
        if not hasattr(self, "model"):
            self.model = nn.Sequential(*(Block() for _ in range(4)))

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.model(batch).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def batch() -> torch.Tensor:
    return torch.randn(BATCH, SEQ, WIDTH)
