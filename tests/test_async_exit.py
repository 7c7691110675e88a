"""The last background save of a Fabric script is waited for at exit, and its failure is the process's (issue 21,
item 9): ``workers/async_exit.py`` ends with a background save in flight; torchrun's own exit status is checked."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import torch
from lightning.fabric.utilities.load import _load_distributed_checkpoint

from launch import LAUNCH_TIMEOUT_S, torchrun, worker_env

FAILED_LINE = "lightning_fsdp: OSError: [Errno 28] The background save of"


def _run(where: Path, out: Path) -> subprocess.CompletedProcess:
    # full_exit: the ranks end as new interpreters do (tests/forkserver), since their exit is what is checked.
    return subprocess.run(torchrun("async_exit.py", 2), env=worker_env(out, full_exit=True, LFSDP_EXIT_DIR=str(where)),
                          capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)


def _holds_exactly(path: Path, expected_file: Path) -> None:
    expected = torch.load(expected_file, weights_only=True)
    got = _load_distributed_checkpoint(path)
    assert sorted(got["model"]) == sorted(expected["model"])
    for name, tensor in expected["model"].items():
        assert torch.equal(got["model"][name], tensor), f"model tensor {name} differs"
    assert sorted(got["optimizer"]["state"]) == sorted(expected["optimizer"])
    for name, per_param in expected["optimizer"].items():
        for key, value in per_param.items():
            assert torch.equal(torch.as_tensor(got["optimizer"]["state"][name][key]), torch.as_tensor(value)), (name, key)


def test_a_last_background_save_that_fails_makes_the_exit_status_non_zero(tmpfs, tmp_path):
    where = tmpfs("2m")  # one checkpoint of this model (~1.3 MB) fits, two do not: the second save fails
    run = _run(where, tmp_path / "out")
    log = run.stdout + run.stderr
    assert log.count("the script's last line ran") == 2, log[-4000:]
    assert run.returncode != 0, f"exit status 0 although the last save failed:\n{log[-4000:]}"
    # Every rank reports it, with the same message: the cause, the path and the failing rank.
    # (Found anywhere in a line: the two ranks write to one stream, and their lines can run into each other.)
    reports = re.findall(re.escape(FAILED_LINE) + r"[^\n]*", log)
    assert len(reports) == 2 and reports[0] == reports[1], log[-4000:]
    assert "No space left on device" in reports[0] and str(where / "ckpt") in reports[0], reports[0]
    assert "failed on rank" in reports[0], reports[0]
    # The first checkpoint is still there, exactly, and nothing else is.
    assert sorted(p.name for p in where.iterdir()) == ["ckpt"], sorted(where.iterdir())
    _holds_exactly(where / "ckpt", tmp_path / "out" / "saved-1.pt")


def test_a_last_background_save_that_succeeds_is_complete_and_exits_zero(tmp_path):
    where = tmp_path / "checkpoints"
    run = _run(where, tmp_path / "out")
    log = run.stdout + run.stderr
    assert run.returncode == 0, log[-4000:]
    assert FAILED_LINE not in log, log[-4000:]
    assert sorted(p.name for p in where.iterdir()) == ["ckpt"], sorted(where.iterdir())
    _holds_exactly(where / "ckpt", tmp_path / "out" / "saved-2.pt")


def test_the_last_background_save_of_a_fit_that_fails_makes_the_exit_status_non_zero(tmp_path):
    """The Trainer front: the strategy's teardown at the end of ``fit`` waits for the save and raises its error."""
    where = tmp_path / "checkpoints"
    run = subprocess.run(torchrun("async_exit_trainer.py", 2), env=worker_env(tmp_path / "out", full_exit=True,
                                                                                  LFSDP_EXIT_DIR=str(where)),
                         capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)
    log = run.stdout + run.stderr
    assert run.returncode != 0, f"exit status 0 although the last save failed:\n{log[-4000:]}"
    reports = [line for line in log.splitlines() if "The background save of" in line and "No space left" in line]
    tails = {r.split("The background save of", 1)[1] for r in reports}
    assert len(reports) >= 2 and len(tails) == 1, log[-4000:]  # every rank, the same error
    assert "fit returned" not in log, log[-4000:]
    assert sorted(p.name for p in where.iterdir()) == ["step=1.ckpt"], sorted(where.iterdir())
