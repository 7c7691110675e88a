"""Empty initialization (``init_module(empty_init=True)``) gives what the model's own construction gives.

Each case builds a model under empty init on 2 ranks, sets it up (sharding, then per-shard materialization) and
compares every parameter and buffer with the same model built normally in this process: positions that construction
makes deterministic (equal under two seeds: norm weights, zero biases, padding rows, ``inv_freq``) must match
exactly; the rest must have the same distribution (mean and std within bounds set by the sample size).
"""

from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F
from lightning.pytorch import Callback, LightningModule
from litgpt import GPT, Config
from litgpt.model import Block
from torch import nn
from torch.distributed.tensor import DTensor
from transformers import LlamaConfig, LlamaForCausalLM

from common import full, make_fabric
from harness import assert_close, case, run_cases
from lightning_fsdp._base.compat import CheckpointWrapper
from models import TinyTransformer, fill_with_half
from trainer_common import loader, make_trainer, strategy

WORLD = 2
ATOL = 1e-5


def llama_config(tie: bool = True) -> LlamaConfig:
    return LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, tie_word_embeddings=tie, pad_token_id=3)


def litgpt_config() -> Config:
    return Config(n_layer=2, n_head=4, n_embd=32, block_size=16, vocab_size=64, padded_vocab_size=64)


def tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer, gathered to full tensors (a collective for the sharded ones)."""
    named = {**dict(model.named_parameters(remove_duplicate=False)), **dict(model.named_buffers())}
    return {k: full(v).detach().clone() for k, v in named.items()}


DRAWS = 12  # reference constructions: their pooled values give the distribution's std and kurtosis precisely
SMALL = 2000  # tensors with fewer random values than this are judged pooled, not one by one


def compare_with_construction(model: nn.Module, build) -> dict:
    """Check ``model`` (set up from empty init) against ``build()`` run normally under DRAWS seeds.

    Positions equal in every draw (norm weights, zero biases, padding rows) must match exactly. The rest must come
    from the same distribution: each tensor's values are standardized by the mean and std of its DRAWS reference
    draws; a tensor of at least SMALL values is then checked alone, and all smaller ones (biases: a few dozen values
    each, where one tensor's std could only be judged to within about +-100%) are pooled by the last part of their
    name (all the small ``bias`` tensors in one sample, all the small ``weight`` ones in another)."""
    got = tensors(model)
    draws = []
    for seed in range(1, DRAWS + 1):
        torch.manual_seed(seed)
        draws.append(tensors(build()))
    first = draws[0]
    assert sorted(got) == sorted(first), sorted(set(got) ^ set(first))
    report = {"exact": 0, "distribution": 0, "pooled": 0}
    pooled: dict[str, tuple[list, list]] = {}
    for name, ref in first.items():
        value = got[name]
        assert value.shape == ref.shape and value.dtype == ref.dtype, (name, value.shape, ref.shape)
        fixed = torch.stack([d[name] == ref for d in draws]).all(0)
        if fixed.any():  # deterministic positions: exactly what construction gives
            assert torch.equal(value[fixed], ref[fixed]), f"{name}: deterministic values differ"
            report["exact"] += 1
        if (~fixed).any():
            refs = torch.stack([d[name][~fixed].double() for d in draws])
            mean, std = refs.mean(), refs.std()
            z, z_ref = (value[~fixed].double() - mean) / std, (refs - mean) / std
            if z.numel() >= SMALL:
                _same_distribution(name, z, z_ref.flatten())
                report["distribution"] += 1
            else:
                group = pooled.setdefault(name.rsplit(".", 1)[-1], ([], []))
                group[0].append(z)
                group[1].append(z_ref.flatten())
                report["pooled"] += 1
    for kind, (zs, z_refs) in pooled.items():
        _same_distribution(f"the {len(zs)} small {kind!r} tensors pooled", torch.cat(zs), torch.cat(z_refs))
    return report


def _same_distribution(name: str, got: torch.Tensor, ref: torch.Tensor) -> None:
    """``got`` (n values) against ``ref`` (many more, so its moments are taken as exact), both standardized by the
    reference: 6 standard errors of the mean, and of the std, whose standard error depends on the kurtosis
    (sqrt((k - 1) / 4n): 0.71/sqrt(n) for a normal, 0.45/sqrt(n) for a uniform)."""
    n = got.numel()
    sigma = ref.std().item()
    kurtosis = (((ref - ref.mean()) / sigma) ** 4).mean().item()
    mean_tol = 6 * sigma / math.sqrt(n)
    std_tol = 6 * math.sqrt(max(kurtosis - 1, 0.1) / (4 * n))
    assert abs(got.mean().item() - ref.mean().item()) <= mean_tol, f"{name}: mean {got.mean():.4g} vs {ref.mean():.4g}"
    ratio = got.std().item() / sigma
    assert abs(ratio - 1) <= std_tol, f"{name}: std ratio {ratio:.3f}, allowed 1 +- {std_tol:.3f} (n={n})"


def assert_shards_differ(weight: torch.Tensor) -> None:
    rows = weight.shape[0] // 2
    assert not torch.equal(weight[:rows], weight[rows: 2 * rows]), "both ranks drew the same numbers"


# --- Hugging Face ---------------------------------------------------------------------------------------------------


def _empty_llama(fabric, tie: bool) -> nn.Module:
    with fabric.init_module(empty_init=True):
        model = LlamaForCausalLM(llama_config(tie))
    assert all(p.is_meta for p in model.parameters())
    assert not any(b.is_meta for b in model.buffers()), "buffers are built for real under empty init"
    return fabric.setup_module(model)


@case
def hf_llama_matches_its_own_construction():
    fabric = make_fabric(WORLD)
    report = {}
    for tie in (True, False):
        model = _empty_llama(fabric, tie).module
        assert (model.lm_head.weight is model.model.embed_tokens.weight) == tie, "tying changed"
        report[f"tie={tie}"] = compare_with_construction(model, lambda: LlamaForCausalLM(llama_config(tie)))
        embed = full(model.model.embed_tokens.weight)
        assert abs(embed.std().item() / 0.02 - 1) < 0.1, embed.std()  # HF's initializer_range, not N(0, 1)
        assert torch.equal(embed[3], torch.zeros(32)), "padding row"
        assert_shards_differ(embed)
        report[f"tie={tie}"]["embed_std"] = embed.std().item()
    return report


@case
def hf_llama_parity_and_generate_against_one_process():
    fabric = make_fabric(WORLD)
    model = _empty_llama(fabric, tie=True)
    reference = LlamaForCausalLM(llama_config(True))
    reference.load_state_dict({k: full(v) for k, v in model.module.state_dict().items()})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    for step in range(3):
        batch = torch.randint(4, 64, (2 * WORLD, 9), generator=g)
        mine = batch[2 * fabric.global_rank: 2 * fabric.global_rank + 2]
        fabric.backward(model(input_ids=mine, labels=mine).loss)
        opt.step()
        opt.zero_grad()
        reference(input_ids=batch, labels=batch).loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
    sharded = model.module
    assert sharded.lm_head.weight is sharded.model.embed_tokens.weight, "training untied the embeddings"
    diff = max(assert_close(full(p), dict(reference.named_parameters())[n], ATOL, n)
               for n, p in sharded.named_parameters())
    prompt = torch.tensor([[5, 9, 17, 33]])
    out = sharded.generate(prompt, max_new_tokens=6, do_sample=False)
    expected = reference.generate(prompt, max_new_tokens=6, do_sample=False)
    assert torch.equal(out, expected), (out, expected)
    return {"param_diff": diff, "generated": out.tolist()}


# --- litgpt, torch's modules, user modules -----------------------------------------------------------------------


@case
def litgpt_gpt_matches_its_own_construction():
    fabric = make_fabric(WORLD, auto_wrap_policy={Block})
    with fabric.init_module(empty_init=True):
        model = GPT(litgpt_config())
    model = fabric.setup_module(model).module
    report = compare_with_construction(model, lambda: GPT(litgpt_config()))
    assert_shards_differ(full(model.transformer.wte.weight))
    return report


class TorchLayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(32, 4, batch_first=True)
        self.layer = nn.TransformerEncoderLayer(32, 4, dim_feedforward=64, batch_first=True)
        self.bn = nn.BatchNorm1d(32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(x, x, x, need_weights=False)[0]
        return self.bn(self.layer(x).transpose(1, 2)).transpose(1, 2)


@case
def torch_modules_match_their_own_construction():
    fabric = make_fabric(WORLD, auto_wrap_policy={nn.TransformerEncoderLayer})
    with fabric.init_module(empty_init=True):
        model = TorchLayers()
    model = fabric.setup_module(model).module
    # `_reset_parameters` zeroes `out_proj.bias` after `out_proj`'s own reset drew it.
    for attn in (model.attn, model.layer.self_attn):
        assert torch.equal(full(attn.out_proj.bias), torch.zeros(32)) and torch.equal(full(attn.in_proj_bias),
                                                                                    torch.zeros(96))
    return compare_with_construction(model, TorchLayers)


class UserModule(nn.Module):
    """A parameter filled by `reset_parameters()`, and a buffer computed in `__init__` that nothing recomputes."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 16)
        self.gain = nn.Parameter(torch.empty(16))
        self.register_buffer("table", torch.arange(16.0).sin() * 3, persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.constant_(self.gain, 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x) * self.gain + self.table


@case
def user_module_with_reset_parameters_and_computed_buffer():
    fabric = make_fabric(WORLD)
    with fabric.init_module(empty_init=True):
        model = UserModule()
    model = fabric.setup_module(model).module
    return compare_with_construction(model, UserModule)


# --- param_init_fn and the uninitialized error --------------------------------------------------------------------


class NoReset(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))


def _with_no_reset(fabric) -> nn.Module:
    with fabric.init_module(empty_init=True):
        model = TinyTransformer()
        model.extra = NoReset()
    return model


@case
def uninitialized_tensor_is_an_error():
    fabric = make_fabric(WORLD)
    try:
        fabric.setup_module(_with_no_reset(fabric))
    except RuntimeError as err:
        message = str(err)
        assert "extra.scale (NoReset)" in message and "reset_parameters()" in message, message
        assert "param_init_fn='skip'" in message and "HINT" in message, message
    else:
        raise AssertionError("a parameter no initializer wrote was accepted")
    # The loader's switch: allocate only, no error, nothing left on meta.
    fabric = make_fabric(WORLD, param_init_fn="skip")
    model = fabric.setup_module(_with_no_reset(fabric))
    assert not any(t.is_meta for t in (*model.parameters(), *model.buffers()))
    return message


@case
def param_init_fn_replaces_the_initializers():
    report = {}
    for form in (fill_with_half, "models.fill_with_half"):
        fabric = make_fabric(WORLD, param_init_fn=form)
        model = fabric.setup_module(_with_no_reset(fabric))
        for name, param in model.named_parameters():
            assert isinstance(param, DTensor) and torch.equal(full(param), torch.full_like(full(param), 0.5)), name
        report[str(form)] = "all 0.5"
    # A function that leaves a tensor unwritten is refused the same way.
    fabric = make_fabric(WORLD, param_init_fn=lambda module: None)
    try:
        fabric.setup_module(_with_no_reset(fabric))
    except RuntimeError as err:
        assert "`param_init_fn`" in str(err) and "embed.weight (Embedding)" in str(err), str(err)
    else:
        raise AssertionError("an unwritten tensor after param_init_fn was accepted")
    return report


# --- under tensor parallelism: (shard=1, tp=2) on the 2 ranks ------------------------------------------------------

# litgpt models carry no plan of their own: split the MLP (its attention's q, k and v are one fused Linear).
LITGPT_TP_PLAN = {"transformer.h.*.mlp.fc": "colwise", "transformer.h.*.mlp.proj": "rowwise"}


def _logits(output):
    return output.logits if hasattr(output, "logits") else output


def _tensor_parallel_empty_init(build, policy, plan) -> dict:
    """Empty init split over a tensor-parallel group of 2: the same distribution as construction (the split
    pieces each drawn on their own, what TP replicates equal on both ranks), then two steps from that start match one
    process started from the same weights (both ranks are one group and see the same batch)."""
    fabric = make_fabric(WORLD, auto_wrap_policy=policy, tensor_parallel_size=2, tensor_parallel_plan=plan)
    with fabric.init_module(empty_init=True):
        module = build()
    model = fabric.setup_module(module)
    split = [n for n, p in model.named_parameters() if isinstance(p, DTensor)
             and "tp" in (p.device_mesh.mesh_dim_names or ()) and p.placements[-1].is_shard()]
    assert split, "the plan split nothing"
    params = dict(model.named_parameters())
    for name in split:  # each rank's piece drawn on its own: one seed for both would repeat the piece
        local = params[name].to_local().detach().contiguous()
        pieces = [torch.empty_like(local) for _ in range(WORLD)]
        torch.distributed.all_gather(pieces, local)
        assert not torch.equal(pieces[0], pieces[1]) or not local.abs().sum(), f"{name}: both ranks drew one piece"
    report = compare_with_construction(model.module, build)
    start = {k: full(v).detach().clone() for k, v in model.module.state_dict().items()}
    reference = build()
    reference.load_state_dict(start)
    opt = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-4))
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, eps=1e-4)
    for step in range(2):
        ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(step))
        for net, optimizer, backward in ((model, opt, fabric.backward), (reference, ref_opt, torch.Tensor.backward)):
            logits = _logits(net(ids[:, :-1]))
            backward(F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), ids[:, 1:].reshape(-1)))
            optimizer.step()
            optimizer.zero_grad()
    expected = reference.state_dict()
    diff = max(assert_close(full(v), expected[k], ATOL, k) for k, v in model.module.state_dict().items())
    return {**report, "split": len(split), "max_param_diff_after_two_steps": diff}


@case
def hf_llama_under_tensor_parallel_matches_its_own_construction_and_trains_like_one_process():
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    return _tensor_parallel_empty_init(lambda: LlamaForCausalLM(llama_config(tie=False)), {LlamaDecoderLayer}, "auto")


@case
def litgpt_under_tensor_parallel_matches_its_own_construction_and_trains_like_one_process():
    return _tensor_parallel_empty_init(lambda: GPT(litgpt_config()), {Block}, LITGPT_TP_PLAN)


# --- activation checkpointing on litgpt ---------------------------------------------------------------------------


@case
def litgpt_activation_checkpointing_parity():
    fabric = make_fabric(WORLD, auto_wrap_policy={Block}, activation_checkpointing_policy={Block})
    torch.manual_seed(0)
    plain = GPT(litgpt_config())
    reference = copy.deepcopy(plain)
    model = fabric.setup_module(plain)
    assert sum(isinstance(m, CheckpointWrapper) for m in model.modules()) == 2
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    g = torch.Generator().manual_seed(1)
    for step in range(3):
        batch = torch.randint(0, 64, (2 * WORLD, 9), generator=g)
        mine = batch[2 * fabric.global_rank: 2 * fabric.global_rank + 2]
        fabric.backward(F.cross_entropy(model(mine[:, :-1]).reshape(-1, 64), mine[:, 1:].reshape(-1)))
        opt.step()
        opt.zero_grad()
        F.cross_entropy(reference(batch[:, :-1]).reshape(-1, 64), batch[:, 1:].reshape(-1)).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    ref = dict(reference.named_parameters())
    diff = max(assert_close(full(p), ref[n.replace("._checkpoint_wrapped_module", "")], ATOL, n)
               for n, p in model.module.named_parameters())
    moved = max((ref[n] - p).abs().max().item() for n, p in GPT(litgpt_config()).named_parameters())
    assert moved > 1e-3, "the reference did not train"
    return {"param_diff": diff}


# --- the Trainer front --------------------------------------------------------------------------------------------


class LitLlama(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = None

    def configure_model(self) -> None:
        if self.model is None:
            with self.trainer.init_module(empty_init=True):
                self.model = LlamaForCausalLM(llama_config(True))

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.model(input_ids=batch, labels=batch).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


@case
def trainer_configure_model_builds_hf_under_empty_init():
    seen = {}

    class Initial(Callback):
        def on_train_start(self, trainer, pl_module):
            seen["report"] = compare_with_construction(pl_module.model, lambda: LlamaForCausalLM(llama_config(True)))

    module = LitLlama()
    trainer = make_trainer(strategy(), max_epochs=1, limit_train_batches=2, callbacks=[Initial()])
    trainer.fit(module, loader())
    sharded = module.model
    assert sharded.lm_head.weight is sharded.model.embed_tokens.weight
    assert isinstance(sharded.model.embed_tokens.weight, DTensor)
    out = sharded.generate(torch.tensor([[5, 9, 17]]), max_new_tokens=3, do_sample=False)
    return {**seen["report"], "generated": out.tolist()}


if __name__ == "__main__":
    run_cases()
