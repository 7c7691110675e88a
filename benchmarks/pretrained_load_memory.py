"""Each rank's extra host memory while loading Hugging Face safetensors into a sharded Llama, against its shards.

The parent process writes a >= 1 GB checkpoint of random weights (model-0000N-of-0000M.safetensors plus
model.safetensors.index.json, as `save_pretrained` writes them) into a temporary directory, runs the two ranks under
torchrun, and deletes the directory. Each rank builds the model on the meta device (no memory), then measures from
there: sharding materializes its shards, and `fabric.load_raw` reads its slices into them.

Printed per rank, in MB: the peak RSS extra (``VmHWM`` after ``malloc_trim(0)`` and a ``clear_refs`` reset, so it
includes file pages the reader maps) over the whole step (shards + load), the same for the load alone (the shards
already allocated), the rank's shard bytes and the largest tensor's bytes, and the ratio

    ratio = peak extra (materialize + load) / (shard bytes + largest tensor bytes)

which stays near or below 1 when no rank ever holds more than its shards plus one tensor.

    python benchmarks/pretrained_load_memory.py [--hidden 2048 --layers 4 --vocab 32000]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peak_memory import reset_peak, status_kib  # noqa: E402


def _config(args: argparse.Namespace):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
                       num_hidden_layers=args.layers, num_attention_heads=16, num_key_value_heads=16,
                       tie_word_embeddings=False)


def write_checkpoint(args: argparse.Namespace, directory: Path) -> int:
    """Random weights with the model's names and shapes, written a file at a time; returns the bytes written."""
    from safetensors.torch import save_file
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        shapes = {k: v.shape for k, v in LlamaForCausalLM(_config(args)).state_dict().items()}
    files: list[list[str]] = [[]]
    size = 0
    for name, shape in shapes.items():
        nbytes = shape.numel() * 4
        if files[-1] and size + nbytes > 400e6:
            files.append([])
            size = 0
        files[-1].append(name)
        size += nbytes
    weight_map, total = {}, 0
    generator = torch.Generator().manual_seed(0)
    for index, names in enumerate(files):
        file = f"model-{index + 1:05d}-of-{len(files):05d}.safetensors"
        tensors = {n: torch.randn(shapes[n], generator=generator) * 0.02 for n in names}
        save_file(tensors, str(directory / file), metadata={"format": "pt"})
        total += sum(t.numel() * 4 for t in tensors.values())
        weight_map.update(dict.fromkeys(names, file))
        del tensors
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    _config(args).save_pretrained(directory)
    return total


def worker(args: argparse.Namespace) -> None:
    from lightning.fabric import Fabric
    from torch.distributed.tensor import DTensor
    from transformers import LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from lightning_fsdp.fabric import FSDPStrategy

    torch.set_num_threads(1)
    fabric = Fabric(accelerator="cpu", devices=2, strategy=FSDPStrategy(auto_wrap_policy={LlamaDecoderLayer}))
    fabric.launch()
    with fabric.init_module(empty_init=True):
        model = LlamaForCausalLM(_config(args))
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    fabric.barrier()
    start = reset_peak()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # RMSNorm has no reset_parameters: the load fills it
        model = fabric.setup_module(model)
    shards = sum(p.to_local().numel() * p.element_size() for p in model.parameters() if isinstance(p, DTensor))
    after_setup = status_kib("VmHWM")
    fabric.barrier()
    before_load = reset_peak()
    began = time.perf_counter()
    fabric.load_raw(args.path, model)
    seconds = time.perf_counter() - began
    load_peak = status_kib("VmHWM")
    total_peak = max(after_setup, load_peak)
    mb = 1e6
    row = {
        "rank": fabric.global_rank,
        "peak_extra_MB": round((total_peak - start) * 1024 / mb, 1),
        "load_only_extra_MB": round((load_peak - before_load) * 1024 / mb, 1),
        "shard_MB": round(shards / mb, 1),
        "largest_tensor_MB": round(largest / mb, 1),
        "ratio": round((total_peak - start) * 1024 / (shards + largest), 3),
        "load_s": round(seconds, 2),
    }
    rows = [None] * 2
    torch.distributed.all_gather_object(rows, row)
    if fabric.global_rank == 0:
        for r in rows:
            print(json.dumps(r))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--path", type=Path, help=argparse.SUPPRESS)  # set for the workers
    args = parser.parse_args()
    if args.path is not None:
        worker(args)
        return
    directory = Path(tempfile.mkdtemp(prefix="pretrained_load_memory_"))
    try:
        total = write_checkpoint(args, directory)
        print(f"checkpoint: {total / 1e9:.2f} GB in {len(list(directory.glob('*.safetensors')))} files, 2 ranks")
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", __file__,
                   "--hidden", str(args.hidden), "--layers", str(args.layers), "--vocab", str(args.vocab),
                   "--path", str(directory)]
        subprocess.run(command, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    finally:
        shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()
