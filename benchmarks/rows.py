"""The figures every benchmark script reports, in one shape, so ``benchmarks/run_all.py`` can collect them.

A figure is a ratio against a baseline measured in the same invocation (the machines are shared and noisy, so only
side-by-side numbers mean anything). Each script measures the two sides in alternating order over several rounds,
turns each round into one ratio, and reports the median with the min and max:

    rows = [figure("sharded save throughput vs dd", ratios, baseline="dd conv=fdatasync", target=(">=", 0.6))]
    emit(rows, args.json)

``emit`` prints a table and, with a path, writes the rows as JSON for the one command.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

Target = Optional[tuple[str, float]]  # ("<=", 0.1): the median must be at most 0.1; None: reported only


def figure(name: str, samples: Sequence[float], *, baseline: str, target: Target = None, unit: str = "x",
           detail: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """One row: the median of ``samples`` with min and max, and whether the median meets ``target``."""
    if not samples:
        raise ValueError(f"figure {name!r} has no samples")
    median = statistics.median(samples)
    met = None
    if target is not None:
        op, bound = target
        if op not in ("<=", ">="):
            raise ValueError(f"target of {name!r} must be ('<=', x) or ('>=', x), got {target!r}")
        met = median <= bound if op == "<=" else median >= bound
    return {
        "figure": name,
        "median": median,
        "min": min(samples),
        "max": max(samples),
        "rounds": len(samples),
        "unit": unit,
        "baseline": baseline,
        "target": None if target is None else f"{target[0]} {target[1]:g}",
        "met": met,
        "detail": detail or {},
    }


def alternate(rounds: int, sides: dict[str, Callable[[], float]]) -> dict[str, list[float]]:
    """Run each side once per round, in an order that alternates from round to round, so drift in the machine's
    load hits every side alike. Each callable returns its own measurement (seconds, bytes, ...)."""
    names = list(sides)
    out: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names if r % 2 == 0 else reversed(names):
            out[name].append(sides[name]())
    return out


def ratios(numerator: Sequence[float], denominator: Sequence[float]) -> list[float]:
    """Per-round ratios of two sides measured in the same rounds."""
    return [a / b for a, b in zip(numerator, denominator)]


def timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    lines = [f"{'figure':<62} {'median':>8} {'min':>8} {'max':>8}  {'target':<8} met  baseline"]
    for r in rows:
        met = {True: "yes", False: "NO", None: "-"}[r["met"]]
        lines.append(f"{r['figure']:<62} {r['median']:>8.3f} {r['min']:>8.3f} {r['max']:>8.3f}  "
                     f"{r['target'] or '-':<8} {met:<4} {r['baseline']}")
    return "\n".join(lines)


def emit(rows: Sequence[dict[str, Any]], json_path: Optional[str | Path] = None) -> None:
    """Print the rows as a table; with ``json_path``, also write them there as a JSON list."""
    print(format_table(rows), flush=True)
    if json_path:
        Path(json_path).write_text(json.dumps(list(rows), indent=2))
