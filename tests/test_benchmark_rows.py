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
