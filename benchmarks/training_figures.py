"""Training figures of issue 13, each a ratio against a baseline measured in the same invocation:

- step time of the strategy vs the same model wrapped by hand with ``fully_shard``, and vs DDP (2 ranks; the three
  sides are set up once and timed in alternating order, a few steps per side per round);
- model-state bytes per rank (parameters, gradients, AdamW state) vs the ideal 16·P/N, at N = 1, 2 and 4;
- setup peak with ``empty_init=True`` vs P·4/N plus the largest unit, at N = 1, 2 and 4 (VmHWM after
  ``malloc_trim`` and a reset: see ``benchmarks/peak_memory.py`` for why both);
- ``import lightning_fsdp`` vs ``import lightning``, each in a fresh interpreter.

    python benchmarks/training_figures.py [--rounds 6] [--json out.json]

Every launch is a ``torch.distributed.run`` on CPU/gloo; the driver collects each worker's JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from peak_memory import reset_peak, status_kib  # noqa: E402
from rows import alternate, emit, figure, ratios  # noqa: E402


# ------------------------------------------------------------------------------------------------------ workers


def _fabric(**kwargs):
    from lightning.fabric import Fabric

    from gpt import Block
    from lightning_fsdp.fabric import FSDPStrategy

    import torch.distributed as dist

    fabric = Fabric(accelerator="cpu", devices=int(os.environ.get("WORLD_SIZE", 1)),
                    strategy=FSDPStrategy(auto_wrap_policy={Block}, **kwargs))
    fabric.launch()
    return fabric, dist


def worker_step(args) -> dict:
    """Step time of the strategy, the hand-wrapped model and DDP, alternating per round."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    from gpt import GPT, SIZES, batch, loss_of

    torch.set_num_threads(1)
    cfg = SIZES[args.size]
    fabric, dist = _fabric()
    rank = fabric.global_rank

    def build():
        torch.manual_seed(0)
        return GPT(cfg)

    model = build()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ours, ours_opt = fabric.setup(model, opt)

    hand = build()
    mesh = init_device_mesh("cpu", (fabric.world_size,))
    for block in hand.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(hand, mesh=mesh)
    hand_opt = torch.optim.AdamW(hand.parameters(), lr=1e-4)

    ddp = DistributedDataParallel(build())
    ddp_opt = torch.optim.AdamW(ddp.parameters(), lr=1e-4)

    sides = {
        "ours": (ours, ours_opt, fabric.backward),
        "by_hand": (hand, hand_opt, lambda loss: loss.backward()),
        "ddp": (ddp, ddp_opt, lambda loss: loss.backward()),
    }
    counter = {"step": 0}

    def run(name: str, steps: int) -> float:
        model, opt, backward = sides[name]
        dist.barrier()
        start = time.perf_counter()
        for _ in range(steps):
            counter["step"] += 1
            backward(loss_of(model, batch(cfg, counter["step"], rank)))
            opt.step()
            opt.zero_grad()
        dist.barrier()
        return (time.perf_counter() - start) / steps

    for name in sides:
        run(name, 1)  # warm-up: first-call allocations and lazy initialization
    timings = alternate(args.rounds, {name: (lambda n=name: run(n, args.steps)) for name in sides})
    return {"timings": timings}






def worker_memory(args) -> dict:
    """Setup peak with ``empty_init=True`` and the model-state bytes per rank after one AdamW step."""
    import torch
    from torch.distributed.tensor import DTensor

    from gpt import GPT, SIZES, batch, loss_of

    torch.set_num_threads(1)
    cfg = SIZES[args.size]
    fabric, dist = _fabric()
    dist.barrier()
    before_kib = reset_peak()
    with fabric.init_module(empty_init=True):
        model = GPT(cfg)
    model = fabric.setup_module(model)
    setup_peak = (status_kib("VmHWM") - before_kib) * 1024
    opt = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-4))
    fabric.backward(loss_of(model, batch(cfg, 0, fabric.global_rank)))
    opt.step()

    def local_bytes(t: torch.Tensor) -> int:
        local = t.to_local() if isinstance(t, DTensor) else t
        return local.numel() * local.element_size()

    params = sum(local_bytes(p) for p in model.parameters())
    grads = sum(local_bytes(p.grad) for p in model.parameters() if p.grad is not None)
    # The tensors of AdamW's state that scale with the parameters (exp_avg, exp_avg_sq); `step` is a scalar.
    states = sum(local_bytes(v) for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0)
    return {"setup_peak_bytes": setup_peak, "params": params, "grads": grads, "optimizer": states}


WORKERS = {"step": worker_step, "memory": worker_memory}


# ------------------------------------------------------------------------------------------------------- driver


def launch(mode: str, nproc: int, args, out_dir: Path) -> list[dict]:
    """Run this file's ``mode`` worker on ``nproc`` ranks; return each rank's result."""
    out = out_dir / f"{mode}-{nproc}"
    out.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--master_addr=127.0.0.1",
           f"--master_port={29400 + nproc + (10 if mode == 'memory' else 0)}", __file__, "--worker", mode,
           "--out", str(out), "--size", args.size, "--rounds", str(args.rounds), "--steps", str(args.steps)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    run = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if run.returncode != 0:
        raise SystemExit(f"{mode} on {nproc} ranks failed (exit {run.returncode}):\n{run.stdout[-3000:]}\n"
                         f"{run.stderr[-3000:]}")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]


def import_times(rounds: int) -> dict[str, list[float]]:
    def fresh(module: str) -> float:
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", f"import {module}"], check=True)
        return time.perf_counter() - start

    fresh("lightning_fsdp")  # warm the page cache for both sides before timing
    return alternate(rounds, {"lightning_fsdp": lambda: fresh("lightning_fsdp"),
                              "lightning": lambda: fresh("lightning")})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=3, help="steps per side per round")
    parser.add_argument("--size", default="17m", choices=["17m", "tiny"])
    parser.add_argument("--json")
    parser.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        result = WORKERS[args.worker](args)
        Path(args.out, f"rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps(result))
        return

    from gpt import SIZES, num_params, unit_bytes

    cfg = SIZES[args.size]
    params = num_params(cfg)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        step = launch("step", 2, args, Path(tmp))[0]["timings"]
        rows.append(figure("step time vs the same model wrapped by hand with fully_shard",
                           ratios(step["ours"], step["by_hand"]), baseline="fully_shard by hand, 2 ranks",
                           target=("<=", 1.0), detail={"seconds": step, "params": params}))
        rows.append(figure("step time vs DDP", ratios(step["ours"], step["ddp"]), baseline="DDP, 2 ranks",
                           detail={"seconds": step}))
        largest_unit = max(unit_bytes(cfg).values())
        for n in (1, 2, 4):
            per_rank = launch("memory", n, args, Path(tmp))
            ideal_state = 16 * params / n
            state = [r["params"] + r["grads"] + r["optimizer"] for r in per_rank]
            rows.append(figure(f"model-state bytes per rank vs 16*P/N, N={n}", [s / ideal_state for s in state],
                               baseline="16*P/N", target=("<=", 1.0),
                               detail={"N": n, "bytes_per_rank": state, "ideal": ideal_state}))
            ideal_setup = 4 * params / n + largest_unit
            peaks = [r["setup_peak_bytes"] for r in per_rank]
            rows.append(figure(f"setup peak with empty_init=True vs P*4/N + largest unit, N={n}",
                               [p / ideal_setup for p in peaks], baseline="P*4/N + largest unit",
                               target=("<=", 1.0), detail={"N": n, "peak_bytes_per_rank": peaks, "ideal": ideal_setup}))
    imports = import_times(args.rounds)
    rows.append(figure("import lightning_fsdp vs import lightning", ratios(imports["lightning_fsdp"], imports["lightning"]),
                       baseline="import lightning", target=("<=", 1.1), detail={"seconds": imports}))
    emit(rows, args.json)


if __name__ == "__main__":
    main()
