"""Extra peak memory of ``lightning-fsdp convert`` against the model's size (issue 13: at most 0.1x).

A child process builds a model of about 285 MB (64 blocks of a 1024 x 1024 fp32 weight and a bias, plus a
2048 x 1024 embedding, the largest tensor at 8 MiB) and writes it as a sharded checkpoint (a full file converted
by ``lightning-fsdp convert``, so it carries checksums like a saved one); it exits, so none of
its memory stays behind. A second child process then converts that checkpoint over and over, the two conversions
in alternating order round by round:

- to one safetensors file (``--to safetensors``, DST ending in ``.safetensors``): every weight in one file;
- to a full file (``--to full``).

Before each conversion: ``gc.collect()``, ``malloc_trim(0)`` (freed heap memory would otherwise hide the next
conversion's allocations), and ``5 > /proc/self/clear_refs``, which resets the peak RSS (``VmHWM``) to the current
RSS. After it: the peak minus the RSS before is the conversion's extra memory; each sample is that over the model's
tensor bytes (``benchmarks/rows.py``). Memory is never asserted here; ``tests/test_cli.py`` holds the bound.

    python benchmarks/convert_memory.py [--json PATH] [--rounds 3] [--layers 64]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peak_memory import reset_peak, status_kib  # noqa: E402
from rows import alternate, emit, figure  # noqa: E402

WIDTH = 1024
VOCAB = 2048


def generate(out: Path, layers: int) -> None:
    import torch

    from lightning_fsdp.checkpoint.convert import convert

    torch.manual_seed(0)
    model = {"embed.weight": torch.randn(VOCAB, WIDTH)}
    for i in range(layers):
        model[f"layers.{i}.weight"] = torch.randn(WIDTH, WIDTH)
        model[f"layers.{i}.bias"] = torch.randn(WIDTH)
    torch.save({"model": model, "step": 1}, out / "full.pt")
    convert(out / "full.pt", out / "sharded", to="sharded")
    (out / "full.pt").unlink()


def measure(out: Path, rounds: int) -> dict:
    import safetensors.torch  # noqa: F401 - imported before measuring: an import is not conversion memory

    from lightning_fsdp.checkpoint.convert import convert

    counter = iter(range(10**6))

    def extra(target: str, to: str) -> float:
        destination = out / f"{next(counter)}-{target}"
        baseline = reset_peak()
        convert(out / "sharded", destination, to=to)
        peak = (status_kib("VmHWM") - baseline) * 1024
        destination.unlink()
        return peak

    return alternate(rounds, {"safetensors": lambda: extra("model.safetensors", "safetensors"),
                              "full": lambda: extra("full.pt", "full")})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the rows to this file")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--layers", type=int, default=64)
    parser.add_argument("--generate", help=argparse.SUPPRESS)
    parser.add_argument("--measure", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.generate:
        generate(Path(args.generate), args.layers)
        return
    if args.measure:
        print(json.dumps(measure(Path(args.measure), args.rounds)))
        return
    out = Path(tempfile.mkdtemp(prefix="convert-memory-"))
    try:
        subprocess.run([sys.executable, __file__, "--generate", str(out), "--layers", str(args.layers)], check=True)
        result = subprocess.run([sys.executable, __file__, "--measure", str(out), "--rounds", str(args.rounds)],
                                check=True, stdout=subprocess.PIPE, text=True)
    finally:
        shutil.rmtree(out, ignore_errors=True)
    peaks = json.loads(result.stdout.strip().splitlines()[-1])
    model_bytes = (VOCAB * WIDTH + args.layers * (WIDTH * WIDTH + WIDTH)) * 4
    detail = {"model_bytes": model_bytes, "largest_tensor_bytes": VOCAB * WIDTH * 4}
    rows = [
        figure("convert to one safetensors file: extra peak vs model bytes",
               [p / model_bytes for p in peaks["safetensors"]], baseline="the model's tensor bytes",
               target=("<=", 0.1), detail={**detail, "extra_peak_bytes": peaks["safetensors"]}),
        figure("convert to a full file: extra peak vs model bytes", [p / model_bytes for p in peaks["full"]],
               baseline="the model's tensor bytes", target=("<=", 0.1),
               detail={**detail, "extra_peak_bytes": peaks["full"]}),
    ]
    emit(rows, args.json)


if __name__ == "__main__":
    main()
