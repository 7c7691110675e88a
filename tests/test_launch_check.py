"""``Launch.check``, on result files written here as a worker's harness writes them: what counts as a case's pass."""

from __future__ import annotations

import json

import pytest

from launch import Launch

pytestmark = pytest.mark.single_process


def _launch(tmp_path, details_by_rank: list, returncode: int = 0) -> Launch:
    for rank, details in enumerate(details_by_rank):
        record = {"ok": True, "error": None, "details": details}
        (tmp_path / f"case.rank{rank}.json").write_text(json.dumps(record))
    return Launch(out=tmp_path, world_size=len(details_by_rank), log="", returncode=returncode)


def test_a_case_that_passed_on_every_rank_gives_each_ranks_details(tmp_path):
    assert _launch(tmp_path, [{"x": 0}, {"x": 1}]).check("case") == [{"x": 0}, {"x": 1}]


def test_a_case_that_did_not_run_on_a_rank_is_no_pass(tmp_path):
    """`trainer_plan_measure.py` returns {"not_run": ...} for its 2-rank-only cases in its 1- and 4-rank launches:
    read there, such a case checked nothing, and passing it would hide that."""
    launch = _launch(tmp_path, [{"tracker_peak": 1}, {"not_run": "2 ranks only"}])
    with pytest.raises(pytest.fail.Exception, match=r"'case' did not run on rank 1 .*\(2 ranks only\).*HINT"):
        launch.check("case")
