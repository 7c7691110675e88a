"""The save figures of issue 13, side by side in one invocation, on 2 CPU ranks and a ~17M-parameter GPT.

- **sharded save throughput vs dd**: ``fabric.save`` of a sharded checkpoint (model + AdamW, every file fsynced)
  against ``dd if=/dev/zero bs=4M conv=fdatasync`` of the same number of bytes into the same directory. Per round,
  the ratio of the two throughputs (= dd seconds / save seconds); >= 0.6 is the target.
- **full save: rank-0 extra peak RSS**: rank 0's ``VmHWM`` during a full save, above its resident memory right
  before (after ``malloc_trim``), against the model's fp32 weights plus both AdamW moments (the bytes a naive
  full save would hold at once).
- **async save: stall**: how long ``fabric.save`` with ``async_save=True`` blocks the caller, against a
  synchronous sharded save of the same state (each started with no save in flight).
- **async save: total cost**: what a save costs training in all. Per round three sides run the same K training
  steps: alone, after a synchronous save, and after an async save (waiting for its end after the K steps, so the
  background write is fully inside the side). Cost = side time - steps alone; the ratio is async cost / sync cost.
  It counts the stall, the steps slowed by the background write beside them, and any wait at the end.

Run (the parent starts the 2 ranks itself; take the CPU lock around it on a shared machine):

    flock /tmp/cpu.lock python benchmarks/save_figures.py [--rounds 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peak_memory import reset_peak, status_kib  # noqa: E402
from rows import alternate, emit, figure, ratios  # noqa: E402


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", default=None, help="write the rows here as JSON")
    parser.add_argument("--steps", type=int, default=3, help="training steps per side of the total-cost figure")
    parser.add_argument("--layers", type=int, default=10)
    parser.add_argument("--dim", type=int, default=384)
    parser.add_argument("--dir", default=None, help="where checkpoints and the dd file go (default: a temp dir)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    return parser.parse_args()


def main() -> None:
    args = _parse()
    if args.worker:
        _worker(args)
        return
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / "rows.json"
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", __file__,
                   "--worker", "--out", str(out), "--rounds", str(args.rounds), "--steps", str(args.steps),
                   "--layers", str(args.layers), "--dim", str(args.dim)]
        if args.dir:
            command += ["--dir", args.dir]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        subprocess.run(command, check=True, env=env)
        emit(json.loads(out.read_text()), args.json)


# ---------------------------------------------------------------------------------------------- the ranks' side


def _worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from lightning.fabric import Fabric

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
    from train_gpt import GPT, GPTConfig, Block, make_optimizer  # the example's model

    from lightning_fsdp.fabric import FSDPStrategy

    torch.set_num_threads(1)
    kinds = {"sharded": dict(state_dict_type="sharded"), "full": dict(state_dict_type="full"),
             "async": dict(state_dict_type="sharded", async_save=True)}
    fabrics = {k: Fabric(accelerator="cpu", devices=2, strategy=FSDPStrategy(auto_wrap_policy={Block}, **kw))
               for k, kw in kinds.items()}
    for fabric in fabrics.values():
        fabric.launch()
    fabric = fabrics["sharded"]
    rank0 = fabric.global_rank == 0
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=64, block_size=64, n_layer=args.layers, n_head=6, n_embd=args.dim)
    with fabric.init_module(empty_init=True):
        plain = GPT(config)
    model, optimizer = fabric.setup(plain, make_optimizer(plain, 1e-4))
    params = sum(p.numel() for p in model.parameters())
    state = {"model": model, "optimizer": optimizer, "step": 0}
    batch = torch.randint(0, config.vocab_size, (8, config.block_size + 1), generator=torch.Generator().manual_seed(
        fabric.global_rank))

    def step() -> None:
        loss = F.cross_entropy(model(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten())
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()

    step()  # AdamW's moments exist from here on
    root = Path(fabric.broadcast(tempfile.mkdtemp(prefix="save_figures_", dir=args.dir)))

    def seconds(action: Callable[[], Any]) -> float:
        fabric.barrier()
        start = time.perf_counter()
        action()
        elapsed = torch.tensor(time.perf_counter() - start)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        return elapsed.item()

    # --- the sharded checkpoint's size, then the sides
    fabric.save(root / "sharded", state)
    ckpt_bytes = sum(p.stat().st_size for p in (root / "sharded").rglob("*") if p.is_file())
    background = fabrics["async"].strategy._background_saves  # to start each stall with no save in flight

    def finish_async() -> None:
        background.wait(fabrics["async"].strategy._engine)

    def dd() -> float:
        def run() -> None:
            if rank0:
                count = max(1, round(ckpt_bytes / 2**22))
                subprocess.run(["dd", "if=/dev/zero", f"of={root / 'dd.bin'}", "bs=4M", f"count={count}",
                                "conv=fdatasync"], check=True, capture_output=True)
        elapsed = seconds(run)
        if rank0:
            (root / "dd.bin").unlink()
        return elapsed

    full_total = params * 4 * 3  # fp32 weights and AdamW's two moments, unsharded

    def full_peak() -> float:
        fabric.barrier()
        before = reset_peak() if rank0 else 0
        fabrics["full"].save(root / "full.pt", state)
        extra = (status_kib("VmHWM") - before) * 1024 if rank0 else 0
        fabric.barrier()
        return fabric.broadcast(extra) / full_total

    stall: dict[str, list[float]] = {"sync": [], "async": []}

    def train_side(save: str) -> float:
        finish_async()
        fabric.barrier()
        start = time.perf_counter()
        if save == "sync":
            fabrics["sharded"].save(root / "cost", state)
        elif save == "async":
            fabrics["async"].save(root / "cost", state)
        called = time.perf_counter() - start
        for _ in range(args.steps):
            step()
        finish_async()
        elapsed = torch.tensor([time.perf_counter() - start, called])
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        if save in stall:
            stall[save].append(elapsed[1].item())
        return elapsed[0].item()

    sides = {
        "dd": dd,
        "sharded save": lambda: seconds(lambda: fabric.save(root / "sharded", state)),
        "full peak": full_peak,
        "steps alone": lambda: train_side("none"),
        "sync save + steps": lambda: train_side("sync"),
        "async save + steps": lambda: train_side("async"),
    }
    train_side("async")  # warm-up: the first async save creates its process group and staging
    stall["async"].clear()
    times = alternate(args.rounds, sides)
    alone = times["steps alone"]
    cost = {kind: [t - a for t, a in zip(times[f"{kind} save + steps"], alone)] for kind in ("sync", "async")}
    med = statistics.median
    rows = [
        figure("sharded save throughput vs dd conv=fdatasync", ratios(times["dd"], times["sharded save"]),
               baseline="dd conv=fdatasync, same bytes, same directory", target=(">=", 0.6),
               detail={"checkpoint_MB": ckpt_bytes / 1e6, "save_s": med(times["sharded save"]),
                       "dd_s": med(times["dd"]),
                       "throughput_mb_s": {"sharded save": ckpt_bytes / 1e6 / med(times["sharded save"]),
                                           "dd conv=fdatasync": ckpt_bytes / 1e6 / med(times["dd"])}}),
        figure("full save: rank-0 extra peak RSS vs model + AdamW bytes", times["full peak"],
               baseline="fp32 weights + 2 AdamW moments", target=("<=", 0.1),
               detail={"model_adamw_MB": full_total / 1e6, "params": params}),
        figure("async save: time the save call blocks vs a synchronous save", ratios(stall["async"], stall["sync"]),
               baseline="synchronous sharded save", target=("<=", 0.1),
               detail={"async_call_s": med(stall["async"]), "sync_save_s": med(stall["sync"])}),
        figure(f"async save: total training-time cost vs a synchronous save ({args.steps} steps beside)",
               ratios(cost["async"], cost["sync"]), baseline="synchronous sharded save, same steps after it",
               target=None, detail={"async_cost_s": med(cost["async"]), "sync_cost_s": med(cost["sync"]),
                                    "steps_alone_s": med(alone), "steps": args.steps}),
    ]
    if rank0:
        shutil.rmtree(root, ignore_errors=True)
        Path(args.out).write_text(json.dumps(rows))
    fabric.barrier()






if __name__ == "__main__":
    main()
