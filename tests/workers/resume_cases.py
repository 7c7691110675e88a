"""Resume from the newest good checkpoint, and retention, on 2 ranks (one launch, many cases)."""

from __future__ import annotations

import os
import threading
import warnings
from pathlib import Path

import torch

from common import full_params, loss_fn, make_fabric
from harness import case, run_cases
from lightning_fsdp.step_checkpoints import StepCheckpoints
from models import TinyTransformer, make_batch

FABRIC = make_fabric(2)
ASYNC_FABRIC = make_fabric(2, async_save=True)
FULL_FABRIC = make_fabric(2, state_dict_type="full")


def _shared_dir(fabric, name: str) -> Path:
    root = Path(os.environ["LFSDP_TEST_OUT"]) / name
    fabric.barrier()
    return root


def _trained(fabric, seed: int):
    torch.manual_seed(0)
    plain = TinyTransformer()
    model, opt = fabric.setup(plain, torch.optim.AdamW(plain.parameters(), lr=1e-2))
    for step in range(seed):
        fabric.backward(loss_fn(model, make_batch(step, fabric.global_rank)))
        opt.step()
        opt.zero_grad()
    return model, opt


@case
def latest_skips_corrupted_and_half_written_newest():
    root = _shared_dir(FABRIC, "latest")
    model, opt = _trained(FABRIC, 2)
    FABRIC.save(root / "step-00000002", {"model": model, "optimizer": opt, "step": 2})
    expected = full_params(model)
    model4, opt4 = _trained(FABRIC, 4)
    FABRIC.save(root / "step-00000004", {"model": model4, "optimizer": opt4, "step": 4})
    model6, opt6 = _trained(FABRIC, 6)
    FABRIC.save(root / "step-00000006", {"model": model6, "optimizer": opt6, "step": 6})
    if FABRIC.global_rank == 0:
        # step 6: a save killed before its commit leaves only a hidden staging copy
        (root / "step-00000006").rename(root / ".step-00000006.0123456789ab.staging")
        shard = root / "step-00000004" / "__1_0.distcp"  # step 4: committed, then damaged on disk
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
    FABRIC.barrier()
    model, opt = _trained(FABRIC, 0)
    state = {"model": model, "optimizer": opt, "step": 0}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        FABRIC.load(root / "latest", state)
    assert state["step"] == 2, state["step"]
    got = full_params(model)
    assert all(torch.equal(got[k], expected[k]) for k in expected)
    named = [str(w.message) for w in caught if "step-00000004" in str(w.message)]
    if FABRIC.global_rank == 0:  # rank 0 checks and warns; the others load what it found
        assert named and "fails verification" in named[0], [str(w.message) for w in caught]
    return state["step"]


@case
def latest_in_an_empty_directory_is_an_error_on_every_rank():
    root = _shared_dir(FABRIC, "empty")
    model, opt = _trained(FABRIC, 0)
    try:
        FABRIC.load(root / "latest", {"model": model, "optimizer": opt})
    except FileNotFoundError as err:
        assert "No complete checkpoint to resume from" in str(err) and "HINT" in str(err), str(err)
    else:
        raise AssertionError("no error")
    assert StepCheckpoints(FABRIC, root).resume({"model": model, "optimizer": opt}) is None


def _committed(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if not p.name.startswith("."))


@case
def retention_deletes_only_after_the_newer_commit():
    """keep_last=1 with background saves: while a newer save is in flight, the committed one stays; once it is
    committed, exactly one is left (issue 26: before, the pruning ran when `save` returned and nothing pruned after
    the commit, so `keep_last + 1` were left)."""
    root = _shared_dir(ASYNC_FABRIC, "retention")
    model, opt = _trained(ASYNC_FABRIC, 1)
    checkpoints = StepCheckpoints(ASYNC_FABRIC, root, keep_last=1)
    state = {"model": model, "optimizer": opt, "step": 1}
    checkpoints.save(state)
    ASYNC_FABRIC.strategy.wait_for_saves()
    # Hold the next background write until we have looked: DCP's write of rank 0's shard waits on this event.
    from lightning_fsdp.checkpoint.integrity.sharded_write import ChecksumWriter

    release = threading.Event()
    original = ChecksumWriter.write_data

    def held(self, plan, planner):
        release.wait(60)
        return original(self, plan, planner)

    ChecksumWriter.write_data = held
    try:
        state["step"] = 2
        checkpoints.save(state)  # returns with step 2 in flight
        in_flight = _committed(root)
        release.set()
    finally:
        ChecksumWriter.write_data = original
    ASYNC_FABRIC.strategy.wait_for_saves()
    ASYNC_FABRIC.barrier()
    at_wait = _committed(root)
    assert in_flight == ["step-00000001"], in_flight  # the only complete checkpoint stays while 2 is written
    assert at_wait == ["step-00000002"], at_wait  # exactly keep_last once 2 is committed
    state["step"] = 3
    checkpoints.save(state)
    ASYNC_FABRIC.strategy.wait_for_saves()
    ASYNC_FABRIC.barrier()
    after = _committed(root)
    assert after == ["step-00000003"], after
    return {"in_flight": in_flight, "at_wait": at_wait, "after": after}


@case
def retention_is_exact_once_committed_in_both_save_modes():
    """The issue's reproduction, with background and synchronous saves: keep_last=2 over steps 1-4 leaves steps 3
    and 4 once every save is committed, whether that is seen at `wait_for_saves` or at the next save's return (which
    waits for the one before); keep_every=2 with keep_last=1 over steps 1-5 leaves 2, 4 and 5."""
    report = {}
    for label, fabric in (("async", ASYNC_FABRIC), ("sync", FABRIC)):
        model, opt = _trained(fabric, 1)
        root = _shared_dir(fabric, f"exact-{label}")
        checkpoints = StepCheckpoints(fabric, root, keep_last=2)
        seen = []
        for step in range(1, 5):
            checkpoints.save({"model": model, "optimizer": opt, "step": step})
            fabric.barrier()
            # At each save's return, every earlier save is committed and pruned: never fewer than one complete
            # checkpoint, never more than keep_last committed ones.
            seen.append(_committed(root))
        fabric.strategy.wait_for_saves()
        fabric.barrier()
        final = _committed(root)
        assert final == ["step-00000003", "step-00000004"], (label, final, seen)
        assert all(1 <= len(names) <= 2 for names in seen[1:]), (label, seen)
        every_root = _shared_dir(fabric, f"every-{label}")
        every = StepCheckpoints(fabric, every_root, keep_last=1, keep_every=2)
        for step in range(1, 6):
            every.save({"model": model, "optimizer": opt, "step": step})
        fabric.strategy.wait_for_saves()
        fabric.barrier()
        kept = _committed(every_root)
        assert kept == ["step-00000002", "step-00000004", "step-00000005"], (label, kept)
        report[label] = {"seen": seen, "final": final, "keep_every": kept}
    return report


def _damage(path: Path) -> None:
    """Flip one byte in the middle of a committed checkpoint's tensor bytes (rank 0; the caller waits at a barrier)."""
    target = path / "__1_0.distcp" if path.is_dir() else path
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0xFF
    target.write_bytes(bytes(data))


@case
def retention_and_resume_follow_the_commit_order():
    """Issue 37 item 3, with synchronous and background sharded saves and full ones. (a) keep_last=1: save 100 and
    200, damage 200; resume finds nothing, saves 110: step order deleted 110 and kept the damaged 200 (no good
    checkpoint left); now 110 is kept. (b) keep_last=2, same story: resume loads 100; after 110 two good ones stay.
    (c) a rollback: load 100 by path, save 110: resume and `<dir>/latest` load 110, not the abandoned 200."""
    report = {}
    for label, fabric in (("sync", FABRIC), ("async", ASYNC_FABRIC), ("full", FULL_FABRIC)):
        model, opt = _trained(fabric, 1)

        def save_at(checkpoints, step):
            checkpoints.save({"model": model, "optimizer": opt, "step": step})
            fabric.strategy.wait_for_saves()
            fabric.barrier()

        got = {}
        for keep_last in (1, 2):
            root = _shared_dir(fabric, f"order-{label}-{keep_last}")
            checkpoints = StepCheckpoints(fabric, root, keep_last=keep_last)
            save_at(checkpoints, 100)
            save_at(checkpoints, 200)
            if fabric.global_rank == 0:
                _damage(root / "step-00000200")
            fabric.barrier()
            state = {"model": model, "optimizer": opt, "step": -1}
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # rank 0 names the damaged 200
                resumed = checkpoints.resume(state)
            assert (resumed is None) == (keep_last == 1) and state["step"] == (-1 if keep_last == 1 else 100), (
                label, keep_last, resumed, state["step"])
            save_at(checkpoints, 110)
            left = _committed(root)
            state["step"] = -1
            assert checkpoints.resume(state) == root / "step-00000110" and state["step"] == 110, (label, left)
            got[keep_last] = left
        assert got[1] == ["step-00000110"], (label, got)
        assert got[2] == ["step-00000100", "step-00000110", "step-00000200"], (label, got)
        root = _shared_dir(fabric, f"rollback-{label}")
        checkpoints = StepCheckpoints(fabric, root, keep_last=3)
        save_at(checkpoints, 100)
        save_at(checkpoints, 200)
        state = {"model": model, "optimizer": opt, "step": -1}
        fabric.load(root / "step-00000100", state)  # escaping a loss spike
        save_at(checkpoints, 110)
        state["step"] = -1
        assert checkpoints.resume(state) == root / "step-00000110" and state["step"] == 110, (label, state["step"])
        state["step"] = -1
        fabric.load(root / "latest", state)
        assert state["step"] == 110, (label, state["step"])
        save_at(checkpoints, 120)  # keep_last=3: the abandoned 200 is the oldest commit but one, 100 goes
        got["rollback"] = _committed(root)
        assert got["rollback"] == ["step-00000110", "step-00000120", "step-00000200"], (label, got)
        report[label] = got
    return report


if __name__ == "__main__":
    run_cases()
