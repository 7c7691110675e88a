"""Issue 42 item 3: the commit order trusts no clock. A job requeued on a host whose clock is behind resumes from step
100 and saves step 200; retention with ``keep_last=1`` must keep step 200 (the save it has just committed) and
``latest`` must find it, on a local disk and in a bucket, whatever either job's clock said.

Each "job" here is a new process as far as the commit order can tell: the counter this process kept and what it
learned about each checkpoint are forgotten (a requeued job starts with neither), and its clock (``time.time_ns``
and ``time.time``, for every caller) is set off by a day. In this one process, without that, the first job's
counter would carry the second job past the bug.
"""

from __future__ import annotations

import time
import warnings

import pytest
import torch

from lightning_fsdp.checkpoint.io.one_process import OneProcess

DAY_S = 86_400


@pytest.fixture()
def job(monkeypatch):
    """``job(offset_s)``: from now on this process is a new job whose clock is ``offset_s`` seconds off."""
    from lightning_fsdp.checkpoint import latest
    from lightning_fsdp.checkpoint.formats import commit_order

    real_ns, real_s = time.time_ns, time.time

    def start(offset_s: int) -> None:
        monkeypatch.setattr(commit_order, "_last", 0)
        monkeypatch.setattr(latest, "_KNOWN", {})
        monkeypatch.setattr(time, "time_ns", lambda: real_ns() + offset_s * 10**9)
        monkeypatch.setattr(time, "time", lambda: real_s() + offset_s)

    return start


def _save(directory, step, sharded):
    from lightning_fsdp.checkpoint.save import write_full, write_sharded

    path = f"{directory}/step-{step:08d}"
    model = {"w": torch.full((8,), float(step))}
    if sharded:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # DCP "assumes" one process: that is the intent here
            write_sharded(path, {"model": model}, {"step": step}, OneProcess())
    else:
        write_full(path, {"model": model, "step": step}, OneProcess())
    return path


def _requeued_job_keeps_its_new_checkpoint(directory, job, sharded, first_clock_s, second_clock_s):
    from lightning_fsdp.checkpoint.latest import commit_order_of, newest_good_checkpoint, step_checkpoints
    from lightning_fsdp.checkpoint.retention import prune

    job(first_clock_s)
    step_100 = _save(directory, 100, sharded)
    job(second_clock_s)  # requeued: a new process, on a host whose clock is a day behind the first one's
    assert str(newest_good_checkpoint(directory)) == step_100  # it resumes from step 100
    step_200 = _save(directory, 200, sharded)
    order_100 = commit_order_of(step_100)
    assert [str(p) for p in prune(directory, keep_last=1)] == [step_100]  # StepCheckpoints(keep_last=1) after 200
    assert [str(p) for p in step_checkpoints(directory)] == [step_200]
    assert commit_order_of(step_200) > order_100
    assert str(newest_good_checkpoint(directory)) == step_200


# The second job's clock a day behind the first's: set back a day, or the first one's set a day ahead.
CLOCKS = pytest.mark.parametrize("first_clock_s, second_clock_s", [(0, -DAY_S), (DAY_S, 0)],
                                 ids=["set_back_a_day", "first_a_day_ahead"])


@CLOCKS
@pytest.mark.parametrize("sharded", [True, False], ids=["sharded", "full"])
def test_a_requeued_job_with_a_clock_behind_keeps_its_new_checkpoint_locally(tmp_path, job, sharded, first_clock_s,
                                                                             second_clock_s):
    _requeued_job_keeps_its_new_checkpoint(str(tmp_path / "run"), job, sharded, first_clock_s, second_clock_s)


@CLOCKS
def test_a_requeued_job_with_a_clock_behind_keeps_its_new_checkpoint_in_a_bucket(s3_server, monkeypatch, job,
                                                                                 first_clock_s, second_clock_s):
    s3_server.setenv(monkeypatch)
    directory = f"s3://{s3_server.bucket()}/run"
    _requeued_job_keeps_its_new_checkpoint(directory, job, True, first_clock_s, second_clock_s)
