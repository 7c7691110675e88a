"""Train a tiny GPT with the Lightning Trainer and lightning-fsdp's FSDPStrategy, configured from YAML.

    python examples/cli_train.py fit --config configs/fsdp_cpu.yaml
    python examples/cli_train.py fit --config configs/fsdp_cpu.yaml --trainer.max_steps=20
    torchrun --nproc_per_node=2 examples/cli_train.py fit --config configs/fsdp_cpu.yaml
    python examples/cli_train.py fit --help

Everything comes from LightningCLI: the config file sets the Trainer, the strategy
(`trainer.strategy: {class_path: lightning_fsdp.trainer.FSDPStrategy, init_args: {...}}`), the model and the data,
and any value can be overridden on the command line. Lightning's launcher starts the other processes by running
this script again (or torchrun starts them). Nothing is downloaded: the data is a made-up, learnable language.

Read it top to bottom: data, model, LightningModule, main().
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.cli import LightningCLI
from torch.utils.data import DataLoader, Dataset

import lightning_fsdp  # noqa: F401 - importing registers the strategy names ("fsdp", "hsdp", ...) with the Trainer

# ------------------------------------------------------------------------------------------------------------------
# Data: sequences of a tiny language in which every token is the sum of the two before it, modulo the vocabulary.
# A model that learns the rule predicts all but the first two tokens of a sequence exactly.
# ------------------------------------------------------------------------------------------------------------------


class FibonacciTokens(Dataset):
    def __init__(self, num_samples: int, seq_len: int, vocab_size: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, vocab_size, (num_samples, 2), generator=g)
        tokens = torch.zeros(num_samples, seq_len + 1, dtype=torch.long)
        tokens[:, :2] = start
        for t in range(2, seq_len + 1):
            tokens[:, t] = (tokens[:, t - 1] + tokens[:, t - 2]) % vocab_size
        self.tokens = tokens

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.tokens[i]


class TokenData(LightningDataModule):
    def __init__(self, vocab_size: int = 64, seq_len: int = 32, batch_size: int = 8, train_samples: int = 2048,
                 val_samples: int = 128) -> None:
        super().__init__()
        self.save_hyperparameters()

    def setup(self, stage: str) -> None:
        h = self.hparams
        self.train = FibonacciTokens(h.train_samples, h.seq_len, h.vocab_size, seed=0)
        self.val = FibonacciTokens(h.val_samples, h.seq_len, h.vocab_size, seed=1)

    def train_dataloader(self) -> DataLoader:
        # The Trainer puts a DistributedSampler in, so each process sees its own part.
        return DataLoader(self.train, batch_size=self.hparams.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val, batch_size=self.hparams.batch_size)


# ------------------------------------------------------------------------------------------------------------------
# Model: token and position embeddings, a stack of torch's own transformer blocks with a causal mask, a linear head.
# The blocks are `torch.nn.TransformerEncoderLayer`, so the YAML can name them by their dotted path in the
# strategy's policies. GELU, as in GPT-2, rather than the layer's default ReLU: a smooth activation keeps runs that
# round differently (sharded or split layers against one process) within the tests' tolerances; at ReLU's kink a
# rounding difference switches a unit on or off.
# ------------------------------------------------------------------------------------------------------------------


class TinyGPT(nn.Module):
    def __init__(self, vocab_size: int, seq_len: int, dim: int, layers: int, heads: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, dim)
        self.pos = nn.Embedding(seq_len, dim)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, activation="gelu", batch_first=True,
                                       norm_first=True)
            for _ in range(layers)
        )
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab_size)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.embed(idx) + self.pos(torch.arange(t, device=idx.device))
        mask = nn.Transformer.generate_square_subsequent_mask(t, device=idx.device)
        for block in self.blocks:
            x = block(x, src_mask=mask, is_causal=True)
        return self.head(self.norm(x))


class GPTModule(LightningModule):
    def __init__(self, vocab_size: int = 64, seq_len: int = 32, dim: int = 64, layers: int = 4, heads: int = 4,
                 lr: float = 3e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model: nn.Module | None = None

    def configure_model(self) -> None:
        # Called by the Trainer once the processes are up; the strategy then shards the model, one FSDP unit per
        # class in `auto_wrap_policy`, and `training_step` calls it as `self.model(...)`.
        if self.model is None:
            h = self.hparams
            self.model = TinyGPT(h.vocab_size, h.seq_len, h.dim, h.layers, h.heads)

    def _loss(self, batch: torch.Tensor) -> torch.Tensor:
        logits = self.model(batch[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), batch[:, 1:].reshape(-1))

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch), prog_bar=True, sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        # Built after sharding, from the sharded parameters.
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


def main() -> None:
    LightningCLI(GPTModule, TokenData, save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    main()
