"""Every performance figure of the project, in one command (issue 13).

    bash benchmarks/run.sh            # installs the benchmark extras, then runs this
    .venv/bin/python benchmarks/run_all.py [--quick] [--only training,save] [--out docs]

Each script in ``SCRIPTS`` measures its figures as ratios against a baseline run in the same invocation, the sides
alternating across rounds, and reports median, min and max (``rows.py``). This collects their rows into
``docs/benchmarks.json`` and ``docs/benchmarks-table.md`` (included by ``docs/benchmarks.md``) and draws ``docs/*.png``: memory per rank against N, step time per
configuration, and save throughput against the disk. Timings are of this machine at the time of the run: compare
ratios, not seconds. ``--quick`` runs every script with small models and one or two rounds, to check that they work.

``--only`` re-measures some scripts and merges their rows into the record already in ``--out`` (``merge``): the rows
of the scripts it ran replace theirs, every other row stays as it was, and the record notes when, where and with what
command the merged rows were measured (the table says so under its first line). Without a record there, it writes
one of just those scripts. A ``--quick`` run is never merged into a full record, nor a full run into a quick one.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from rows import format_table  # noqa: E402

# name -> (script, arguments for a full run, arguments for --quick)
SCRIPTS: dict[str, tuple[str, list[str], list[str]]] = {
    "training": ("training_figures.py", [], ["--size", "tiny", "--rounds", "2", "--steps", "1"]),
    "save": ("save_figures.py", [], ["--rounds", "1", "--layers", "2", "--dim", "192"]),
    "load": ("checksum_cost.py", [], ["--rounds", "1", "--loads", "1", "--layers", "2", "--dim", "256"]),
    "convert": ("convert_memory.py", [], ["--rounds", "1", "--layers", "4"]),
    "controls": ("controls.py", [], ["--rounds", "1", "--memory-rounds", "1", "--steps", "1"]),
    "mfu": ("mfu.py", [], ["--rounds", "1", "--steps", "2"]),  # reports nothing without a CUDA device
    "tensor_parallel": ("tensor_parallel_figures.py", [], ["--size", "tiny", "--rounds", "2", "--steps", "1"]),
    "plan": ("plan_speed.py", [], ["--quick", "--rounds", "1"]),
    "object_storage": ("object_storage.py", [], ["--rounds", "1", "--layers", "2", "--dim", "96"]),
    "fault_tolerance": ("fault_tolerance.py", [], ["--rounds", "1", "--steps", "4", "--warmup", "2", "--layers", "2",
                                                   "--dim", "128", "--vocab", "512"]),
}


def run_script(name: str, quick: bool, tmp: Path) -> tuple[list[dict], float]:
    script, full_args, quick_args = SCRIPTS[name]
    out = tmp / f"{name}.json"
    cmd = [sys.executable, str(HERE / script), "--json", str(out), *(quick_args if quick else full_args)]
    print(f"[run_all] {name}: {' '.join(cmd[1:])}", flush=True)
    start = time.perf_counter()
    run = subprocess.run(cmd, cwd=HERE.parent)
    elapsed = time.perf_counter() - start
    if run.returncode != 0:
        raise SystemExit(f"[run_all] {name} failed with exit code {run.returncode}")
    rows = json.loads(out.read_text())
    for row in rows:
        row["script"] = script
    return rows, elapsed


def machine() -> dict:
    import torch

    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def markdown(rows: list[dict], meta: dict) -> str:
    quick = ["**Quick run** (`--quick`: small models, one or two rounds): it checks that the scripts work; its"
             " figures are not measurements of the targets.", ""] if meta["quick"] else []
    lines = quick + [
        f"Measured {meta['date']} on {meta['cpus']} CPUs (torch {meta['torch']}) with `{meta['command']}`"
        f" in {meta['seconds']:.0f} s. Each figure: median (min-max) of per-round ratios against the baseline run"
        " in the same invocation.",
        *[f"Rows of {', '.join(f'`{s}`' for s in run['scripts'])} were measured later, {run['date']} on"
          f" {run['cpus']} CPUs (torch {run['torch']}) with `{run['command']}` in {run['seconds']:.0f} s, and merged"
          " into this record." for run in meta.get("merged", [])],
        "",
        "| figure | median | min-max | target | met | baseline |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        met = {True: "yes", False: "**no**", None: "-"}[r["met"]]
        lines.append(f"| {r['figure']} | {r['median']:.3f} | {r['min']:.3f}-{r['max']:.3f} | {r['target'] or '-'} |"
                     f" {met} | {r['baseline']} |")
    return "\n".join(lines) + "\n"


def check_mergeable(record: dict, quick: bool) -> None:
    """Refuse to mix a --quick run's rows with a full run's (checked before anything runs, and again in ``merge``)."""
    if bool(record["machine"].get("quick")) != bool(quick):
        kinds = {True: "a --quick run", False: "a full run"}
        raise SystemExit(f"[run_all] will not merge {kinds[bool(quick)]} into the record of"
                         f" {kinds[bool(record['machine'].get('quick'))]}: pass --out to write it elsewhere")


def merge(record: dict, rows: list[dict], meta: dict, names: list[str]) -> dict:
    """The record ``{"machine": ..., "rows": ...}`` with the rows of the scripts ``names`` replaced by ``rows``
    (measured by a run described by ``meta``), the rows in the order of ``SCRIPTS``. The record's own machine
    description stays; ``machine["merged"]`` lists each later run whose rows it now holds (an earlier merged run
    whose scripts were all measured again is dropped)."""
    check_mergeable(record, meta["quick"])
    scripts = [SCRIPTS[n][0] for n in names]
    order = [script for script, _, _ in SCRIPTS.values()]
    kept = [r for r in record["rows"] if r.get("script") not in scripts]
    merged_rows = sorted([*kept, *rows],  # a stable sort: each script's rows keep their own order
                         key=lambda r: order.index(r["script"]) if r.get("script") in order else len(order))
    machine = dict(record["machine"])
    earlier = [dict(run, scripts=[s for s in run["scripts"] if s not in scripts]) for run in machine.get("merged", [])]
    machine["merged"] = [run for run in earlier if run["scripts"]] + [{
        "scripts": scripts, "date": meta["date"], "cpus": meta["cpus"], "python": meta["python"],
        "torch": meta["torch"], "cuda": meta["cuda"], "command": meta["command"], "seconds": meta["seconds"],
        "seconds_per_script": meta["seconds_per_script"],
    }]
    return {"machine": machine, "rows": merged_rows}


# ------------------------------------------------------------------------------------------------------- plots


def plot(rows: list[dict], out: Path) -> list[Path]:
    """Draw the figures that have data in ``rows``; return the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []

    memory = [r for r in rows if r["figure"].startswith("model-state bytes per rank")]
    if memory:
        fig, ax = plt.subplots(figsize=(5, 3.5))
        ns = [r["detail"]["N"] for r in memory]
        ax.plot(ns, [r["detail"]["ideal"] / 2**20 for r in memory], "k--", label="ideal 16·P/N")
        ax.plot(ns, [max(r["detail"]["bytes_per_rank"]) / 2**20 for r in memory], "o-",
                label="params + grads + AdamW (max rank)")
        setup = [r for r in rows if r["figure"].startswith("setup peak with empty_init")]
        if setup:
            setup_ns = [r["detail"]["N"] for r in setup]
            ax.plot(setup_ns, [r["detail"]["ideal"] / 2**20 for r in setup], "k:", label="ideal P·4/N + largest unit")
            ax.plot(setup_ns, [max(r["detail"]["peak_bytes_per_rank"]) / 2**20 for r in setup], "s-",
                    label="setup peak, empty_init (max rank)")
        ax.set_xlabel("ranks N")
        ax.set_ylabel("MiB per rank")
        ax.set_xticks(ns)
        ax.set_title("Memory per rank against N")
        ax.legend()
        written.append(_save(fig, out / "memory_per_rank.png"))

    steps = [r for r in rows if r["figure"].startswith("step time")]
    if steps:
        names = [r["figure"].replace("step time ", "") for r in steps]
        # Wide enough for the longest label beside a plot of about 3.5 inches.
        fig, ax = plt.subplots(figsize=(max(7.0, 3.5 + 0.075 * max(map(len, names))), 0.45 * len(steps) + 1.2))
        medians = [r["median"] for r in steps]
        errors = [[m - r["min"] for m, r in zip(medians, steps)], [r["max"] - m for m, r in zip(medians, steps)]]
        ax.barh(names, medians, xerr=errors, color="tab:blue")
        ax.axvline(1.0, color="k", lw=0.8)
        ax.invert_yaxis()
        ax.set_xlabel("step time ratio (median, min-max)")
        ax.set_title("Step time per configuration")
        written.append(_save(fig, out / "step_time.png"))

    saves = [r for r in rows if "throughput_mb_s" in r.get("detail", {})]
    if saves:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        labels, values = [], []
        for r in saves:
            for side, mb_s in r["detail"]["throughput_mb_s"].items():
                labels.append(side)
                values.append(mb_s)
        ax.bar(labels, values, color="tab:green")
        ax.set_ylabel("MB/s (median)")
        ax.set_title("Save throughput against the disk")
        ax.tick_params(axis="x", labelrotation=20)
        written.append(_save(fig, out / "save_throughput.png"))
    return written


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small models, one or two rounds: a smoke run")
    parser.add_argument("--only", help=f"comma-separated subset of: {', '.join(SCRIPTS)}; their rows are merged into"
                        " the record already in --out, replacing their old ones")
    parser.add_argument("--out", default=str(HERE.parent / "docs"), help="where the JSON, table and plots go")
    args = parser.parse_args()
    names = args.only.split(",") if args.only else list(SCRIPTS)
    unknown = [n for n in names if n not in SCRIPTS]
    if unknown:
        parser.error(f"--only: unknown {unknown}; choose from {', '.join(SCRIPTS)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    existing = out / "benchmarks.json"
    old_record = json.loads(existing.read_text()) if args.only and existing.is_file() else None
    if old_record is not None:
        check_mergeable(old_record, args.quick)  # before minutes of measuring, not after

    import tempfile

    start = time.perf_counter()
    rows: list[dict] = []
    timings = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            script_rows, timings[name] = run_script(name, args.quick, Path(tmp))
            rows.extend(script_rows)
    meta = machine()
    meta["command"] = " ".join(["benchmarks/run_all.py", *sys.argv[1:]])
    meta["quick"] = args.quick
    meta["seconds"] = time.perf_counter() - start
    meta["seconds_per_script"] = timings
    record = {"machine": meta, "rows": rows}
    if old_record is not None:
        record = merge(old_record, rows, meta, names)
        print(f"[run_all] merged the rows of {', '.join(names)} into {existing}")
    rows, meta = record["rows"], record["machine"]
    existing.write_text(json.dumps(record, indent=2))
    (out / "benchmarks-table.md").write_text(markdown(rows, meta))
    pictures = plot(rows, out)
    print(format_table(rows))
    print(f"[run_all] measured in {time.perf_counter() - start:.0f} s; {len(rows)} figures in the record; wrote"
          f" {existing}, {out / 'benchmarks-table.md'} and {', '.join(p.name for p in pictures)}")
    missed = [r["figure"] for r in rows if r["met"] is False]
    if missed:
        print(f"[run_all] targets missed: {missed}")
    if args.quick:
        print("[run_all] --quick: small models and few rounds; the figures only show that every script works")


if __name__ == "__main__":
    main()
