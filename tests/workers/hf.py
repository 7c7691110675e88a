"""Hugging Face weights in and out, on two ranks.

In: ``save_pretrained`` output (one file, or an indexed set of files) loads into a tiny Llama built on the meta
device and sharded, through ``fabric.load_raw`` and ``lightning_fsdp.load_pretrained``; every weight must equal,
exactly, what ``from_pretrained`` of the same files gives in one process, and so must ``generate()``. Tied
embeddings, a bf16 file into fp32 parameters and back, missing/unexpected names and shape mismatches are covered.
Out: a Trainer fine-tune saved as a full checkpoint, exported with ``convert --to safetensors`` (prefix stripped),
reads back with ``from_pretrained`` as exactly the trained weights, from one file and from indexed shards.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

import lightning_fsdp
from common import full, make_fabric
from harness import TIMEOUT, case, rank, run_cases
from lightning_fsdp.checkpoint.convert import convert
from lightning_fsdp.trainer import FSDPStrategy as TrainerFSDPStrategy

OUT = Path(os.environ["LFSDP_TEST_OUT"])
PROMPT = torch.tensor([[1, 5, 9, 2, 7]])


def config(**overrides) -> LlamaConfig:
    options = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, tie_word_embeddings=False)
    options.update(overrides)
    return LlamaConfig(**options)


def pretrained(name: str, cfg: LlamaConfig, seed: int, dtype: torch.dtype = torch.float32, **save_kwargs) -> Path:
    """Rank 0 writes a random model with `save_pretrained`; every rank gets the path once it is complete."""
    path = OUT / name
    if rank() == 0:
        torch.manual_seed(seed)
        LlamaForCausalLM(cfg).to(dtype).save_pretrained(path, **save_kwargs)
    dist.barrier()
    return path


def restore_rope(model: LlamaForCausalLM) -> None:
    """Rotary frequencies are a non-persistent buffer: not in the files, and garbage after a meta-device build."""
    rotary = model.model.rotary_emb
    inv_freq, _ = rotary.compute_default_rope_parameters(rotary.config)
    rotary.inv_freq.copy_(inv_freq)
    rotary.original_inv_freq.copy_(inv_freq)


def sharded_llama(fabric, cfg: LlamaConfig, dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    with fabric.init_module(empty_init=True), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = LlamaForCausalLM(cfg).to(dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # RMSNorm and the rotary embedding have no `reset_parameters`
        model = fabric.setup_module(model)
    restore_rope(model.module)
    assert isinstance(model.module.model.layers[0].mlp.up_proj.weight, torch.distributed.tensor.DTensor)
    return model


def assert_exact(model, reference: torch.nn.Module) -> int:
    expected = reference.state_dict()
    got = {k: full(v) for k, v in model.state_dict().items()}
    assert list(got) == list(expected), (list(got), list(expected))
    for name, tensor in expected.items():
        assert got[name].dtype == tensor.dtype, (name, got[name].dtype, tensor.dtype)
        assert torch.equal(got[name], tensor), f"{name} differs from from_pretrained"
    return len(expected)


def assert_same_generation(model, reference: LlamaForCausalLM) -> list[int]:
    with torch.no_grad():
        expected = reference.generate(PROMPT, max_new_tokens=6, do_sample=False, pad_token_id=0)
        got = model.module.generate(PROMPT, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(got, expected), (got, expected)
    return got[0].tolist()


FABRIC = make_fabric(2, auto_wrap_policy={LlamaDecoderLayer}, timeout=TIMEOUT)


@case
def single_file_loads_exactly_and_generates_the_same():
    cfg = config()
    path = pretrained("single", cfg, seed=1)
    model = sharded_llama(FABRIC, cfg)
    FABRIC.load_raw(path / "model.safetensors", model)  # the file itself
    reference = LlamaForCausalLM.from_pretrained(path)
    return {"tensors": assert_exact(model, reference), "tokens": assert_same_generation(model, reference)}


@case
def indexed_directory_loads_exactly():
    cfg = config()
    path = pretrained("indexed", cfg, seed=2, max_shard_size="20KB")
    files = sorted(p.name for p in path.glob("*.safetensors"))
    assert len(files) >= 3 and (path / "model.safetensors.index.json").is_file(), files
    model = sharded_llama(FABRIC, cfg)
    FABRIC.load_raw(path, model)
    reference = LlamaForCausalLM.from_pretrained(path)
    first = assert_exact(model, reference)
    # The helper the Trainer uses reads the same, into a model with other weights.
    other = sharded_llama(FABRIC, cfg)
    report = lightning_fsdp.load_pretrained(other.module, path)
    assert report.missing_keys == [] and report.unexpected_keys == []
    assert_exact(other, reference)
    return {"files": len(files), "tensors": first, "tokens": assert_same_generation(other, reference)}


@case
def tied_embeddings_load_from_the_one_stored_name():
    cfg = config(tie_word_embeddings=True)
    path = pretrained("tied", cfg, seed=3)
    assert "lm_head.weight" not in load_file(path / "model.safetensors")  # save_pretrained stores it once
    model = sharded_llama(FABRIC, cfg)
    report = lightning_fsdp.load_pretrained(model.module, path, strict=True)  # the tied name is not missing
    assert report.missing_keys == [] and report.unexpected_keys == []
    inner = model.module
    assert inner.lm_head.weight is inner.model.embed_tokens.weight  # still one parameter
    reference = LlamaForCausalLM.from_pretrained(path)
    return {"tensors": assert_exact(model, reference), "tokens": assert_same_generation(model, reference)}


@case
def bf16_file_into_fp32_parameters_and_back():
    cfg = config()
    bf16 = pretrained("bf16", cfg, seed=4, dtype=torch.bfloat16)
    model = sharded_llama(FABRIC, cfg)
    FABRIC.load_raw(bf16, model)
    assert_exact(model, LlamaForCausalLM.from_pretrained(bf16, dtype=torch.float32))
    fp32 = pretrained("fp32", cfg, seed=5)
    low = sharded_llama(FABRIC, cfg, dtype=torch.bfloat16)
    FABRIC.load_raw(fp32, low)
    return {"tensors": assert_exact(low, LlamaForCausalLM.from_pretrained(fp32, dtype=torch.bfloat16))}


@case
def missing_and_unexpected_names_are_reported_like_from_pretrained():
    cfg = config()
    source = pretrained("complete", cfg, seed=6)
    path = OUT / "edited"
    if rank() == 0:
        tensors = load_file(source / "model.safetensors")
        del tensors["model.layers.1.mlp.up_proj.weight"], tensors["model.norm.weight"]
        tensors["model.layers.0.extra.weight"] = torch.ones(2)
        path.mkdir()
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
        cfg.save_pretrained(path)
    dist.barrier()
    _, info = LlamaForCausalLM.from_pretrained(path, output_loading_info=True)
    model = sharded_llama(FABRIC, cfg)
    try:
        FABRIC.load_raw(path, model)  # strict by default
    except KeyError as err:
        message = str(err)
    else:
        raise AssertionError("strict load of a file with missing and unexpected names did not raise")
    for name in ("model.layers.1.mlp.up_proj.weight", "model.norm.weight", "model.layers.0.extra.weight", "HINT"):
        assert name in message, message
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = lightning_fsdp.load_pretrained(model.module, path, strict=False)
    assert set(report.missing_keys) == set(info["missing_keys"]), (report.missing_keys, info["missing_keys"])
    assert set(report.unexpected_keys) == set(info["unexpected_keys"]), (report.unexpected_keys, info)
    texts = [str(w.message) for w in caught if "LOAD REPORT" in str(w.message)]
    assert len(texts) == (1 if rank() == 0 else 0), texts
    if texts:
        assert "MISSING     model.norm.weight" in texts[0] and "UNEXPECTED  model.layers.0.extra.weight" in texts[0]
    # What was there loaded.
    expected = load_file(source / "model.safetensors")["model.layers.0.mlp.up_proj.weight"]
    assert torch.equal(full(model.module.model.layers[0].mlp.up_proj.weight), expected)
    return {"missing": report.missing_keys, "unexpected": report.unexpected_keys}


@case
def a_shape_mismatch_raises_on_every_rank():
    path = pretrained("wide", config(intermediate_size=48), seed=7)
    model = sharded_llama(FABRIC, config())
    try:
        lightning_fsdp.load_pretrained(model.module, path, strict=False)
    except ValueError as err:
        assert "model.layers.0.mlp.up_proj.weight: file (48, 32), model (64, 32)" in str(err) and "HINT" in str(err)
        return str(err)[:120]
    raise AssertionError("a shape mismatch did not raise")


class FineTune(L.LightningModule):
    def __init__(self, cfg: LlamaConfig, path: Path) -> None:
        super().__init__()
        self.cfg, self.path = cfg, path

    def configure_model(self) -> None:
        self.model = LlamaForCausalLM(self.cfg)  # on the meta device: the strategy's init context

    def on_fit_start(self) -> None:
        restore_rope(self.model)
        lightning_fsdp.load_pretrained(self.model, self.path)

    def training_step(self, batch, batch_idx):
        return self.model(input_ids=batch, labels=batch).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


@case
def trainer_finetune_exports_what_from_pretrained_reads_exactly():
    cfg = config()
    path = pretrained("base", cfg, seed=8)
    module = FineTune(cfg, path)
    strategy = TrainerFSDPStrategy(auto_wrap_policy={LlamaDecoderLayer}, state_dict_type="full", timeout=TIMEOUT)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=2, enable_progress_bar=False,
                        logger=False, enable_checkpointing=False, enable_model_summary=False)
    data = torch.utils.data.DataLoader(torch.randint(0, 64, (8, 12), generator=torch.Generator().manual_seed(0)),
                                       batch_size=2)
    trainer.fit(module, data)
    trained = {k: full(v).clone() for k, v in module.model.state_dict().items()}
    base = LlamaForCausalLM.from_pretrained(path).state_dict()
    assert not torch.equal(trained["model.layers.0.mlp.up_proj.weight"], base["model.layers.0.mlp.up_proj.weight"])
    ckpt = OUT / "finetuned.ckpt"
    trainer.save_checkpoint(ckpt)
    single, indexed = OUT / "export", OUT / "export-sharded"
    if rank() == 0:
        convert(ckpt, single, to="safetensors")  # the prefix "model." is detected and stripped
        convert(ckpt, indexed, to="safetensors", max_shard_size=20_000, strip_prefix="model.")
        cfg.save_pretrained(single)
        cfg.save_pretrained(indexed)
    dist.barrier()
    assert (indexed / "model.safetensors.index.json").is_file()
    # The names are the Hugging Face class's own, with no key mapping left for from_pretrained to do.
    assert sorted(load_file(single / "model.safetensors")) == sorted(trained)
    results = {}
    for where in (single, indexed):
        reloaded = LlamaForCausalLM.from_pretrained(where)
        state = reloaded.state_dict()
        assert list(state) == list(trained), (list(state)[:3], list(trained)[:3])
        for name, tensor in trained.items():
            assert torch.equal(state[name], tensor), f"{where.name}: {name} is not the trained weight"
        results[where.name] = len(state)
    return results


if __name__ == "__main__":
    run_cases()
