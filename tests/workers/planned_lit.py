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


# --- the three LightningModules whose plans tests/test_planner.py holds to 3% of the real Trainer step -------------

VOCAB, DIM = 256, 64


class GPTBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln, self.attn, self.proj = nn.LayerNorm(DIM), nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)
        self.up, self.down = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.attn(self.ln(x)).view(b, t, 3, 4, DIM // 4).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, DIM)
        x = x + self.proj(y)
        return x + self.down(F.gelu(self.up(x)))


class TinyGPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(GPTBlock() for _ in range(2))
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class GPTLit(L.LightningModule):
    """Embedding and head outside the blocks (they stay with the root), tokens in, cross-entropy out."""

    def __init__(self) -> None:
        super().__init__()
        self.model = TinyGPT()

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return F.cross_entropy(self.model(batch).reshape(-1, VOCAB), batch.reshape(-1))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class WideLit(L.LightningModule):
    """Weights far larger than the activations of its small batch: gradients and optimizer state make the peak."""

    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256))

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.model(batch).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class ManualGPTLit(GPTLit):
    """``GPTLit`` in manual optimization: ``zero_grad`` first, as Lightning's docs write it."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        opt = self.optimizers()
        opt.zero_grad()
        loss = F.cross_entropy(self.model(batch).reshape(-1, VOCAB), batch.reshape(-1))
        self.manual_backward(loss)
        opt.step()
        return loss.detach()


def tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (4, 32))


def wide_batch() -> torch.Tensor:
    return torch.randn(2, 256)


# name: (LightningModule class, batch factory, auto_wrap_policy, accumulate_grad_batches)
MEASURED = {
    "mlp_blocks": (PlannedLit, batch, {Block}, 1),
    "gpt": (GPTLit, tokens, {GPTBlock}, 1),
    "wide": (WideLit, wide_batch, None, 1),
    "mlp_blocks_accumulating_3": (PlannedLit, batch, {Block}, 3),
    "gpt_manual_optimization": (ManualGPTLit, tokens, {GPTBlock}, 1),
}
