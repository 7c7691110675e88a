"""How close `lightning-fsdp plan` comes to the memory a real step uses, per rank.

For each configuration: the planner's peak (fake tensors, a fake process group, nothing allocated), then the same
step run for real on N CPU ranks with the same strategy arguments through Fabric, measured with torch's
FSDPMemTracker over a steady-state step (the second), and, as an independent view, the peak RSS (VmHWM) during that
step above the RSS the process had before the model was built. Prints predicted / measured per configuration.

    .venv/bin/python benchmarks/plan_accuracy.py            # every configuration; ~2 minutes on 2 cores (before the
                                                            # two tensor-parallel ones, 35 s of their own)
    .venv/bin/python benchmarks/plan_accuracy.py gpt-2 gpt-2-ac
    .venv/bin/python benchmarks/plan_accuracy.py gpt-4-tp2 llama-4-tp2   # tensor parallelism, (shard=2, tp=2)
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "examples"))
sys.path.insert(0, str(HERE))

import train_gpt  # noqa: E402 - the example GPT of the README
from peak_memory import reset_peak, status_kib  # noqa: E402

GPT_CONFIG = dict(vocab_size=256, block_size=256, n_layer=6, n_head=8, n_embd=256)
BATCH, SEQ = 8, 256


def gpt() -> torch.nn.Module:
    return train_gpt.GPT(train_gpt.GPTConfig(**GPT_CONFIG))


def gpt_batch(batch: int = BATCH, seq: int = SEQ) -> tuple:
    idx = torch.randint(0, GPT_CONFIG["vocab_size"], (batch, seq))
    return (idx, torch.randint(0, GPT_CONFIG["vocab_size"], (batch, seq)))  # (idx, targets): forward gives the loss


def gpt_tiny_batch() -> tuple:
    """One short sequence: the parameters, gradients and optimizer state, not the activations, make the peak."""
    return gpt_batch(1, 16)


def llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                                        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256))


def llama_batch() -> dict:
    ids = torch.randint(0, 512, (4, 128))
    return {"input_ids": ids, "labels": ids}


def _llama_block():
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    return {LlamaDecoderLayer}


# name -> (model factory, batch factory, world size, plan/strategy options)
CONFIGS: dict[str, tuple[Callable, Callable, int, Callable[[], dict[str, Any]]]] = {
    "gpt-1": (gpt, gpt_batch, 1, lambda: {"auto_wrap_policy": {train_gpt.Block}}),
    "gpt-2": (gpt, gpt_batch, 2, lambda: {"auto_wrap_policy": {train_gpt.Block}}),
    "gpt-4": (gpt, gpt_batch, 4, lambda: {"auto_wrap_policy": {train_gpt.Block}}),
    "gpt-2-ac": (gpt, gpt_batch, 2, lambda: {"auto_wrap_policy": {train_gpt.Block},
                                             "activation_checkpointing_policy": {train_gpt.Block}}),
    "gpt-2-tiny-batch": (gpt, gpt_tiny_batch, 2, lambda: {"auto_wrap_policy": {train_gpt.Block}}),
    "gpt-2-bf16": (gpt, gpt_batch, 2, lambda: {"auto_wrap_policy": {train_gpt.Block}, "precision": "bf16-mixed"}),
    "llama-2": (llama, llama_batch, 2, lambda: {"auto_wrap_policy": _llama_block()}),
    # Tensor parallelism on (shard=2, tp=2): the example GPT's feed-forward layers split (its attention's fused qkv
    # cannot be), and the Llama by its own plan.
    "gpt-4-tp2": (gpt, gpt_batch, 4, lambda: {"auto_wrap_policy": {train_gpt.Block}, "tensor_parallel_size": 2,
                                              "tensor_parallel_plan": {"blocks.*.mlp.fc": "colwise",
                                                                       "blocks.*.mlp.proj": "rowwise"}}),
    "llama-4-tp2": (llama, llama_batch, 4, lambda: {"auto_wrap_policy": _llama_block(), "tensor_parallel_size": 2,
                                                    "tensor_parallel_plan": "auto"}),
}


def predict(name: str) -> int:
    from lightning_fsdp.planner import plan_memory

    model, batch, world, options = CONFIGS[name]
    options = dict(options())
    precision = options.pop("precision", "32-true")
    return plan_memory(model, batch, world_size=world, precision=precision, **options).max_peak_bytes


def measure_on_this_rank(name: str) -> dict[str, int]:
    """Inside a torchrun launch: run the planned step for real and measure it, in the steady state (a first step
    creates the optimizer state, then the second is measured)."""
    from lightning.fabric import Fabric

    from lightning_fsdp._base.compat import planner_tools
    from lightning_fsdp.fabric import FSDPStrategy

    _, _, FSDPMemTracker, _ = planner_tools()
    model_fn, batch_fn, world, options = CONFIGS[name]
    options = dict(options())
    precision = options.pop("precision", "32-true")
    fabric = Fabric(accelerator="cpu", devices=world, precision=precision, strategy=FSDPStrategy(**options))
    fabric.launch()
    rss_base = reset_peak() * 1024  # the process before the model exists: interpreter, torch, the process group
    torch.manual_seed(0)
    model = model_fn()
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters()))
    batch = batch_fn()
    args, kwargs = ((), batch) if isinstance(batch, dict) else ((batch,) if torch.is_tensor(batch) else batch, {})

    def step() -> None:
        output = model(*args, **kwargs)
        loss = getattr(output, "loss", output)
        fabric.backward(loss if loss.ndim == 0 else loss.float().sum())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()
    tracker = FSDPMemTracker(model.module, optimizer.optimizer)
    tracker.track_inputs((args, kwargs))
    reset_peak()  # VmHWM restarts from what is resident now
    with tracker:
        step()
    peak = tracker.get_tracker_snapshot("peak")
    tracked = sum(table["Total"] for table in peak.values())
    return {"tracker_peak": tracked, "rss_growth": status_kib("VmHWM") * 1024 - rss_base}


def measure(name: str) -> dict[str, int]:
    """Launch the configuration on its world size; the largest measurement over the ranks."""
    world = CONFIGS[name][2]
    with tempfile.TemporaryDirectory() as out:
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", PLAN_ACCURACY_OUT=out)
        command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={world}",
                   f"--master_port={_free_port()}",
                   str(Path(__file__).resolve()), "--measure", name]
        proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            raise RuntimeError(f"the measured run of {name} failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
        results = [json.loads(p.read_text()) for p in Path(out).glob("*.json")]
    return {key: max(r[key] for r in results) for key in results[0]}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(names: list[str]) -> None:
    print(f"{'configuration':<12} {'predicted':>12} {'measured':>12} {'pred/meas':>10} {'RSS growth':>12}"
          f" {'pred/RSS':>9}")
    for name in names:
        predicted = predict(name)
        measured = measure(name)
        ratio = predicted / measured["tracker_peak"]
        print(f"{name:<12} {predicted / 2**20:>10.1f}Mi {measured['tracker_peak'] / 2**20:>10.1f}Mi {ratio:>10.3f}"
              f" {measured['rss_growth'] / 2**20:>10.1f}Mi {predicted / measured['rss_growth']:>9.2f}", flush=True)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--measure":
        result = measure_on_this_rank(sys.argv[2])
        Path(os.environ["PLAN_ACCURACY_OUT"], f"rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps(result))
    else:
        main(sys.argv[1:] or list(CONFIGS))
