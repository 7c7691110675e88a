"""Two-rank cases: a module or a parameter shared by two top-level models of a LightningModule (issue 37, item 5).

``encoder.embed is decoder.embed`` (a shared submodule), or ``decoder.head.weight is encoder.embed.weight`` (one
tied parameter across the two). Each top-level model would be a root unit of its own on the Trainer front, and both
would claim the shared parameters (torch failed with "Cannot concatenate overlapping meshes" or "FSDP state has
already been lazily initialized"). One root over both needs one forward that calls both, which ``training_step`` is
not: the strategy refuses the layout at setup, naming the shared module and the fix, and the fix (both models held by
one module, as a Fabric script holds them) trains like one process, ties intact, and round-trips checkpoints of both
formats. Fabric trains the same models. A tie that ``auto_wrap_policy`` would split between two units is refused on
both fronts (the first unit sharded would take the parameter and leave the other holder the old tensor).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch import nn
from torch.distributed.fsdp import FSDPModule

from common import make_fabric
from harness import case, run_cases
from trainer_common import ATOL, compare_params, gathered, global_batches, loader, make_trainer, sgd, strategy

VOCAB, DIM = 32, 16  # VOCAB as in `Tokens`
OUT = Path(os.environ.get("LFSDP_TEST_OUT", "."))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x))


class Encoder(nn.Module):
    def __init__(self, embed: nn.Embedding) -> None:
        super().__init__()
        self.embed, self.block = embed, Block()

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.block(self.embed(idx))


class Decoder(nn.Module):
    def __init__(self, embed: nn.Embedding) -> None:
        super().__init__()
        self.embed, self.block, self.head = embed, Block(), nn.Linear(DIM, VOCAB)

    def forward(self, memory: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(memory + self.embed(idx)))


def models(tie: str) -> tuple[Encoder, Decoder]:
    """``tie="module"``: one embedding in both; ``"parameter"``: the decoder's head is the encoder's embedding."""
    torch.manual_seed(0)
    embed = nn.Embedding(VOCAB, DIM)
    encoder = Encoder(embed)
    decoder = Decoder(embed if tie == "module" else nn.Embedding(VOCAB, DIM))
    if tie == "parameter":
        decoder.head.weight = encoder.embed.weight
    return encoder, decoder


def loss_of(encoder: nn.Module, decoder: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    logits = decoder(encoder(batch[:, :-1]), batch[:, :-1])
    return F.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1))


class SharedLit(LightningModule):
    """The two models as top-level children (``held="apart"``: refused), or held by one ``EncoderDecoder``
    (``held="together"``: the fix the refusal names)."""

    def __init__(self, tie: str, held: str = "together") -> None:
        super().__init__()
        if held == "apart":
            self.encoder, self.decoder = models(tie)
        else:
            self.model = EncoderDecoder(tie)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        if hasattr(self, "model"):
            return self.model(batch)
        return loss_of(self.encoder, self.decoder, batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return sgd(self.parameters())


class EncoderDecoder(nn.Module):
    """The same two models held by one module, as a Fabric script holds them."""

    def __init__(self, tie: str) -> None:
        super().__init__()
        self.encoder, self.decoder = models(tie)

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        return loss_of(self.encoder, self.decoder, batch)


def tied(module: nn.Module, tie: str) -> bool:
    module = getattr(module, "model", module)
    if tie == "module":
        return module.encoder.embed is module.decoder.embed
    return module.decoder.head.weight is module.encoder.embed.weight


def reference(tie: str, epochs: int) -> dict[str, torch.Tensor]:
    """One process, the global batches of both ranks, SGD: what the Trainer and Fabric must both reach."""
    model = EncoderDecoder(tie)
    opt = sgd(model.parameters())
    for epoch in range(epochs):
        for batch in global_batches(epoch):
            model(batch).backward()
            opt.step()
            opt.zero_grad()
    return model.state_dict()


def _trainer_case(tie: str, policy) -> dict:
    """Per format: train one epoch (tie and parity checked), save, resume a fresh model from the file for a second
    epoch (tie and parity with two epochs of one process checked)."""
    out = {}
    for state_dict_type in ("full", "sharded"):
        lit = SharedLit(tie)
        trainer = make_trainer(strategy(auto_wrap_policy=policy, state_dict_type=state_dict_type), max_epochs=1)
        trainer.fit(lit, loader())
        assert tied(lit, tie), "the tie did not survive setup"
        trained = compare_params(gathered(lit.model), reference(tie, 1), ATOL)
        roots = sorted(n for n, m in lit.named_modules() if isinstance(m, FSDPModule) and m._get_fsdp_state()._is_root)
        path = OUT / "shared" / f"{tie}_{state_dict_type}.ckpt"
        trainer.save_checkpoint(path)
        fresh = SharedLit(tie)
        with torch.no_grad():
            for p in fresh.parameters():
                p.zero_()  # nothing of the first run's values survives but through the file
        resumed = make_trainer(strategy(auto_wrap_policy=policy, state_dict_type=state_dict_type), max_epochs=2)
        resumed.fit(fresh, loader(), ckpt_path=path)
        assert tied(fresh, tie), f"the tie did not survive resuming from a {state_dict_type} checkpoint"
        out[state_dict_type] = {"trained": trained, "resumed": compare_params(gathered(fresh.model), reference(tie, 2), ATOL),
                                "roots": roots}
    return out


def _refused(tie: str) -> str:
    try:
        make_trainer(strategy(auto_wrap_policy={Block}), max_epochs=1).fit(SharedLit(tie, held="apart"), loader())
    except ValueError as err:
        return str(err)
    raise AssertionError("two top-level models sharing parameters were not refused")


@case
def a_submodule_shared_by_two_top_level_models_is_refused_naming_it():
    message = _refused("module")
    assert "share parameters (the module `encoder.embed` is `decoder.embed`)" in message, message
    assert "HINT" in message and "self.model = EncoderDecoder(self.encoder, self.decoder)" in message, message
    return message


@case
def a_parameter_tied_across_two_top_level_models_is_refused_naming_it():
    message = _refused("parameter")
    assert "share parameters (the parameter `encoder.embed.weight` is `decoder.head.weight`)" in message, message
    return message


@case
def the_fix_trains_a_shared_submodule_like_one_process_and_round_trips_both_formats():
    return _trainer_case("module", {Block})


@case
def the_fix_trains_a_tied_parameter_like_one_process_and_round_trips_both_formats():
    return _trainer_case("parameter", {Block})


@case
def fabric_trains_the_same_models_held_by_one_module():
    results = {}
    for tie in ("module", "parameter"):
        fabric = make_fabric(dist.get_world_size() if dist.is_initialized() else 2)
        model = EncoderDecoder(tie)
        model, opt = fabric.setup(model, sgd(model.parameters()))
        assert tied(model.module if hasattr(model, "module") else model, tie)
        for epoch in range(2):
            for batch in global_batches(epoch):
                local = batch.chunk(dist.get_world_size())[dist.get_rank()]
                fabric.backward(model(local))
                opt.step()
                opt.zero_grad()
        results[tie] = compare_params(gathered(model), reference(tie, 2), ATOL)
    return results


@case
def a_tie_split_between_two_units_is_refused_on_both_fronts():
    """``auto_wrap_policy={nn.Linear}`` makes the decoder's head a unit of its own, while its weight is the encoder's
    embedding: the first unit sharded would take the parameter and leave the other holder the old tensor."""
    messages = {}
    try:
        make_trainer(strategy(auto_wrap_policy={nn.Linear}), max_epochs=1).fit(SharedLit("parameter"), loader())
    except ValueError as err:
        messages["trainer"] = str(err)
    model = EncoderDecoder("parameter")
    try:
        make_fabric(dist.get_world_size(), auto_wrap_policy={nn.Linear}).setup(model)
    except ValueError as err:
        messages["fabric"] = str(err)
    for front, message in messages.items():
        assert "encoder.embed.weight` and `" in message and "decoder.head.weight` are one parameter" in message, message
        assert "HINT" in message, message
    assert sorted(messages) == ["fabric", "trainer"], messages
    return messages


if __name__ == "__main__":
    run_cases()
