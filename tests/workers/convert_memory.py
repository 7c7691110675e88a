"""Peak memory of the offline conversions, for ``tests/test_cli.py`` and by hand:

    python tests/workers/convert_memory.py OUT_DIR

A child process writes a model of 48 x 4 MiB weights plus small biases (201.5 MB) as a full file and as a sharded
checkpoint; the child exits, so none of its memory is left in this process. Then this process converts them,
one conversion after another. Before each: ``malloc_trim(0)`` returns freed heap memory (otherwise
the next conversion reuses it unseen) and ``5 > /proc/self/clear_refs`` resets the peak to the current RSS.
After each: the peak (``VmHWM``) minus that baseline is the conversion's extra memory. Prints one JSON object:
``{"model_bytes": ..., "extra_peak_bytes": {conversion: bytes}}``.
"""

from __future__ import annotations

import ctypes
import gc
import json
import re
import subprocess
import sys
import warnings
from pathlib import Path

import torch

LAYERS = 48
WIDTH = 1024
CONVERSIONS = {
    "sharded->full": ("sharded", "out-full.pt", {"to": "full"}),
    "full->safetensors": ("full.pt", "out-full-st", {"to": "safetensors", "max_shard_size": 20_000_000}),
    "sharded->safetensors": ("sharded", "out-sharded-st", {"to": "safetensors", "max_shard_size": 20_000_000}),
    "full->sharded": ("full.pt", "out-sharded", {"to": "sharded"}),
    # One file holding every weight: streamed a tensor at a time, so no shard term in its bound.
    "sharded->one safetensors file": ("sharded", "out-one.safetensors", {"to": "safetensors"}),
    "full->one safetensors file": ("full.pt", "out-one-full.safetensors", {"to": "safetensors"}),
}


def generate(out: Path) -> None:
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(0)
    model = {}
    for i in range(LAYERS):
        model[f"layers.{i}.weight"] = torch.randn(WIDTH, WIDTH)
        model[f"layers.{i}.bias"] = torch.randn(WIDTH)
    torch.save({"model": model, "step": 7}, out / "full.pt")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": model}, storage_writer=dcp.FileSystemWriter(out / "sharded"), no_dist=True)
    torch.save({"step": 7}, out / "sharded" / "meta.pt")


def _kib(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1))


def measure(out: Path) -> dict:
    import safetensors.torch  # noqa: F401 - imported before measuring: an import is not conversion memory

    from lightning_fsdp.checkpoint.convert import convert

    libc = ctypes.CDLL(None)
    extra = {}
    for name, (source, target, options) in CONVERSIONS.items():
        gc.collect()
        libc.malloc_trim(0)
        Path("/proc/self/clear_refs").write_text("5")
        baseline = _kib("VmRSS")
        convert(out / source, out / target, **options)
        extra[name] = (_kib("VmHWM") - baseline) * 1024
    return {"model_bytes": LAYERS * (WIDTH * WIDTH + WIDTH) * 4, "largest_tensor_bytes": WIDTH * WIDTH * 4,
            "shard_bytes": {name: options.get("max_shard_size", 0) for name, (_, _, options) in CONVERSIONS.items()},
            "extra_peak_bytes": extra}


if __name__ == "__main__":
    if sys.argv[1] == "--generate":
        generate(Path(sys.argv[2]))
    else:
        directory = Path(sys.argv[1])
        directory.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, __file__, "--generate", str(directory)], check=True)
        print(json.dumps(measure(directory)))
