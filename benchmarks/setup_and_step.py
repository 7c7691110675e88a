"""Setup time and step time of the strategy against the same model wrapped by hand with ``fully_shard``.

Both variants run in the same invocation, alternating, so machine noise hits both alike. The result is reported as
ratios (strategy / by hand); 1.00 means no overhead.

    python -m torch.distributed.run --nproc_per_node=2 benchmarks/setup_and_step.py [--layers 8 --dim 256 --repeats 8]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.fabric import Fabric
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from lightning_fsdp.fabric import FSDPStrategy


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class Model(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(layers))
        self.head = nn.Linear(dim, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def by_hand(model: nn.Module, mesh) -> nn.Module:
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def steps(model: nn.Module, opt: torch.optim.Optimizer, n: int, vocab: int, backward) -> float:
    gen = torch.Generator().manual_seed(dist.get_rank())
    start = time.perf_counter()
    for _ in range(n):
        batch = torch.randint(0, vocab, (8, 65), generator=gen)
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, vocab), batch[:, 1:].reshape(-1))
        backward(loss)
        opt.step()
        opt.zero_grad()
    dist.barrier()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(1)

    fabric = Fabric(accelerator="cpu", devices=dist.get_world_size() if dist.is_initialized() else 2,
                    strategy=FSDPStrategy(auto_wrap_policy={Block}))
    fabric.launch()
    mesh = init_device_mesh("cpu", (fabric.world_size,))
    timings: dict[str, list[float]] = {"setup_hand": [], "setup_ours": [], "step_hand": [], "step_ours": []}
    for repeat in range(args.repeats):
        # Alternate which variant goes first, so neither always inherits the other's garbage or warm caches.
        for variant in ("hand", "ours") if repeat % 2 == 0 else ("ours", "hand"):
            gc.collect()
            torch.manual_seed(0)
            model = Model(args.vocab, args.dim, args.layers)
            dist.barrier()
            start = time.perf_counter()
            if variant == "hand":
                model = by_hand(model, mesh)
                opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
                backward = lambda loss: loss.backward()  # noqa: E731
            else:
                opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
                model, opt = fabric.setup(model, opt)
                backward = fabric.backward
            dist.barrier()
            timings[f"setup_{variant}"].append(time.perf_counter() - start)
            steps(model, opt, 2, args.vocab, backward)  # warm-up
            timings[f"step_{variant}"].append(steps(model, opt, args.steps, args.vocab, backward) / args.steps)

    med = {k: statistics.median(v) for k, v in timings.items()}
    params = sum(p.numel() for p in Model(args.vocab, args.dim, args.layers).parameters())
    fabric.print(f"model: {params / 1e6:.2f}M params, {fabric.world_size} ranks, median of {args.repeats} repeats")
    fabric.print(f"setup: by hand {med['setup_hand'] * 1e3:.1f} ms, strategy {med['setup_ours'] * 1e3:.1f} ms,"
                 f" ratio {med['setup_ours'] / med['setup_hand']:.2f}")
    fabric.print(f"step:  by hand {med['step_hand'] * 1e3:.1f} ms, strategy {med['step_ours'] * 1e3:.1f} ms,"
                 f" ratio {med['step_ours'] / med['step_hand']:.2f}")


if __name__ == "__main__":
    main()
