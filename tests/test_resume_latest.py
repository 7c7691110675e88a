"""Resume from the newest good checkpoint and retention: 2-rank cases in one launch, plus single-process checks of
the retention rules and the argument errors."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from launch import case_tests

CASES = [
    "latest_skips_corrupted_and_half_written_newest",
    "latest_in_an_empty_directory_is_an_error_on_every_rank",
    "retention_deletes_only_after_the_newer_commit",
    "retention_is_exact_once_committed_in_both_save_modes",
    "retention_and_resume_follow_the_commit_order",
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


def _saved(path, step):
    """A full checkpoint as the strategy writes it: it records its commit order."""
    from lightning_fsdp.checkpoint.io.full_writer import write_full_checkpoint

    write_full_checkpoint(path, {"model": {"w": torch.full((64,), float(step))}, "step": step}, is_writer=True)
    return path


def _damage(path):
    data = bytearray(path.read_bytes())
    at = data.find(b"data/0") + 200  # inside the tensor record's bytes, past its local header
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


def _names(paths):
    return [p.name for p in paths]


@pytest.mark.single_process
def test_retention_keeps_good_checkpoints_by_commit_order_not_a_damaged_newer_step(tmp_path):
    """Issue 37 item 3: save 100 and 200, damage 200, save 110. By step order, keep_last=1 deleted 110 (the only
    good one) and kept the damaged 200; keep_last=2 kept the damaged 200 and one good one."""
    from lightning_fsdp.checkpoint.latest import newest_good_checkpoint, step_checkpoints
    from lightning_fsdp.checkpoint.retention import prune

    for keep_last, left in ((1, ["step-110"]), (2, ["step-100", "step-110", "step-200"])):
        root = tmp_path / f"keep-{keep_last}"
        root.mkdir()
        _saved(root / "step-100", 100)
        _saved(root / "step-200", 200)
        _damage(root / "step-200")
        _saved(root / "step-110", 110)
        assert _names(step_checkpoints(root)) == ["step-100", "step-200", "step-110"]  # commit order
        prune(root, keep_last=keep_last)
        assert sorted(p.name for p in root.iterdir()) == left, keep_last
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert newest_good_checkpoint(root) == root / "step-110"  # 110 is newer than 200: nothing skipped
        assert not caught, [str(w.message) for w in caught]
        # One more good save: the damaged 200 is now older than the N-th good one, and goes.
        _saved(root / "step-120", 120)
        prune(root, keep_last=keep_last)
        assert sorted(p.name for p in root.iterdir()) == ["step-110", "step-120"][-keep_last:], keep_last


@pytest.mark.single_process
def test_nothing_verifies_so_nothing_is_deleted(tmp_path):
    from lightning_fsdp.checkpoint.retention import prune

    for step in (1, 2):
        _damage(_saved(tmp_path / f"step-{step}", step))
    assert prune(tmp_path, keep_last=1) == []


@pytest.mark.single_process
def test_latest_follows_the_commit_after_a_rollback_and_survives_copies(tmp_path):
    """Issue 37 item 3: after loading step 100 by path and saving 110, the newest is 110, not the abandoned 200;
    the order is the one recorded in the checkpoints, so a copy that gives them new mtimes in another order keeps
    it. Checkpoints that record none (plain `torch.save`, older versions) come first, by step."""
    import shutil

    from lightning_fsdp.checkpoint.formats.commit_order import order_key
    from lightning_fsdp.checkpoint.latest import commit_order_of, newest_good_checkpoint, step_checkpoints
    from lightning_fsdp.checkpoint.retention import to_delete

    run = tmp_path / "run"
    run.mkdir()
    _full(run / "step-300")  # older than every recorded commit: no record
    _full(run / "step-050")
    for step in (100, 200, 110):
        _saved(run / f"step-{step}", step)
    assert commit_order_of(run / "step-300") is None and commit_order_of(run / "step-110") > 0
    expected = ["step-050", "step-300", "step-100", "step-200", "step-110"]
    assert _names(step_checkpoints(run)) == expected
    assert newest_good_checkpoint(run) == run / "step-110"
    assert _names(to_delete(run, keep_last=2)) == ["step-050", "step-300", "step-100"]
    copy = tmp_path / "copy"
    copy.mkdir()
    for name in reversed(expected):  # newest first: the mtimes now say the opposite
        shutil.copyfile(run / name, copy / name)
    assert _names(step_checkpoints(copy)) == expected
    assert order_key(7, None) < order_key(1, 0) and order_key(1, None) < order_key(2, None)
    from lightning_fsdp.checkpoint.latest import step_of

    assert [step_of(Path(n)) for n in ("step-00000100", "epoch=0-step=100.ckpt", "step=100-v1.ckpt", "last.ckpt")] == [
        100, 100, 100, None]


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
