"""Fine-tune a Hugging Face Llama with lightning-fsdp: pretrained safetensors in, safetensors out.

    python examples/finetune_hf.py --out hf-finetune     # 2 CPU processes, a few seconds, no hub access

Read it top to bottom:
1. make "pretrained" weights: a random tiny Llama written by `save_pretrained` (stands in for a downloaded model);
2. build the model on the meta device (no memory), shard it on 2 ranks, and load the weights: each rank reads
   only the slices of its own shards;
3. fine-tune a few steps, save a sharded checkpoint;
4. export it to safetensors with `lightning-fsdp convert` and reload it with `from_pretrained`.
Fabric's launcher starts the other process by running this script again, so every rank runs all of it.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import warnings
from pathlib import Path

import torch
from lightning.fabric import Fabric
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

from lightning_fsdp.fabric import FSDPStrategy


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("hf-finetune"), help="where every file goes")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--devices", type=int, default=2)
    return parser.parse_args()


CONFIG = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, tie_word_embeddings=True)


def restore_rope(model: LlamaForCausalLM) -> None:
    # The rotary frequencies are a buffer that is not saved with the weights; a meta-device build leaves it empty.
    rotary = model.model.rotary_emb
    inv_freq, _ = rotary.compute_default_rope_parameters(rotary.config)
    rotary.inv_freq.copy_(inv_freq)
    rotary.original_inv_freq.copy_(inv_freq)


def main() -> None:
    args = parse_args()
    fabric = Fabric(accelerator="cpu", devices=args.devices,
                    strategy=FSDPStrategy(auto_wrap_policy={LlamaDecoderLayer}))  # one unit per decoder layer
    fabric.launch()
    pretrained, checkpoint, export = args.out / "pretrained", args.out / "finetuned", args.out / "export"

    # 1. "Pretrained" weights, as a download would give them: config.json plus model.safetensors.
    if fabric.global_rank == 0:
        torch.manual_seed(0)
        LlamaForCausalLM(CONFIG).save_pretrained(pretrained)
    fabric.barrier()

    # 2. Build on meta, shard, load. RMSNorm and the rotary embedding define no `reset_parameters`, so the strategy
    # warns that it leaves them uninitialized; the load fills the norms and `restore_rope` the rotary buffer.
    with fabric.init_module(empty_init=True):
        model = LlamaForCausalLM(CONFIG)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*reset_parameters.*")
        model = fabric.setup_module(model)
    restore_rope(model.module)
    fabric.load_raw(pretrained, model)  # a directory, a .safetensors file, or an indexed set of files
    fabric.print(f"loaded {pretrained} into {args.devices} shards")

    # 3. Fine-tune a few steps on random tokens, and save.
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    data = torch.randint(0, CONFIG.vocab_size, (args.steps, 2, 16), generator=torch.Generator().manual_seed(1))
    for step in range(args.steps):
        batch = data[step]
        loss = model(input_ids=batch, labels=batch).loss
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        fabric.print(f"step {step}: loss {loss.item():.4f}")
    fabric.save(checkpoint, {"model": model, "optimizer": optimizer})
    trained = {k: v.full_tensor() for k, v in model.state_dict().items()}  # every rank takes part in the gather

    # 4. Export the weights (the command the shell would run) and read them back with transformers alone.
    if fabric.global_rank == 0:
        subprocess.run([sys.executable, "-m", "lightning_fsdp", "convert", str(checkpoint), str(export),
                        "--to", "safetensors", "--overwrite"], check=True)
        CONFIG.save_pretrained(export)  # from_pretrained needs config.json beside the weights
        reloaded = LlamaForCausalLM.from_pretrained(export).state_dict()
        same = all(torch.equal(reloaded[name], tensor) for name, tensor in trained.items())
        print(f"from_pretrained({str(export)!r}) gives the fine-tuned weights: {same}")
        if not same:
            raise SystemExit(1)
    fabric.barrier()


if __name__ == "__main__":
    main()
