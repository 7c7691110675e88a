"""Resume from the newest good checkpoint and retention: 2-rank cases in one launch, plus single-process checks of
the retention rules and the argument errors."""

from __future__ import annotations

import pytest
import torch

from launch import case_tests

CASES = [
    "latest_skips_corrupted_and_half_written_newest",
    "latest_in_an_empty_directory_is_an_error_on_every_rank",
    "retention_deletes_only_after_the_newer_commit",
    "retention_is_exact_once_committed_in_both_save_modes",
]
results, test_case = case_tests("resume_cases.py", 2, CASES)


def _full(path):
    torch.save({"model": {"w": torch.ones(2)}}, path)


def test_retention_keeps_newest_and_every_mth_and_leaves_user_files(tmp_path):
    from lightning_fsdp.checkpoint.retention import prune

    for step in (1, 2, 3, 4, 5, 6):
        _full(tmp_path / f"step-{step:08d}")
    (tmp_path / "notes-7.txt").write_text("mine")  # a step number, but not a checkpoint
    (tmp_path / ".step-00000008.abc.staging").mkdir()  # a save in flight
    deleted = prune(tmp_path, keep_last=2, keep_every=3)
    assert [p.name for p in deleted] == ["step-00000001", "step-00000002", "step-00000004"]
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == [".step-00000008.abc.staging", "notes-7.txt", "step-00000003", "step-00000005", "step-00000006"]


def test_retention_never_deletes_the_only_complete_checkpoint(tmp_path):
    from lightning_fsdp.checkpoint.retention import prune

    _full(tmp_path / "step-00000001")
    (tmp_path / "step-00000002").mkdir()  # not a checkpoint (no DCP metadata): not counted as the newest
    assert prune(tmp_path, keep_last=1) == []
    assert (tmp_path / "step-00000001").is_file()


@pytest.mark.parametrize("kwargs, words", [
    ({"keep_last": 0}, ["keep_last=0", "positive int"]),
    ({"keep_every": -2}, ["keep_every=-2", "positive int"]),
    ({"name": "ckpt-{step}-final"}, ["must end in the step number", "step-{step:08d}"]),
])
def test_step_checkpoints_refuses_bad_arguments(tmp_path, kwargs, words):
    from lightning_fsdp.step_checkpoints import StepCheckpoints

    with pytest.raises(ValueError) as err:
        StepCheckpoints(object(), tmp_path, **kwargs)
    assert all(w in str(err.value) for w in words), str(err.value)


@pytest.mark.parametrize("kwargs, words", [
    ({"action": "reboot"}, ["action='reboot'", "'exit', 'requeue', 'stop'"]),
    ({"signals": ["SIGNOPE"]}, ["'SIGNOPE'", "SIGTERM"]),
    ({"signals": ["SIGKILL"]}, ["SIGKILL", "cannot be caught"]),
    ({"exit_code": 256}, ["exit_code=256", "0 to 255"]),
])
def test_preemption_refuses_bad_arguments(kwargs, words):
    from lightning_fsdp.preemption import Preemption

    with pytest.raises(ValueError) as err:
        Preemption(**kwargs)
    assert all(w in str(err.value) for w in words), str(err.value)
