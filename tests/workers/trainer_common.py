"""Shared pieces of the Trainer workers: the LightningModule, the data, the Trainer, and the single-process reference
that trains on the same global batches the ranks see together."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
import torchmetrics
from lightning.pytorch import LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from common import VOCAB, full, loss_fn
from harness import TIMEOUT, assert_close
from lightning_fsdp.trainer import FSDPStrategy
from models import TinyTransformer

WORLD = 2
BATCH = 2
SEQ = 8
SAMPLES = 16  # 4 steps per epoch on 2 ranks
ATOL = 1e-5


class Tokens(Dataset):
    """Random token sequences, the same on every rank; item ``i`` depends only on ``i``."""

    def __init__(self, n: int = SAMPLES, offset: int = 0) -> None:
        self.n, self.offset = n, offset

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(7919 * (i + self.offset) + 1)
        return torch.randint(0, VOCAB, (SEQ + 1,), generator=g)


def loader(n: int = SAMPLES, offset: int = 0, batch_size: int = BATCH) -> DataLoader:
    return DataLoader(Tokens(n, offset), batch_size=batch_size)


def sgd(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def adamw(params) -> torch.optim.Optimizer:
    # A larger eps than torch's 1e-8: some gradients here are zero but for rounding (the attention's key bias), and
    # Adam would turn that rounding noise into full-size steps that no two summation orders agree on.
    return torch.optim.AdamW(params, lr=1e-2, eps=1e-4)


def plain_sgd(params) -> torch.optim.Optimizer:
    # Without momentum, low-precision runs do not amplify rounding differences from step to step.
    return torch.optim.SGD(params, lr=0.2)


OPTIMIZERS = {"sgd": sgd, "adamw": adamw, "plain_sgd": plain_sgd}


class LitGPT(LightningModule):
    """TinyTransformer trained as a language model. The model is built in ``configure_model`` (seeded, so every rank
    and the reference start equal) unless ``build_in_init``; metrics are torchmetrics objects."""

    def __init__(self, optimizer: str = "sgd", scheduler: bool = False, build_in_init: bool = False) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model: Optional[nn.Module] = None
        if build_in_init:
            torch.manual_seed(0)
            self.model = TinyTransformer()
        self.val_mean = torchmetrics.MeanMetric()
        self.test_mean = torchmetrics.MeanMetric()
        self.seen: list[torch.Tensor] = []

    def configure_model(self) -> None:
        if self.model is None:
            torch.manual_seed(0)
            self.model = TinyTransformer()

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        self.seen.append(batch.clone())
        loss = loss_fn(self.model, batch)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def _per_sample(self, batch: torch.Tensor) -> torch.Tensor:
        logits = self.model(batch[:, :-1]).float()
        return F.cross_entropy(logits.transpose(1, 2), batch[:, 1:], reduction="none").mean(1)

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        losses = self._per_sample(batch)
        self.log("val_loss", losses.mean(), sync_dist=True)
        self.val_mean.update(losses)
        self.log("val_metric", self.val_mean)

    def test_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        losses = self._per_sample(batch)
        self.log("test_loss", losses.mean(), sync_dist=True)
        self.test_mean.update(losses)
        self.log("test_metric", self.test_mean)

    def predict_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.model(batch[:, :-1])

    def configure_optimizers(self) -> Any:
        optimizer = OPTIMIZERS[self.hparams.optimizer](self.parameters())
        if not self.hparams.scheduler:
            return optimizer
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def make_trainer(strategy: Optional[FSDPStrategy] = None, devices: int = WORLD, **kwargs: Any) -> Trainer:
    options: dict[str, Any] = dict(
        accelerator="cpu", devices=devices, max_epochs=2, enable_progress_bar=False, logger=False,
        enable_checkpointing=False, enable_model_summary=False, num_sanity_val_steps=0,
    )
    options.update(kwargs)
    return Trainer(strategy=strategy or FSDPStrategy(timeout=TIMEOUT), **options)


def strategy(**kwargs: Any) -> FSDPStrategy:
    kwargs.setdefault("timeout", TIMEOUT)
    return FSDPStrategy(**kwargs)


# --- the single-process reference ---------------------------------------------------------------------------


def rank_indices(n: int, epoch: int, rank: int, world: int = WORLD) -> list[int]:
    """The order Trainer's injected DistributedSampler gives a rank: it shuffles (seed 0, ``set_epoch``) even for a
    DataLoader that does not."""
    sampler = DistributedSampler(range(n), num_replicas=world, rank=rank, shuffle=True, seed=0)
    sampler.set_epoch(epoch)
    return list(sampler)


def rank_batches(epoch: int, rank: int, world: int = WORLD, n: int = SAMPLES) -> list[torch.Tensor]:
    data, order = Tokens(n), rank_indices(n, epoch, rank, world)
    return [torch.stack([data[i] for i in order[s:s + BATCH]]) for s in range(0, len(order), BATCH)]


def global_batches(epoch: int, world: int = WORLD, n: int = SAMPLES) -> list[torch.Tensor]:
    per_rank = [rank_batches(epoch, r, world, n) for r in range(world)]
    return [torch.cat(step) for step in zip(*per_rank)]


def reference_fit(
    epochs: int,
    make_optimizer: Callable = sgd,
    *,
    accumulate: int = 1,
    clip: Optional[tuple[float, str]] = None,
    init: Optional[dict[str, torch.Tensor]] = None,
    scheduler: bool = False,
    autocast: Optional[torch.dtype] = None,
    world: int = WORLD,
    samples: int = SAMPLES,
) -> tuple[nn.Module, list[float]]:
    """Train TinyTransformer on one process as the Trainer does on ``WORLD`` ranks: same global batches, same
    accumulation (loss divided by the number of micro-batches), clipping before the step. Returns the model and the
    clipping norms seen (to show that clipping was active)."""
    torch.manual_seed(0)
    model = TinyTransformer()
    if init is not None:
        model.load_state_dict(init)
    opt = make_optimizer(model.parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5) if scheduler else None
    norms = []
    for epoch in range(epochs):
        batches = global_batches(epoch, world, samples)
        for i, batch in enumerate(batches):
            with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
                loss = loss_fn(model, batch)
            (loss / accumulate).backward()
            if (i + 1) % accumulate and i + 1 < len(batches):
                continue
            if clip is not None and clip[1] == "norm":
                norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip[0]).item())
            elif clip is not None:
                norms.append(max(p.grad.abs().max().item() for p in model.parameters()))
                torch.nn.utils.clip_grad_value_(model.parameters(), clip[0])
            opt.step()
            opt.zero_grad()
            if sched is not None:
                sched.step()
    return model, norms


def gathered(module: nn.Module) -> dict[str, torch.Tensor]:
    """Full tensors of a (possibly sharded) module's state, on every rank (a collective)."""
    return {k: full(v).detach().clone() for k, v in module.state_dict().items()}


def compare_params(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], atol: float) -> float:
    assert sorted(got) == sorted(expected), f"keys differ: {sorted(set(got) ^ set(expected))[:6]}"
    return max(assert_close(got[k], expected[k], atol, k) for k in expected)


def assert_trained(reference: nn.Module) -> float:
    """A run that trained nothing would match a reference that trained nothing."""
    torch.manual_seed(0)
    initial = TinyTransformer().state_dict()
    moved = max((v - initial[k]).abs().max().item() for k, v in reference.state_dict().items())
    assert moved > 1e-3, f"the reference did not train (max change {moved:.3e})"
    return moved
