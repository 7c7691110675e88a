"""A rank that dies inside a case of a pool (``launch.run_pool``) costs that case, not the pool's cases after it.

Shown with ``workers/crashy.py``, whose middle case segfaults rank 0 on purpose: that case must fail, naming the
rank that ended in it and showing faulthandler's stack of the crash; the pool must start again for the cases it had
not reached, which then pass in new processes; the case before the crash keeps the result of the first start."""

from __future__ import annotations

from launch import Launch, run_pool

import pytest


def test_a_segfault_fails_its_case_and_the_pool_runs_the_cases_after_it(tmp_path):
    out, log, returncode, _ = run_pool((2, ()), tmp_path / "pool", ["crashy.py"])
    launch = Launch(out=out / "crashy", world_size=2, log=log, returncode=returncode)
    assert "the pool lost a rank in case crashy/segfaults_on_rank_0;" in log, log[-3000:]

    with pytest.raises(pytest.fail.Exception) as crashed:
        launch.check("segfaults_on_rank_0")
    message = str(crashed.value)
    assert "rank 0 ended inside this case" in message, message
    assert "Fatal Python error: Segmentation fault" in message, message
    assert "in segfaults_on_rank_0" in message, message  # faulthandler's stack names the case's frame

    first = launch.check("before_the_crash")
    after = launch.check("after_the_crash")
    assert set(after).isdisjoint(first), ("the cases after the crash ran in the processes of the first start", first,
                                          after)
    assert returncode == 0, log[-3000:]  # the second start ran only the last case, and it passed
