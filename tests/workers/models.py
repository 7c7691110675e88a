"""Tiny models for the multi-process tests. Small enough that a step takes milliseconds on CPU."""

from __future__ import annotations

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, num_heads=2, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        mask = torch.triu(torch.ones(x.shape[1], x.shape[1], dtype=torch.bool, device=x.device), 1)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(x)


class TinyTransformer(nn.Module):
    def __init__(self, vocab: int = 32, dim: int = 16, layers: int = 2, seq: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(seq, dim))
        self.blocks = nn.ModuleList(Block(dim) for _ in range(layers))
        self.head = nn.Linear(dim, vocab)

    def reset_parameters(self) -> None:
        # Only the parameter this module owns directly; submodules reset their own (needed for meta-device init).
        nn.init.zeros_(self.pos)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx) + self.pos[: idx.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def make_batch(step: int, rank: int, batch: int = 2, seq: int = 8, vocab: int = 32) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, vocab, (batch, seq + 1), generator=g)


class UnevenModel(nn.Module):
    """Parameters whose dim 0 does not divide by 2 ranks, as real models have them (a vocabulary of 50257): a
    vocabulary of 37, a 3-way classification head, and a 1-row parameter that leaves one rank an empty shard.
    FSDP2 pads such shards, and a gathered full tensor is a view into the padded buffer. ``forward`` returns the
    loss, so every parameter gets a gradient and optimizer state."""

    VOCAB = 37

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.lm = TinyTransformer(vocab=self.VOCAB, dim=dim)
        self.cls = nn.Linear(dim, 3)
        self.row = nn.Parameter(torch.randn(1, 5))

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        logits = self.lm(batch[:, :-1]).float()
        lm_loss = nn.functional.cross_entropy(logits.reshape(-1, self.VOCAB), batch[:, 1:].reshape(-1))
        return lm_loss + self.cls(self.lm.embed(batch)).square().mean() + self.row.square().sum()


def fill_with_half(module: nn.Module) -> None:
    """A ``param_init_fn`` for the tests, importable by its dotted path ``models.fill_with_half``."""
    for param in module.parameters(recurse=False):
        param.fill_(0.5)


class Remapped(nn.Module):
    """litgpt's LoRALinear pattern: the base checkpoint says ``weight``, the module keeps it as ``linear.weight``."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x):
        return self.linear(x)

    def _load_from_state_dict(self, sd, prefix, *args, **kwargs):
        for n in ("weight", "bias"):
            if prefix + n in sd:
                sd[prefix + "linear." + n] = sd.pop(prefix + n)
        super()._load_from_state_dict(sd, prefix, *args, **kwargs)


class Odd(nn.Module):
    """Shapes that do not divide by 2 or 4 ranks: a 7x5 weight, a vocabulary of 7, a 1-row weight (whose shard is
    empty on every rank but the first), and a 0-dim buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(7, 5)
        self.proj = nn.Linear(5, 7)
        self.narrow = nn.Linear(7, 1)
        self.register_buffer("scale", torch.tensor(0.5))

    def forward(self, idx):
        return self.narrow(self.proj(self.embed(idx))) * self.scale
