"""After setup, no rank still holds the model it built before sharding.

A model built on the host (no ``empty_init``) is whole on every rank until ``fully_shard`` cuts it. The parameters
it had are then dead weight: each rank should keep only its shard. Anything that keeps a reference to the original
parameter objects keeps the whole model alive beside the shards (on the GPU, once ``fully_shard`` has moved them
there), and training still gives the right numbers. So each case measures memory instead:

- every original parameter object is freed (a weak reference to it is dead after ``gc.collect()``);
- the bytes of all live host tensors grew, from before the model was built, by this rank's share of the model
  (``1 / world``, plus FSDP's padding) after setup, and by that plus AdamW's two moments after a step; never by a
  whole model more.

Fronts and layouts: Fabric's joint ``setup`` with an optimizer built before it, ``setup_module`` with one built
after, ``setup_module`` then ``setup_optimizers`` of one built before; CPU offload; SHARD_GRAD_OP; a Hugging Face
Llama with tied embeddings; the Trainer with the model built in ``__init__``.
"""

from __future__ import annotations

import gc
import weakref
from typing import Any, Callable

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

from common import make_fabric
from harness import TIMEOUT, case, run_cases
from lightning_fsdp.trainer import FSDPStrategy as TrainerFSDPStrategy

DIM = 256
WORLD = 2


class MLPBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(DIM, 4 * DIM)
        self.down = nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(x)))


class Network(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(MLPBlock() for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def tiny_llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=512, hidden_size=DIM, intermediate_size=2 * DIM, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=16,
                         tie_word_embeddings=True)
    return LlamaForCausalLM(config)


def llama_block() -> type:
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    return LlamaDecoderLayer


def live_host_bytes() -> int:
    """The bytes of every live host tensor's storage, each storage counted once (DTensors by their local shard)."""
    gc.collect()
    storages: dict[int, int] = {}
    for obj in gc.get_objects():
        try:
            if not isinstance(obj, torch.Tensor):
                continue
            tensor = obj._local_tensor if isinstance(obj, DTensor) else obj
            if tensor.is_meta or tensor.device.type != "cpu" or tensor.__class__ not in (torch.Tensor, nn.Parameter):
                continue
            storage = tensor.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
        except Exception:  # noqa: BLE001 - an object whose attributes cannot be read holds no tensor we count
            continue
    return sum(storages.values())


class Originals:
    """Weak references to a model's parameters as built, and their total bytes."""

    def __init__(self, model: nn.Module) -> None:
        params = {id(p): p for p in model.parameters()}.values()
        self.refs = [weakref.ref(p) for p in params]
        self.bytes = sum(p.numel() * p.element_size() for p in params)

    def alive(self) -> int:
        gc.collect()
        return sum(ref() is not None for ref in self.refs)


def check_growth(label: str, grown: int, model_bytes: int, shares: float) -> dict:
    """``grown`` must be ``shares`` times this rank's share of the model, within 5% of the whole model (padding,
    FSDP's small buffers), and in particular far below a whole copy more."""
    expected = shares * model_bytes / WORLD
    assert abs(grown - expected) <= 0.05 * model_bytes, (
        f"{label}: live host tensors grew by {grown} bytes; this rank's share times {shares} is {expected:.0f}"
        f" (the whole model is {model_bytes}): {grown / model_bytes:.2f} models are held"
    )
    return {f"{label}_grown_over_model": round(grown / model_bytes, 3)}


def one_step(model: nn.Module, optimizer: torch.optim.Optimizer, fabric, batch: torch.Tensor, loss) -> None:
    fabric.backward(loss(model, batch))
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def features(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).pow(2).mean()


def language_model(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1]).logits
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), tokens[:, 1:].reshape(-1))


def fabric_case(build: Callable[[], nn.Module], how: str, batch: torch.Tensor, loss=features, **strategy: Any) -> dict:
    strategy.setdefault("auto_wrap_policy", {MLPBlock})
    fabric = make_fabric(WORLD, **strategy)
    before = live_host_bytes()
    torch.manual_seed(0)
    model = build()
    originals = Originals(model)
    if how == "joint":
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model, optimizer = fabric.setup(model, optimizer)
    elif how == "module_then_new_optimizer":
        model = fabric.setup_module(model)
        optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-3))
    else:  # an optimizer built before the model was set up alone, then set up on its own
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model = fabric.setup_module(model)
        optimizer = fabric.setup_optimizers(optimizer)
    out = check_growth("after_setup", live_host_bytes() - before, originals.bytes, shares=1)
    alive = originals.alive()
    assert alive == 0, f"{alive} of the {len(originals.refs)} parameters built before setup are still alive"
    one_step(model, optimizer, fabric, batch, loss)
    out.update(check_growth("after_a_step", live_host_bytes() - before, originals.bytes, shares=3))
    return out


@case
def fabric_joint_setup_with_an_optimizer_built_before():
    return fabric_case(Network, "joint", torch.randn(4, DIM))


@case
def fabric_setup_module_then_an_optimizer_of_the_shards():
    return fabric_case(Network, "module_then_new_optimizer", torch.randn(4, DIM))


@case
def fabric_setup_module_then_setup_optimizers_of_one_built_before():
    return fabric_case(Network, "module_then_old_optimizer", torch.randn(4, DIM))


@case
def fabric_cpu_offload():
    return fabric_case(Network, "joint", torch.randn(4, DIM), cpu_offload=True)


@case
def fabric_shard_grad_op():
    return fabric_case(Network, "joint", torch.randn(4, DIM), sharding_strategy="SHARD_GRAD_OP")


@case
def hugging_face_llama_with_tied_embeddings():
    tokens = torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(0))
    return fabric_case(tiny_llama, "joint", tokens, loss=language_model, auto_wrap_policy={llama_block()})


class Measured(L.LightningModule):
    """The model is built in ``__init__`` (on the host, whole), as most LightningModules do."""

    def __init__(self) -> None:
        super().__init__()
        self.model = Network()
        self.originals = Originals(self.model)
        self.readings: dict[str, int] = {}

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.model(batch).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def on_train_start(self) -> None:
        self.readings["alive"] = self.originals.alive()
        self.readings["after_setup"] = live_host_bytes()

    def on_train_batch_end(self, *args: Any) -> None:
        self.readings["after_a_step"] = live_host_bytes()


@case
def trainer_with_the_model_built_in_init():
    before = live_host_bytes()
    lit = Measured()
    data = DataLoader(torch.randn(8, DIM), batch_size=4)
    trainer = L.Trainer(accelerator="cpu", devices=WORLD, max_steps=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
                        strategy=TrainerFSDPStrategy(auto_wrap_policy={MLPBlock}, timeout=TIMEOUT))
    trainer.fit(lit, data)
    readings, model_bytes = lit.readings, lit.originals.bytes
    # The data loader's batches are alive too: a few kilobytes, inside the margin. At the end of a batch the Trainer
    # still holds its gradients (it zeroes them before the next backward): shard, two moments and gradient.
    out = check_growth("after_setup", readings["after_setup"] - before, model_bytes, shares=1)
    out.update(check_growth("after_a_step", readings["after_a_step"] - before, model_bytes, shares=4))
    assert readings["alive"] == 0, f"{readings['alive']} parameters built in __init__ are alive after setup"
    return out


if __name__ == "__main__":
    run_cases()
