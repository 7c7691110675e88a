"""A rank that dies inside a case of a pool (``launch.run_pool``) costs at most that case, not the pool's cases after it.

Shown with ``workers/crashy.py``, whose cases segfault rank 0 on purpose. The pool starts again after each crash and
runs the case once more: one that crashed only once passes, its first crash's stacks kept beside it (and listed in
the summary); one that crashes every time fails, naming the rank that ended in it and showing faulthandler's stack.
The cases after them run in new processes and pass; the case before them keeps the result of the first start."""

from __future__ import annotations

import pytest

from launch import LAUNCHED, POOL_NICE, Launch, run_pool

# Two-rank pools started again and again: both cores stay busy (conftest.py runs such tests late).
pytestmark = pytest.mark.fills_both_cores


@pytest.fixture(scope="module")
def crashy(tmp_path_factory) -> tuple[Launch, str]:
    out, log, returncode, _ = run_pool((2, ()), tmp_path_factory.mktemp("crashy") / "pool", ["crashy.py"])
    launch = Launch(out=out / "crashy", world_size=2, log=log, returncode=returncode)
    # These crashes are on purpose: the run's list of crashed cases (conftest.py) is for the ones that are not.
    LAUNCHED.discard(launch.out)
    return launch, log


def test_a_segfault_runs_its_case_again_and_fails_it_only_if_it_crashes_again(crashy):
    launch, log = crashy
    out, returncode = launch.out.parent, launch.returncode
    for name in ("segfaults_on_rank_0_in_its_first_run_only", "segfaults_on_rank_0_every_time"):
        assert f"the pool lost a rank in case crashy/{name};" in log, log[-3000:]

    once = launch.check("segfaults_on_rank_0_in_its_first_run_only")
    first_crash = (out / "crashy" / "segfaults_on_rank_0_in_its_first_run_only.rank0.crash.txt").read_text()
    assert "Fatal Python error: Segmentation fault" in first_crash and "_crash_rank_0" in first_crash, first_crash

    with pytest.raises(pytest.fail.Exception) as crashed:
        launch.check("segfaults_on_rank_0_every_time")
    message = str(crashed.value)
    assert "rank 0 ended inside this case" in message, message
    assert message.count("Fatal Python error: Segmentation fault") == 2, message  # the first run's and the second's
    assert "in segfaults_on_rank_0_every_time" in message, message  # faulthandler's stack names the case's frame

    first = launch.check("before_the_crashes")
    after = launch.check("after_the_crashes")
    assert set(after).isdisjoint(first) and set(once).isdisjoint(first), (first, once, after)
    assert returncode == 0, log[-3000:]  # the last start ran only the last case, and it passed


def test_a_pools_ranks_run_at_a_lower_priority(crashy):
    """The pools run beside the other tests and should take the CPU those leave idle (``launch.POOL_NICE``): each rank
    has that niceness, and so has its scheduling group where the kernel groups by session (autogroup), or the
    niceness would weigh against nothing."""
    for report in crashy[0].check("reports_its_priority"):
        assert report["nice"] == POOL_NICE, report
        assert report["autogroup"] is None or report["autogroup"].endswith(f"nice {POOL_NICE}"), report
