"""Tensor parallelism inside FSDP on 4 CPU gloo ranks, a (dp=2, tp=2) mesh, against Lightning's own
``ModelParallelStrategy`` with the same plan applied by hand (issue 29):

- step time of ``lightning_fsdp.fabric.FSDPStrategy(tensor_parallel_size=2, tensor_parallel_plan=PLAN,
  auto_wrap_policy={Block})`` against ``lightning.fabric.strategies.ModelParallelStrategy(data_parallel_size=2,
  tensor_parallel_size=2, parallelize_fn=by_hand)``, where ``by_hand`` is what a user writes for that strategy:
  ``parallelize_module`` with ``ColwiseParallel``/``RowwiseParallel`` on the same layers over the tensor-parallel
  sub-mesh, then ``fully_shard`` on each block and on the root over the data-parallel sub-mesh;
- the model-state bytes (parameters, gradients, AdamW's two moments: 16 bytes per fp32 parameter) each rank holds
  after a step, summed over the local shards (``DTensor.to_local()``), against the ideal of the plan:
  ``16 * (P_split / (dp * tp) + P_replicated / dp)``. ``P_split`` counts the parameters the plan splits over "tp"
  (the weights and biases of the column-split layers, the weights of the row-split ones), which FSDP then shards
  over "dp" too; ``P_replicated`` counts the rest (embeddings, head, norms, the row-split layers' biases), which
  tensor parallelism leaves whole on each rank of a group, so only FSDP shards them.

    python benchmarks/tensor_parallel_figures.py [--rounds 16] [--steps 3] [--json rows.json]

The model: a GPT with separate q/k/v/o projections and an up/down MLP in each block (the shape of
``tests/workers/tensor_parallel.py``'s), fp32, AdamW. Both strategies are set up in the same launch, each on its own
copy of the same initial weights (seed 0), each with its optimizer built after setup and passed to
``fabric.setup_optimizers``. Each takes one warm-up step (it creates the optimizer state); then each round times
``--steps`` steps of each side, in an order that alternates from round to round (``rows.alternate``), between
barriers. Both sides train on the same batches in the same order (the two ranks of a tensor-parallel group the same
one), so their losses must agree step for step: the script fails if they differ by more than 1e-4, since then the
two sides would not be computing the same thing. Nothing else is asserted: a missed target reads ``met: false``.

Run it alone on the machine (``flock /tmp/cpu.lock python benchmarks/tensor_parallel_figures.py``): 4 ranks share the
cores, each with one thread.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from rows import alternate, emit, figure, ratios  # noqa: E402

WORLD, TP = 4, 2
DP = WORLD // TP
LOSS_TOLERANCE = 1e-4

# The plan, in Hugging Face's tp_plan format, as our strategy takes it; `by_hand` applies the same styles.
PLAN = {
    "blocks.*.attn.q_proj": "colwise", "blocks.*.attn.k_proj": "colwise", "blocks.*.attn.v_proj": "colwise",
    "blocks.*.attn.o_proj": "rowwise", "blocks.*.mlp.up": "colwise", "blocks.*.mlp.down": "rowwise",
}


@dataclass(frozen=True)
class Config:
    vocab: int
    dim: int
    heads: int
    layers: int
    seq: int
    batch: int  # sequences per data-parallel rank and step


SIZES = {
    "full": Config(vocab=4096, dim=512, heads=8, layers=6, seq=128, batch=4),
    "tiny": Config(vocab=256, dim=64, heads=4, layers=2, seq=32, batch=2),
}


class Attention(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.head_dim = cfg.dim // cfg.heads
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(cfg.dim, cfg.dim) for _ in range(3))
        self.o_proj = nn.Linear(cfg.dim, cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds its share of the heads.
        q, k, v = (p(x).view(b, t, -1, self.head_dim).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(cfg.dim, 4 * cfg.dim), nn.Linear(4 * cfg.dim, cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.ln1, self.attn, self.ln2, self.mlp = nn.LayerNorm(cfg.dim), Attention(cfg), nn.LayerNorm(cfg.dim), MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab, cfg.dim)
        self.wpe = nn.Embedding(cfg.seq, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def planned_styles(model: nn.Module) -> dict[str, str]:
    """Module name -> "colwise" / "rowwise" for every module PLAN names (a `*` stands for one name part)."""
    out = {}
    for pattern, style in PLAN.items():
        matcher = re.compile(re.escape(pattern).replace(r"\*", r"[^.]+"))
        out.update({name: style for name, _ in model.named_modules() if matcher.fullmatch(name)})
    return out


def parameter_counts(cfg: Config) -> dict[str, int]:
    """``split``: parameters the plan splits over "tp" (column-split weights and biases, row-split weights);
    ``replicated``: the rest, whole on every rank of a tensor-parallel group (a row-split layer's bias is added after
    the all-reduce, so it is replicated)."""
    with torch.device("meta"):
        model = GPT(cfg)
    styles = planned_styles(model)
    split = sum(p.numel() for name, module in model.named_modules() if name in styles
                for pname, p in module.named_parameters(recurse=False)
                if styles[name] == "colwise" or pname == "weight")
    total = sum(p.numel() for p in model.parameters())
    return {"total": total, "split": split, "replicated": total - split}


def ideal_state_bytes(counts: dict[str, int]) -> float:
    """16 bytes per fp32 parameter (weight, gradient, AdamW's exp_avg and exp_avg_sq), split parameters over dp*tp
    ranks, replicated ones over dp."""
    return 16 * (counts["split"] / (DP * TP) + counts["replicated"] / DP)


def batches(cfg: Config, dp_rank: int, count: int = 4) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + dp_rank)
    return [torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq + 1), generator=gen) for _ in range(count)]


def loss_of(model: nn.Module, tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    return F.cross_entropy(model(tokens[:, :-1]).reshape(-1, vocab), tokens[:, 1:].reshape(-1))


# ------------------------------------------------------------------------------------------------------ worker


def by_hand(model: nn.Module, mesh) -> nn.Module:
    """The ``parallelize_fn`` a user of Lightning's ``ModelParallelStrategy`` writes for PLAN: split each block's
    layers over the tensor-parallel sub-mesh, then shard each block and the root over the data-parallel one."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    tp_mesh, dp_mesh = mesh["tensor_parallel"], mesh["data_parallel"]
    for block in model.blocks:
        parallelize_module(block, tp_mesh, {
            "attn.q_proj": ColwiseParallel(), "attn.k_proj": ColwiseParallel(), "attn.v_proj": ColwiseParallel(),
            "attn.o_proj": RowwiseParallel(), "mlp.up": ColwiseParallel(), "mlp.down": RowwiseParallel(),
        })
    for block in model.blocks:
        fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    return model


def set_up(cfg: Config) -> dict[str, tuple]:
    """Both sides, each ``(fabric, model, optimizer)`` on its own copy of the same initial weights (seed 0)."""
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import ModelParallelStrategy

    from lightning_fsdp.fabric import FSDPStrategy

    fabrics = {
        "ours": Fabric(accelerator="cpu", devices=WORLD, strategy=FSDPStrategy(
            auto_wrap_policy={Block}, tensor_parallel_size=TP, tensor_parallel_plan=PLAN)),
        "lightning": Fabric(accelerator="cpu", devices=WORLD, strategy=ModelParallelStrategy(
            parallelize_fn=by_hand, data_parallel_size=DP, tensor_parallel_size=TP)),
    }
    sides = {}
    for name, fabric in fabrics.items():
        fabric.launch()  # the second Fabric joins the process group the first one made
        torch.manual_seed(0)
        model = fabric.setup_module(GPT(cfg))
        # Built after setup and set up on its own: ModelParallelStrategy does not move an optimizer built before
        # setup onto the sharded parameters, so this is the one order that is right on both sides.
        optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-4))
        sides[name] = (fabric, model, optimizer)
    return sides


def train_step(side: tuple, tokens: torch.Tensor, vocab: int, zero_grad: bool = True) -> float:
    fabric, model, optimizer = side
    loss = loss_of(model, tokens, vocab)
    fabric.backward(loss)
    optimizer.step()
    if zero_grad:
        optimizer.zero_grad()
    return loss.item()


def worker(args) -> dict:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Shard

    torch.set_num_threads(1)
    cfg = SIZES[args.size]
    sides = set_up(cfg)
    data = batches(cfg, int(os.environ["RANK"]) // TP)  # the two ranks of a tensor-parallel group: the same batch
    losses: dict[str, list[float]] = {name: [] for name in sides}

    def step(name: str, zero_grad: bool = True) -> None:
        tokens = data[len(losses[name]) % len(data)]
        losses[name].append(train_step(sides[name], tokens, cfg.vocab, zero_grad))

    def timed(name: str) -> float:
        dist.barrier()
        start = time.perf_counter()
        for _ in range(args.steps):
            step(name)
        dist.barrier()
        return (time.perf_counter() - start) / args.steps

    for name in sides:
        step(name)  # warm-up: creates the optimizer state, first-call allocations
    seconds = alternate(args.rounds, {name: (lambda n=name: timed(n)) for name in sides})

    def local_bytes(t: torch.Tensor) -> int:
        local = t.to_local() if isinstance(t, DTensor) else t
        return local.numel() * local.element_size()

    def split_over_tp(p: torch.Tensor) -> bool:
        if not isinstance(p, DTensor):
            return False
        names = p.device_mesh.mesh_dim_names or ()
        axis = next((i for i, n in enumerate(names) if n in ("tp", "tensor_parallel")), None)
        return axis is not None and isinstance(p.placements[axis], Shard)

    state = {}
    for name, (fabric, model, optimizer) in sides.items():
        step(name, zero_grad=False)  # gradients and moments all present
        params = list(model.parameters())
        moments = [v for s in optimizer.optimizer.state.values() for v in s.values()
                   if torch.is_tensor(v) and v.dim() > 0]  # exp_avg, exp_avg_sq; `step` is a scalar
        state[name] = {
            "params": sum(local_bytes(p) for p in params),
            "grads": sum(local_bytes(p.grad) for p in params if p.grad is not None),
            "optimizer": sum(local_bytes(v) for v in moments),
            "split_params": sum(p.numel() for p in params if split_over_tp(p)),  # global numel of tp-split params
            "dtensor_params": sum(isinstance(p, DTensor) for p in params),
            "param_tensors": len(params),
        }
        optimizer.zero_grad()
    return {"seconds": seconds, "losses": losses, "state": state}


# ------------------------------------------------------------------------------------------------------ driver


def launch(args, folder: Path) -> list[dict]:
    out = folder / "tp"
    out.mkdir()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")])))
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={WORLD}", "--master_addr=127.0.0.1",
               f"--master_port={_free_port()}", str(Path(__file__).resolve()), "--worker", "--out", str(out),
               "--size", args.size, "--rounds", str(args.rounds), "--steps", str(args.steps)]
    proc = subprocess.run(command, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"the 4-rank launch failed (exit {proc.returncode}):\n{(proc.stdout + proc.stderr)[-4000:]}")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rows_from(per_rank: list[dict], cfg: Config) -> list[dict]:
    counts = parameter_counts(cfg)
    first = per_rank[0]
    drift = max(abs(a - b) for a, b in zip(first["losses"]["ours"], first["losses"]["lightning"]))
    if drift > LOSS_TOLERANCE:
        raise SystemExit(f"the two sides trained differently (loss difference {drift:.2e} > {LOSS_TOLERANCE}):"
                         f" ours {first['losses']['ours']}, Lightning's {first['losses']['lightning']}")
    seconds = first["seconds"]  # between barriers, so every rank times the same span
    shape = (f"{counts['total'] / 1e6:.1f}M-param GPT, {cfg.batch}x{cfg.seq} tokens per dp rank, 4 ranks"
             f" (dp={DP}, tp={TP})")
    rows = [figure(f"step time, TP inside FSDP vs ModelParallelStrategy (dp={DP}, tp={TP})",
                   ratios(seconds["ours"], seconds["lightning"]),
                   baseline=f"ModelParallelStrategy with the same plan by hand, {shape}", target=("<=", 1.0),
                   detail={"seconds": seconds["ours"], "baseline_seconds": seconds["lightning"], "config": asdict(cfg),
                           "params": counts["total"], "max_loss_difference": drift})]
    ideal = ideal_state_bytes(counts)
    held = {side: [r["state"][side]["params"] + r["state"][side]["grads"] + r["state"][side]["optimizer"]
                   for r in per_rank] for side in ("ours", "lightning")}
    rows.append(figure(f"TP inside FSDP (dp={DP}, tp={TP}): model-state bytes per rank vs ideal",
                       [b / ideal for b in held["ours"]],
                       baseline=f"16*(P_split/{DP * TP} + P_replicated/{DP})", target=("<=", 1.0),
                       detail={"ideal": ideal, "bytes_per_rank": held["ours"],
                               "baseline_bytes_per_rank": held["lightning"],
                               "P": counts["total"], "P_split": counts["split"], "P_replicated": counts["replicated"],
                               "split_params_seen": [r["state"]["ours"]["split_params"] for r in per_rank],
                               "breakdown_rank0": {k: first["state"]["ours"][k] for k in ("params", "grads", "optimizer")},
                               "ideal_if_all_were_split": 16 * counts["total"] / WORLD}))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=16)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per side and round")
    parser.add_argument("--size", default="full", choices=sorted(SIZES))
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        result = worker(args)
        Path(args.out, f"rank{os.environ['RANK']}.json").write_text(json.dumps(result))
        return
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as folder:
        per_rank = launch(args, Path(folder))
    cfg = SIZES[args.size]
    rows = rows_from(per_rank, cfg)
    counts = parameter_counts(cfg)
    print(f"model: {counts['total'] / 1e6:.2f}M params ({counts['split'] / 1e6:.2f}M split over tp); {args.rounds}"
          f" rounds of {args.steps} steps per side; {time.perf_counter() - start:.0f} s")
    emit(rows, args.json)


if __name__ == "__main__":
    main()
