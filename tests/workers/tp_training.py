"""The data, single-process references and training loops that the tensor-parallel workers share
(``tensor_parallel.py``, ``tp_patterns.py``): a (shard=2, tp=2) mesh on 4 ranks, over the models of ``tp_models.py``."""

from __future__ import annotations

from typing import Any, Callable

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, Dataset

from common import full, make_fabric
from harness import TIMEOUT, assert_close
from lightning_fsdp.trainer import FSDPStrategy as TrainerFSDPStrategy
from tp_models import SEQ, VOCAB

WORLD, TP = 4, 2
DP = WORLD // TP
BATCH = 2  # per data-parallel rank
ATOL = 1e-5


def tokens(step: int, dp_rank: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1000 * step + dp_rank))


def global_tokens(step: int) -> torch.Tensor:
    return torch.cat([tokens(step, r) for r in range(DP)])


def logits_of(output: Any) -> torch.Tensor:
    return output.logits if hasattr(output, "logits") else output


def loss_of(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits_of(model(batch[:, :-1])).reshape(-1, VOCAB).float(), batch[:, 1:].reshape(-1))


def reference(build: Callable[[], nn.Module], steps: int, max_norm: float = 0.0) -> tuple[nn.Module, list, list]:
    torch.manual_seed(0)
    model = build()
    opt = adamw(model.parameters())
    losses, norms = [], []
    for step in range(steps):
        loss = loss_of(model, global_tokens(step))
        loss.backward()
        if max_norm:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm).item())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return model, losses, norms


def adamw(params) -> torch.optim.Optimizer:
    # eps 1e-4, not 1e-8: the key bias's gradient is zero but for rounding (softmax ignores a constant added to every
    # key), and Adam would turn that rounding noise, which no two summation orders share, into full-size steps.
    return torch.optim.AdamW(params, lr=1e-2, eps=1e-4)


def dp_rank() -> int:
    return dist.get_rank() // TP


def compare(model: nn.Module, ref: nn.Module, label: str) -> dict:
    got = {k: full(v).detach() for k, v in model.state_dict().items()}
    expected = ref.state_dict()
    assert sorted(got) == sorted(expected), f"{label}: keys differ {sorted(set(got) ^ set(expected))[:5]}"
    diff = max(assert_close(got[k], expected[k], ATOL, f"{label} {k}") for k in expected)
    return {"max_param_diff": diff}


def two_d_params(model: nn.Module) -> int:
    """How many parameters are DTensors over both the data-parallel and the tensor-parallel axis."""
    return sum(1 for p in model.parameters() if isinstance(p, DTensor) and "tp" in (p.device_mesh.mesh_dim_names or ()))


# --- Fabric -------------------------------------------------------------------------------------------------------


def fabric_train(build, policy, plan, steps: int = 3, max_norm: float = 0.0, **kwargs) -> tuple:
    fabric = make_fabric(WORLD, auto_wrap_policy=policy, tensor_parallel_size=TP, tensor_parallel_plan=plan, **kwargs)
    torch.manual_seed(0)
    module = build()
    model, opt = fabric.setup(module, adamw(module.parameters()))
    losses, norms = [], []
    for step in range(steps):
        loss = loss_of(model, tokens(step, dp_rank()))
        fabric.backward(loss)
        if max_norm:
            norms.append(fabric.clip_gradients(model, opt, max_norm=max_norm).item())
        opt.step()
        opt.zero_grad()
        # Every rank's loss is its data-parallel rank's mean: the mean over ranks is the global mean.
        losses.append(fabric.all_reduce(loss.detach(), reduce_op="mean").item())
    return fabric, model, opt, losses, norms


# --- Trainer ------------------------------------------------------------------------------------------------------


class Tokens(Dataset):
    """Sample ``i`` is row ``i % BATCH`` of data-parallel rank ``(i // BATCH) % DP``'s batch of step ``i // (BATCH*DP)``,
    so the sampler's data-parallel shards, unshuffled, are exactly the Fabric side's batches."""

    def __len__(self) -> int:
        # Twice the 3 steps trained: a sampler that split the data over all 4 ranks would still fill 3 full steps,
        # and fail the batch check rather than stop short.
        return 6 * BATCH * DP

    def __getitem__(self, i: int) -> torch.Tensor:
        step, rest = divmod(i, BATCH * DP)
        return tokens(step, rest % DP)[rest // DP]


class Lit(L.LightningModule):
    def __init__(self, build: Callable[[], nn.Module]) -> None:
        super().__init__()
        self.build, self.seen = build, []

    def configure_model(self) -> None:
        if not hasattr(self, "model"):
            torch.manual_seed(0)
            self.model = self.build()

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        self.seen.append(batch.clone())
        return loss_of(self.model, batch)

    def configure_optimizers(self) -> Any:
        return adamw(self.parameters())


def trainer_fit(build, policy, plan, callbacks: tuple = ()) -> Lit:
    lit = Lit(build)
    trainer = L.Trainer(
        accelerator="cpu", devices=WORLD, max_steps=3, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=list(callbacks),
        strategy=TrainerFSDPStrategy(auto_wrap_policy=policy, tensor_parallel_size=TP, tensor_parallel_plan=plan,
                                     timeout=TIMEOUT),
    )
    trainer.fit(lit, DataLoader(Tokens(), batch_size=BATCH))
    return lit


def check_peers_saw_the_same_batches(lit: Lit) -> list[torch.Tensor]:
    """Every rank's batches; the two ranks of a tensor-parallel group must have seen the same ones, the two
    data-parallel ranks different ones."""
    mine = torch.stack(lit.seen)
    gathered = [torch.empty_like(mine) for _ in range(WORLD)]
    dist.all_gather(gathered, mine)
    for rank in range(WORLD):
        peer = rank ^ 1  # the other rank of the same tensor-parallel group
        assert torch.equal(gathered[rank], gathered[peer]), f"ranks {rank} and {peer} (one tp group) saw different batches"
    assert not torch.equal(gathered[0], gathered[2]), "both data-parallel ranks saw the same batches"
    return gathered


def reference_on(build, gathered: list[torch.Tensor]) -> nn.Module:
    """One process trained on each step's global batch: the data-parallel ranks' batches (ranks 0 and 2) in order."""
    torch.manual_seed(0)
    model = build()
    opt = adamw(model.parameters())
    for step in range(gathered[0].shape[0]):
        loss_of(model, torch.cat([gathered[r][step] for r in range(0, WORLD, TP)])).backward()
        opt.step()
        opt.zero_grad()
    return model
