"""Rank 0's extra host memory while saving and loading a full checkpoint, against the naive way, in one invocation.

- naive save: ``get_model_state_dict``/``get_optimizer_state_dict`` with ``full_state_dict=True, cpu_offload=True``,
  then one ``torch.save`` (what most FSDP code does): rank 0 holds the whole model and optimizer at once.
- streamed save: ``fabric.save`` with ``state_dict_type="full"``.
- load: ``fabric.load`` of that file into a sharded model (rank 0 maps it; tensors are broadcast one by one).

Two peaks per step, in MB and as a fraction of the checkpoint's tensor bytes, each minus the value right before the
step (after ``malloc_trim``):

- ``VmHWM``, the kernel's peak RSS (reset through ``/proc/self/clear_refs``). It includes file-backed pages, so the
  memory-mapped checkpoint that rank 0 reads while loading counts in full although the kernel can drop those clean
  pages at any time;
- ``RssAnon``, anonymous memory only (what the process really allocates), sampled every 2 ms by a thread.

    python -m torch.distributed.run --nproc_per_node=2 benchmarks/full_checkpoint_memory.py [--layers 16 --dim 512]
"""

from __future__ import annotations

import argparse
import tempfile
import sys
import threading
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.fabric import Fabric
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

from lightning_fsdp.fabric import FSDPStrategy

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peak_memory import reset_peak, status_kib  # noqa: E402


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(x)))






class Peak:
    """Measures one step: peak VmHWM and peak sampled RssAnon, each relative to the start."""

    def __enter__(self) -> "Peak":
        self.rss_before = reset_peak()
        self.anon_before = self.anon_peak = status_kib("RssAnon")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.002):
            self.anon_peak = max(self.anon_peak, status_kib("RssAnon"))

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.anon_peak = max(self.anon_peak, status_kib("RssAnon"))
        self.result = {"rss": (status_kib("VmHWM") - self.rss_before) / 1024,
                       "anon": (self.anon_peak - self.anon_before) / 1024}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--dim", type=int, default=512)
    args = parser.parse_args()
    torch.set_num_threads(1)
    fabric = Fabric(accelerator="cpu", devices=2, strategy=FSDPStrategy(state_dict_type="full", auto_wrap_policy={Block}))
    fabric.launch()
    torch.manual_seed(0)
    plain = nn.Sequential(*[Block(args.dim) for _ in range(args.layers)])
    model, opt = fabric.setup(plain, torch.optim.AdamW(plain.parameters(), lr=1e-3))
    fabric.backward(model(torch.randn(2, args.dim)).sum())
    opt.step()
    opt.zero_grad()
    params = sum(p.numel() for p in model.parameters())
    total_mb = params * 4 * 3 / 2**20  # fp32 weights + two AdamW moments
    root = Path(fabric.broadcast(tempfile.mkdtemp()))
    results = {}

    with Peak() as naive:
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state = {"model": get_model_state_dict(model, options=options),
                 "optimizer": get_optimizer_state_dict(model, opt, options=options)}
        if fabric.global_rank == 0:
            torch.save(state, root / "naive.pt")
        del state
    results["naive save"] = naive.result
    fabric.barrier()

    with Peak() as streamed:
        fabric.save(root / "streamed.pt", {"model": model, "optimizer": opt})
    results["streamed save"] = streamed.result

    with Peak() as load:
        fabric.load(root / "streamed.pt", {"model": model, "optimizer": opt})
    results["load"] = load.result

    peaks = [None] * fabric.world_size
    dist.all_gather_object(peaks, results)
    fabric.print(f"{params / 1e6:.1f}M parameters; checkpoint tensors {total_mb:.0f} MB (weights + AdamW moments)")
    for label in results:
        for kind, name in (("rss", "VmHWM  "), ("anon", "RssAnon")):
            line = ", ".join(
                f"rank {r} {p[label][kind]:7.1f} MB ({p[label][kind] / total_mb:6.1%})" for r, p in enumerate(peaks)
            )
            fabric.print(f"{label:14s} extra peak {name}: {line}")


if __name__ == "__main__":
    main()
