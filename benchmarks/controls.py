"""What the speed and memory controls buy: prefetch depths, int resharding, and activation checkpointing none / full /
every-2nd / selective, each as a ratio against its baseline measured in the same invocation.

    python benchmarks/controls.py [--rounds 8] [--json rows.json]

The example GPT (``examples/train_gpt.py``: token and position embeddings, pre-norm blocks with
``F.scaled_dot_product_attention`` and a GELU MLP) with vocab 4096 and 8 blocks of width 384 (17.4M parameters at
64-token sequences), AdamW, fp32 on CPU with gloo. Three suites (``SUITES``), each a launch of
``torch.distributed.run`` for step times and, where memory is reported, one for memory:

- ``prefetch``, 2 ranks, 8 sequences of 64 tokens per rank: FSDP2's default prefetching against
  ``forward_prefetch=1`` and ``backward_prefetch=2``;
- ``checkpointing``, 2 ranks, 4 sequences of 256 tokens per rank (the long sequences checkpointing is for): none,
  full, every-2nd and op-level selective activation checkpointing;
- ``four_ranks`` (an int reshard needs a shard axis with a smaller group in it), 2 sequences of 64 tokens:
  ``reshard_after_forward=2`` against True.

Step time: every configuration of a suite is set up in the same launch and takes one warm-up step (it creates the
optimizer state); then each round times ``--steps`` steps of each configuration, in an order that alternates
from round to round, and their mean is the round's step time. Ratios pair the configurations of the same round.
Memory, in a launch of its own (``--memory-rounds`` rounds): set up, a warm-up step, then the extra peak RSS of one
forward and backward (where activations live) over the resting state with optimizer state:
glibc's ``malloc_trim(0)`` first returns freed heap pages, ``5 > /proc/self/clear_refs`` resets the peak to the
current RSS, and ``VmHWM`` after the backward minus that is the extra; the larger of the ranks' values is reported.
In the memory launch, allocations of 64 KiB and more get pages of their own (a fixed glibc mmap threshold, set at
start), so RSS follows the live tensors (see ``PeakMeter``). Configurations run in an order that
alternates from round to round (``rows.alternate``). Nothing is asserted: a missed target reads ``met: false``.

Run it alone on the machine (``flock /tmp/cpu.lock python benchmarks/controls.py``): the ranks share the cores.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT / "examples"))

from peak_memory import reset_peak, status_kib  # noqa: E402
from rows import alternate, emit, figure, ratios  # noqa: E402

MODEL = dict(vocab_size=4096, n_layer=8, n_head=6, n_embd=384)  # block_size is the suite's sequence length


@dataclass(frozen=True)
class Suite:
    ranks: int
    sequence: int  # tokens per sequence (the model's block_size)
    batch: int  # sequences per rank and step
    configurations: dict  # name -> strategy arguments; the first is the suite's baseline


SUITES = {
    # 8 sequences of 64 tokens per rank, so that compute, which prefetching overlaps, is most of a step.
    "prefetch": Suite(2, 64, 8, {
        "default": {},
        "forward_prefetch=1": {"forward_prefetch": 1},
        "backward_prefetch=2": {"backward_prefetch": 2},
    }),
    # Activation checkpointing is for long sequences: 4 of 256 tokens per rank, where activations dominate memory
    # and the recomputed forward is a visible share of a step. With 64-token sequences that share is too small to
    # show through the noise, and selective and full checkpointing stepped alike.
    "checkpointing": Suite(2, 256, 4, {
        "none": {},
        "full": {"activation_checkpointing_policy": "train_gpt.Block"},
        "every-2nd": {"activation_checkpointing_policy": {"blocks": ["train_gpt.Block"], "every": 2}},
        "selective": {"activation_checkpointing_policy": {"blocks": ["train_gpt.Block"], "save_ops": "default"}},
    }),
    # An int reshard needs a shard axis with a smaller group in it; 2 sequences per rank (twice the processes on
    # the same cores) keep this launch short.
    "four_ranks": Suite(4, 64, 2, {
        "reshard=True": {"reshard_after_forward": True},
        "reshard=2": {"reshard_after_forward": 2},
    }),
}


# --- worker side: one torch.distributed.run launch per suite ------------------------------------------------------


class PeakMeter:
    """The extra peak RSS of a block of code, from the kernel's own counters (``VmHWM``, reset by ``clear_refs``).

    ``exact_pages()``, called when the process starts, gives every allocation of 64 KiB and more pages of its own (a
    fixed glibc mmap threshold), returned to the kernel when freed, so RSS follows the live tensors instead of what
    the heap keeps from earlier steps. Called late, in a process whose heap is already large and fragmented, it
    does not help: small allocations then land in scattered free chunks whose pages ``malloc_trim`` gave back, and
    each touches a fresh page (about 200 MB of phantom peak here). A page fault per tensor also slows steps down, so
    step times and memory are measured in separate launches.
    """

    def __init__(self) -> None:
        self.libc = ctypes.CDLL("libc.so.6")

    def exact_pages(self) -> None:
        self.libc.mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD

    def __enter__(self) -> "PeakMeter":
        self.baseline = reset_peak()  # freed heap back to the kernel, then VmHWM := current RSS
        return self

    def __exit__(self, *exc) -> None:
        self.extra_bytes = (status_kib("VmHWM") - self.baseline) * 1024


def worker(suite: str, phase: str, rounds: int, steps: int, out: Path) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from lightning.fabric import Fabric

    import train_gpt
    from lightning_fsdp.fabric import FSDPStrategy

    meter = PeakMeter()
    if phase == "memory":
        meter.exact_pages()
    torch.set_num_threads(1)
    spec = SUITES[suite]
    world, configurations = spec.ranks, spec.configurations
    config = train_gpt.GPTConfig(**MODEL, block_size=spec.sequence)
    generator = torch.Generator().manual_seed(int(os.environ["RANK"]))

    def forward_backward(model, fabric) -> None:
        batch = torch.randint(0, MODEL["vocab_size"], (spec.batch, spec.sequence + 1), generator=generator)
        logits = model(batch[:, :-1])
        fabric.backward(F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()))

    def step(model, opt, fabric) -> None:
        forward_backward(model, fabric)
        opt.step()
        opt.zero_grad(set_to_none=True)

    def set_up(strategy_kwargs: dict):
        fabric = Fabric(accelerator="cpu", devices=world, strategy=FSDPStrategy(**strategy_kwargs))
        fabric.launch()
        torch.manual_seed(0)
        model = train_gpt.GPT(config)
        model, opt = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
        step(model, opt, fabric)  # warm-up: creates the optimizer state
        dist.barrier()
        return fabric, model, opt

    def step_time(prepared: tuple) -> float:
        fabric, model, opt = prepared
        dist.barrier()
        start = time.perf_counter()
        for _ in range(steps):
            step(model, opt, fabric)
        dist.barrier()
        return (time.perf_counter() - start) / steps

    def peak(strategy_kwargs: dict) -> float:
        # The peak of forward and backward, where activations live: the optimizer step allocates the same
        # temporaries under every configuration.
        fabric, model, opt = set_up(strategy_kwargs)
        with meter:
            forward_backward(model, fabric)
        extra = torch.tensor(float(meter.extra_bytes))
        dist.all_reduce(extra, op=dist.ReduceOp.MAX)
        return extra.item()

    if phase == "time":
        # Every configuration is set up once and stays alive; rounds then alternate between them step by step, so a
        # change in the machine's speed (large here, over minutes) hits every configuration of a round alike.
        prepared = {name: set_up(kw) for name, kw in configurations.items()}
        samples = alternate(rounds, {name: (lambda p=p: step_time(p)) for name, p in prepared.items()})
    else:
        samples = alternate(rounds, {name: (lambda kw=kw: peak(kw)) for name, kw in configurations.items()})
    if int(os.environ["RANK"]) == 0:
        params = sum(p.numel() for p in train_gpt.GPT(config).parameters())
        out.write_text(json.dumps({"params": params, "world": world, "samples": samples}))


# --- parent side: launch, then turn the samples into rows ---------------------------------------------------------


def launch(suite: str, phase: str, rounds: int, steps: int, folder: Path) -> dict:
    world = SUITES[suite].ranks
    out = folder / f"{suite}-{phase}.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
               PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT / "examples"), os.environ.get("PYTHONPATH", "")]))
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={world}", "--master_addr=127.0.0.1",
               f"--master_port={_free_port()}", str(Path(__file__).resolve()), "--worker", suite, "--phase", phase,
               "--rounds", str(rounds), "--steps", str(steps), "--out", str(out)]
    proc = subprocess.run(command, env=env, capture_output=True, text=True)
    if proc.returncode != 0 or not out.is_file():
        raise SystemExit(f"the {suite} {phase} launch failed (exit {proc.returncode}):\n{(proc.stdout + proc.stderr)[-4000:]}")
    return json.loads(out.read_text())


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rows_from(runs: dict) -> list[dict]:
    """``runs``: suite -> phase -> the launch's output."""
    def samples(suite: str, phase: str) -> dict:
        return runs[suite][phase]["samples"]

    p, c, r = samples("prefetch", "time"), samples("checkpointing", "time"), samples("four_ranks", "time")
    c_peak, r_peak = samples("checkpointing", "memory"), samples("four_ranks", "memory")
    gpt = f"{runs['prefetch']['time']['params'] / 1e6:.1f}M-param GPT"
    rows = []
    for name in ("forward_prefetch=1", "backward_prefetch=2"):
        rows.append(figure(f"step time, {name} vs FSDP2's default prefetch", ratios(p[name], p["default"]),
                           baseline=f"default prefetch, {gpt}, 2 ranks",
                           detail={"seconds": p[name], "baseline_seconds": p["default"]}))
    rows.append(figure("step time, reshard_after_forward=2 vs True (4 ranks)", ratios(r["reshard=2"], r["reshard=True"]),
                       baseline="reshard_after_forward=True, 4 ranks",
                       detail={"seconds": r["reshard=2"], "baseline_seconds": r["reshard=True"]}))
    rows.append(figure("forward+backward peak, reshard_after_forward=2 vs True (4 ranks)",
                       ratios(r_peak["reshard=2"], r_peak["reshard=True"]), baseline="reshard_after_forward=True, 4 ranks",
                       detail={"extra_peak_bytes": r_peak["reshard=2"], "baseline_bytes": r_peak["reshard=True"]}))
    sequences = f"{SUITES['checkpointing'].batch}x{SUITES['checkpointing'].sequence} tokens per rank"
    for name in ("full", "every-2nd", "selective"):
        rows.append(figure(f"forward+backward peak, checkpointing {name} vs none", ratios(c_peak[name], c_peak["none"]),
                           baseline=f"no activation checkpointing, {sequences}",
                           target=("<=", 1.0) if name == "selective" else None,
                           detail={"extra_peak_bytes": c_peak[name], "baseline_bytes": c_peak["none"]}))
        rows.append(figure(f"step time, checkpointing {name} vs none", ratios(c[name], c["none"]),
                           baseline=f"no activation checkpointing, {sequences}",
                           detail={"seconds": c[name], "baseline_seconds": c["none"]}))
    rows.append(figure("step time, checkpointing selective vs full", ratios(c["selective"], c["full"]),
                       baseline=f"full activation checkpointing, {sequences}", target=("<=", 1.0),
                       detail={"seconds": c["selective"], "baseline_seconds": c["full"]}))
    rows.append(figure("forward+backward peak, checkpointing selective vs full",
                       ratios(c_peak["selective"], c_peak["full"]), baseline=f"full activation checkpointing, {sequences}",
                       detail={"extra_peak_bytes": c_peak["selective"], "baseline_bytes": c_peak["full"]}))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--memory-rounds", type=int, default=2, help="rounds of the memory phase")
    parser.add_argument("--steps", type=int, default=1, help="timed steps per configuration and round")
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--worker", choices=sorted(SUITES), help=argparse.SUPPRESS)
    parser.add_argument("--phase", choices=("time", "memory"), help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.phase, args.rounds, args.steps, args.out)
        return
    start = time.perf_counter()
    phases = {"prefetch": ("time",), "checkpointing": ("time", "memory"), "four_ranks": ("time", "memory")}
    with tempfile.TemporaryDirectory() as folder:
        runs = {suite: {phase: launch(suite, phase, args.rounds if phase == "time" else args.memory_rounds, args.steps,
                                      Path(folder)) for phase in suite_phases}
                for suite, suite_phases in phases.items()}
    rows = rows_from(runs)
    selective_peak = next(r for r in rows if r["figure"] == "forward+backward peak, checkpointing selective vs none")
    selective_time = next(r for r in rows if r["figure"] == "step time, checkpointing selective vs full")
    shapes = ", ".join(f"{name} {s.batch}x{s.sequence} on {s.ranks} ranks" for name, s in SUITES.items())
    print(f"model: {runs['prefetch']['time']['params'] / 1e6:.1f}M params at 64 tokens; tokens per rank and step:"
          f" {shapes}; {args.rounds} rounds of step times, {args.memory_rounds} of memory,"
          f" {time.perf_counter() - start:.0f} s")
    print("selective uses less memory than none and steps faster than full:",
          "yes" if selective_peak["met"] and selective_time["met"] else "NO")
    emit(rows, args.json)


if __name__ == "__main__":
    main()
