"""Model FLOPs utilization of a ~1B-parameter GPT in bf16 at world size 1, on a CUDA GPU (issue 13).

    python benchmarks/mfu.py [--json out.json] [--peak-tflops 989]

MFU = achieved model FLOPs per second / the GPU's peak dense bf16 FLOPs. Model FLOPs per token are 6·P for the
matmuls of forward and backward plus 12·L·d·T for attention (the PaLM appendix's count), P the parameters without
the embedding. Without a CUDA device it reports nothing and says so: there is no CPU figure to stand in for it.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from rows import emit, figure  # noqa: E402

# Dense bf16 peak of the GPUs this project is measured on, in TFLOPS (vendor data sheets, without sparsity).
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}


def peak_tflops(name: str, given: float | None) -> float:
    if given:
        return given
    for key, value in PEAK_TFLOPS.items():
        if key in name:
            return value
    raise SystemExit(f"--peak-tflops: no known bf16 peak for {name!r}; pass the data sheet's dense bf16 TFLOPS")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds of --steps steps each")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--peak-tflops", type=float)
    args = parser.parse_args()

    import torch

    if not torch.cuda.is_available():
        print("[mfu] no CUDA device: MFU not measured")
        emit([], args.json)
        return

    from lightning.fabric import Fabric

    from gpt import GPT, Block, GPTConfig, batch, loss_of
    from lightning_fsdp.fabric import FSDPStrategy

    cfg = GPTConfig(vocab=32000, dim=2048, layers=16, heads=16, seq=2048, batch=4)
    os.environ.setdefault("MASTER_PORT", "29512")
    fabric = Fabric(accelerator="cuda", devices=1, precision="bf16-mixed",
                    strategy=FSDPStrategy(auto_wrap_policy={Block}, activation_checkpointing_policy={Block}))
    fabric.launch()
    with fabric.init_module(empty_init=True):
        model = GPT(cfg)
    params = sum(p.numel() for p in model.parameters())
    model = fabric.setup_module(model)
    opt = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True))
    dense = params - cfg.vocab * cfg.dim  # the embedding lookup is not a matmul
    flops_per_token = 6 * dense + 12 * cfg.layers * cfg.dim * cfg.seq
    tokens_per_step = cfg.batch * cfg.seq
    peak = peak_tflops(torch.cuda.get_device_name(0), args.peak_tflops) * 1e12

    def run(steps: int, start: int) -> float:
        torch.cuda.synchronize()
        begin = time.perf_counter()
        for step in range(start, start + steps):
            fabric.backward(loss_of(model, batch(cfg, step, 0).to(fabric.device)))
            opt.step()
            opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        return (time.perf_counter() - begin) / steps

    run(3, 0)  # warm-up
    mfu = [flops_per_token * tokens_per_step / run(args.steps, 100 * (r + 1)) / peak for r in range(args.rounds)]
    emit([figure(f"MFU, {params / 1e9:.2f}B-parameter GPT, bf16-mixed, world size 1", mfu,
                 baseline=f"peak dense bf16 of {torch.cuda.get_device_name(0)}", unit="fraction",
                 detail={"params": params, "tokens_per_step": tokens_per_step,
                         "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30})], args.json)


if __name__ == "__main__":
    main()
