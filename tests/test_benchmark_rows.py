"""The shape every benchmark figure takes (``benchmarks/rows.py``): medians, targets, and the alternating order that
keeps a drifting machine from favouring one side."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from rows import alternate, emit, figure, ratios  # noqa: E402


def test_figure_reports_median_min_max_and_whether_the_target_is_met():
    row = figure("x", [1.2, 0.8, 1.0], baseline="b", target=("<=", 1.0))
    assert (row["median"], row["min"], row["max"], row["rounds"]) == (1.0, 0.8, 1.2, 3)
    assert row["met"] is True and row["target"] == "<= 1"
    assert figure("x", [0.5, 0.55], baseline="b", target=(">=", 0.6))["met"] is False
    assert figure("x", [3.0], baseline="b")["met"] is None


def test_figure_refuses_no_samples_and_unknown_targets():
    with pytest.raises(ValueError, match="no samples"):
        figure("x", [], baseline="b")
    with pytest.raises(ValueError, match="target"):
        figure("x", [1.0], baseline="b", target=("<", 1.0))


def test_alternate_swaps_the_order_every_round():
    order = []
    sides = {name: (lambda n=name: order.append(n) or len(order)) for name in ("a", "b", "c")}
    out = alternate(3, sides)
    assert order == ["a", "b", "c", "c", "b", "a", "a", "b", "c"]
    assert out == {"a": [1, 6, 7], "b": [2, 5, 8], "c": [3, 4, 9]}
    assert ratios([2.0, 3.0], [1.0, 2.0]) == [2.0, 1.5]


def test_emit_writes_the_rows_as_json(tmp_path, capsys):
    rows = [figure("step time vs DDP", [1.3, 1.2], baseline="DDP")]
    emit(rows, tmp_path / "rows.json")
    assert json.loads((tmp_path / "rows.json").read_text()) == rows
    assert "step time vs DDP" in capsys.readouterr().out


def _record(rows: list[dict], quick: bool = False, **machine) -> dict:
    return {"machine": dict({"date": "d0", "cpus": 2, "python": "3.11", "torch": "t", "cuda": None,
                             "command": "benchmarks/run_all.py", "quick": quick, "seconds": 500.0,
                             "seconds_per_script": {}}, **machine), "rows": rows}


def _row(name: str, script: str, median: float = 1.0) -> dict:
    return dict(figure(name, [median], baseline="b"), script=script)


def test_only_merges_its_scripts_rows_into_the_record_and_says_so():
    """`run_all.py --only NAME` replaces that script's rows, keeps every other row, orders rows as SCRIPTS does, and
    the table names the later run; re-measuring a merged script drops it from the earlier merged run."""
    from run_all import SCRIPTS, markdown, merge

    training, controls, tp = (SCRIPTS[n][0] for n in ("training", "controls", "tensor_parallel"))
    old = _record([_row("a", training), _row("old tp", tp), _row("c", controls)])
    meta = dict(_record([])["machine"], date="d1", command="benchmarks/run_all.py --only tensor_parallel",
                seconds=120.0, seconds_per_script={"tensor_parallel": 119.0})
    merged = merge(old, [_row("tp 1", tp, 0.9), _row("tp 2", tp)], meta, ["tensor_parallel"])
    assert [r["figure"] for r in merged["rows"]] == ["a", "c", "tp 1", "tp 2"]  # SCRIPTS order: tp comes last
    assert merged["machine"]["date"] == "d0" and merged["machine"]["seconds"] == 500.0  # the record's own run
    assert [(m["scripts"], m["date"]) for m in merged["machine"]["merged"]] == [([tp], "d1")]
    table = markdown(merged["rows"], merged["machine"])
    assert f"Rows of `{tp}` were measured later, d1 on 2 CPUs (torch t) with `{meta['command']}` in 120 s" in table
    again = merge(merged, [_row("tp 3", tp)], dict(meta, date="d2"), ["tensor_parallel"])
    assert [m["date"] for m in again["machine"]["merged"]] == ["d2"]
    assert [r["figure"] for r in again["rows"]] == ["a", "c", "tp 3"]
    assert "measured later" not in markdown(old["rows"], old["machine"])  # a record of one run reads as before


def test_only_never_mixes_quick_and_full_rows():
    from run_all import merge

    with pytest.raises(SystemExit, match="will not merge a --quick run into the record of a full run"):
        merge(_record([]), [], dict(_record([], quick=True)["machine"]), ["tensor_parallel"])
    with pytest.raises(SystemExit, match="will not merge a full run into the record of a --quick run"):
        merge(_record([], quick=True), [], dict(_record([])["machine"]), ["tensor_parallel"])


def test_tensor_parallel_ideal_counts_what_the_plan_splits():
    """The ideal of `tensor_parallel_figures.py`: per block, q/k/v and up split with their biases, o and down split
    but for their biases; everything else (embeddings, norms, head, those biases) is replicated over tp."""
    from run_all import SCRIPTS
    from tensor_parallel_figures import DP, PLAN, SIZES, TP, ideal_state_bytes, parameter_counts

    assert SCRIPTS["tensor_parallel"][0] == "tensor_parallel_figures.py" and (DP, TP) == (2, 2)
    assert set(PLAN.values()) == {"colwise", "rowwise"}
    cfg = SIZES["tiny"]
    d, layers = cfg.dim, cfg.layers
    split_per_block = 3 * (d * d + d) + d * d + (4 * d * d + 4 * d) + 4 * d * d
    counts = parameter_counts(cfg)
    assert counts["split"] == layers * split_per_block
    assert counts["total"] == counts["split"] + counts["replicated"]
    assert ideal_state_bytes(counts) == 16 * (counts["split"] / 4 + counts["replicated"] / 2)
