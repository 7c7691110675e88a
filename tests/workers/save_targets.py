"""Two-rank cases for what a save does to the checkpoints already there (issue 21, items 8 and 14).

- Item 8: with background saves, ``ModelCheckpoint(save_top_k=1)`` asks to remove step 1 while step 2 is still being
  written. The write of step 2 is held open here (its files block until released), and the checkpoint directory is
  copied at that moment, as a preemption would leave it: it must hold a complete checkpoint that loads exactly. When
  step 2's write fails instead, step 1 must stay, and the error is raised on every rank.
- Item 14: a save to a path that is a symbolic link replaces the link and leaves what it pointed to as it was, in
  both formats and for background saves: a link to a file, to a directory, a dangling link, a chain of links. A
  save through a link that fails leaves the link and its target as they were, with the same error on every rank.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint.filesystem as dcp_fs
from lightning.fabric.wrappers import _unwrap_objects
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from common import full_params, make_fabric, same_tensors, shared_tmpdir, tensor_opt_state, train_steps
from harness import case, run_cases
from lightning_fsdp.checkpoint import save_checkpoint
from models import TinyTransformer
from trainer_common import LitGPT, compare_params, gathered, loader, make_trainer, strategy

WORLD = 2
OUT = Path(os.environ["LFSDP_TEST_OUT"])


# ------------------------------------------------------------------------------------------------- helpers


@contextmanager
def _writes_held(marker: str, gate: threading.Event, fail: bool = False):
    """Every checkpoint file DCP opens for writing under a path containing ``marker`` blocks until ``gate`` is set
    (or, with ``fail``, raises ENOSPC at once): a background write that is still in flight, or that fails."""
    original = dcp_fs.FileSystem.create_stream

    @contextmanager
    def create_stream(self, path, mode):
        if "w" in mode and marker in str(path):
            if fail:
                raise OSError(28, os.strerror(28), str(path))
            gate.wait(timeout=120)
        with original(self, path, mode) as stream:
            yield stream

    dcp_fs.FileSystem.create_stream = create_stream
    try:
        yield
    finally:
        dcp_fs.FileSystem.create_stream = original


def _same_everywhere(value):
    everyone = [None] * WORLD
    dist.all_gather_object(everyone, value)
    assert all(v == everyone[0] for v in everyone), f"ranks differ: {everyone}"
    return everyone[0]


def _loads_exactly_in_trainer(path: Path, expected: dict, what: str) -> float:
    fresh = LitGPT()
    make_trainer(strategy()).validate(fresh, loader(8), ckpt_path=path, verbose=False)
    try:
        return compare_params(gathered(fresh.model), expected, atol=0.0)
    except AssertionError as err:
        raise AssertionError(f"{what}: {err}") from err


class _Observe(Callback):
    """Records the parameters at every step (before `ModelCheckpoint`, which Lightning runs last, saves them), and
    at the end of training, with step 2's write still held open, copies the checkpoint directory (what a preemption
    would leave) before releasing the write; ``snapshot=None``: no copy."""

    def __init__(self, dirpath: Path, snapshot: Optional[Path], gate: threading.Event) -> None:
        self.dirpath, self.snapshot, self.gate = dirpath, snapshot, gate
        self.params: dict[int, dict] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.params[trainer.global_step] = gathered(pl_module.model)

    def on_train_end(self, trainer, pl_module):
        failure = None
        if trainer.global_rank == 0 and self.snapshot is not None:
            try:
                shutil.copytree(self.dirpath, self.snapshot, symlinks=True)
            except Exception as err:  # noqa: BLE001 - raised below, on every rank
                failure = f"{type(err).__name__}: {err}"
        # Every rank learns whether rank 0's copy failed: a failure raised on rank 0 alone would leave the others in
        # the next collective until the process group's timeout.
        failures = [None] * WORLD
        dist.all_gather_object(failures, failure)
        self.gate.set()
        if failures[0] is not None:
            raise RuntimeError(f"copying {str(self.dirpath)!r} on rank 0 failed: {failures[0]}")


def _top_1_fit(name: str, gate: threading.Event, fail: bool = False):
    # With `fail`, step 2's write fails at once and rank 0 removes its staged files in the background: a copy of the
    # directory then would race that removal (it did once, on rank 0 alone), and the failing case needs none.
    dirpath, snapshot = OUT / name, None if fail else OUT / f"{name}-at-preemption"
    observe = _Observe(dirpath, snapshot, gate)
    callback = ModelCheckpoint(dirpath=dirpath, filename="{step}", every_n_train_steps=1, save_top_k=1)
    trainer = make_trainer(strategy(state_dict_type="sharded", async_save=True), max_steps=2,
                           enable_checkpointing=True, callbacks=[observe, callback])
    with _writes_held(".step=2.ckpt.", gate, fail=fail):
        error = None
        try:
            trainer.fit(LitGPT(), loader())
        except Exception as err:  # noqa: BLE001 - checked by the caller, on every rank
            error = f"{type(err).__name__}: {err}"
    return dirpath, snapshot, observe, error


# ------------------------------------------------------------------------------------------------- item 8


@case
def top_1_removal_waits_for_the_background_save_that_supersedes_it():
    gate = threading.Event()
    dirpath, snapshot, observe, error = _top_1_fit("top1", gate)
    assert error is None, error
    at_preemption = _same_everywhere(sorted(p.name for p in snapshot.iterdir()))
    complete = [n for n in at_preemption if not n.startswith(".") and (snapshot / n / ".metadata").is_file()]
    # Step 2 is still being written, so step 1 must still be there, whole.
    assert complete == ["step=1.ckpt"], f"a preemption now would leave {at_preemption} (complete: {complete})"
    diffs = {"step=1 at preemption": _loads_exactly_in_trainer(snapshot / "step=1.ckpt", observe.params[1], "step 1")}
    # Once step 2 is in place, step 1 is removed as asked: the top-1 rule still holds.
    final = _same_everywhere(sorted(p.name for p in dirpath.iterdir()))
    assert final == ["step=2.ckpt"], final
    diffs["step=2 after fit"] = _loads_exactly_in_trainer(dirpath / "step=2.ckpt", observe.params[2], "step 2")
    return {"at_preemption": at_preemption, "final": final, "diffs": diffs}


@case
def a_failed_background_save_keeps_the_checkpoint_it_was_to_supersede():
    gate = threading.Event()
    dirpath, _, observe, error = _top_1_fit("top1-failed", gate, fail=True)
    error = _same_everywhere(error)  # the same error on every rank
    assert error is not None and "No space left on device" in error and "step=2.ckpt" in error, error
    final = _same_everywhere(sorted(p.name for p in dirpath.iterdir()))
    assert final == ["step=1.ckpt"], final
    return {"error": error[:300], "final": final,
            "diff": _loads_exactly_in_trainer(dirpath / "step=1.ckpt", observe.params[1], "step 1")}


# ------------------------------------------------------------------------------------------------- item 14


def _setup(fabric, seed=0):
    torch.manual_seed(seed)
    plain = TinyTransformer()
    return fabric.setup(plain, torch.optim.AdamW(plain.parameters(), lr=1e-2))


def _loads_exactly(fabric, path: Path, params: dict, opt_state: dict, what: str) -> None:
    model, opt = _setup(fabric, seed=7)
    fabric.load(path, {"model": model, "optimizer": opt})
    assert same_tensors(params, full_params(model)), f"{what}: {path.name} does not hold the expected parameters"
    assert same_tensors(opt_state, tensor_opt_state(opt)), f"{what}: {path.name} does not hold the expected optimizer"


def _link(fabric, link: Path, to: str) -> None:
    if fabric.global_rank == 0:
        link.symlink_to(to)
    fabric.barrier()


LINK_SHAPES = ("to_a_file", "to_a_directory", "dangling", "chain")


@case
def a_save_through_a_link_replaces_the_link_and_keeps_its_target():
    report = {}
    for kind in ("full", "sharded", "async"):
        fabric = make_fabric(WORLD, state_dict_type="full" if kind == "full" else "sharded",
                             async_save=kind == "async")
        engine = fabric.strategy._engine
        for shape in LINK_SHAPES:
            what = f"{kind} save through a link {shape}"
            root = shared_tmpdir(fabric)
            model, opt = _setup(fabric)
            train_steps(fabric, model, opt, steps=1)
            old = (full_params(model), tensor_opt_state(opt))
            # The checkpoint the link names, in the format the shape asks for (written by the library directly, so a
            # full save can meet a link to a directory and a sharded one a link to a file).
            if shape != "dangling":
                save_checkpoint(root / "step-1", _unwrap_objects({"model": model, "optimizer": opt}),
                                full=shape == "to_a_file", comm=engine)
            if shape == "chain":
                _link(fabric, root / "mid", "step-1")
                _link(fabric, root / "last", "mid")
            else:
                _link(fabric, root / "last", "missing" if shape == "dangling" else "step-1")
            train_steps(fabric, model, opt, steps=1, start=1)
            new = (full_params(model), tensor_opt_state(opt))
            fabric.save(root / "last", {"model": model, "optimizer": opt})
            _loads_exactly(fabric, root / "last", *new, what=what)  # a load waits for a background save first
            last = root / "last"
            assert not last.is_symlink(), f"{what}: the link is still a link ({os.readlink(last)})"
            assert (last.is_file() if kind == "full" else last.is_dir()), f"{what}: 'last' is not the new checkpoint"
            expected = {"to_a_file": ["last", "step-1"], "to_a_directory": ["last", "step-1"],
                        "dangling": ["last"], "chain": ["last", "mid", "step-1"]}[shape]
            names = _same_everywhere(sorted(p.name for p in root.iterdir()))
            assert names == expected, f"{what}: {names}"
            if shape == "chain":
                assert os.readlink(root / "mid") == "step-1", f"{what}: the middle link changed"
            if shape != "dangling":
                _loads_exactly(fabric, root / "step-1", *old, what=f"{what}: the old target")
                # A load through a link still reads what it points to.
                _link(fabric, root / "again", "step-1")
                _loads_exactly(fabric, root / "again", *old, what=f"{what}: a load through a link")
            report[f"{kind}/{shape}"] = names
    return report


@case
def a_failed_save_through_a_link_leaves_link_and_target_alone():
    """The link's folder is a tmpfs remounted read-only after the first save: the save through the link fails on
    every rank alike, and the link still names the old checkpoint, which still loads exactly."""
    report = {}
    for kind in ("full", "sharded", "async"):
        fabric = make_fabric(WORLD, state_dict_type="full" if kind == "full" else "sharded",
                             async_save=kind == "async")
        where = shared_tmpdir(fabric)
        mounted = _same_everywhere(_mount(where) if fabric.global_rank == 0 else None)
        if mounted is not None:
            return {"skipped": mounted}
        try:
            model, opt = _setup(fabric)
            train_steps(fabric, model, opt, steps=1)
            old = (full_params(model), tensor_opt_state(opt))
            save_checkpoint(where / "step-1", _unwrap_objects({"model": model, "optimizer": opt}), full=kind == "full",
                            comm=fabric.strategy._engine)
            _link(fabric, where / "last", "step-1")
            if fabric.global_rank == 0:
                subprocess.run(["mount", "-o", "remount,ro", str(where)], check=True)
            fabric.barrier()
            train_steps(fabric, model, opt, steps=1, start=1)
            error = None
            try:
                fabric.save(where / "last", {"model": model, "optimizer": opt})
                _loads_exactly(fabric, where / "last", *old, what="")  # an async save's error surfaces here
            except Exception as err:  # noqa: BLE001 - checked below, on every rank
                error = f"{type(err).__name__}: {err}"
            error = _same_everywhere(error)
            assert error is not None and "read-only file system" in error.lower(), error
            assert os.readlink(where / "last") == "step-1", f"{kind}: the link changed"
            _loads_exactly(fabric, where / "last", *old, what=f"{kind}: the link after a failed save")
            report[kind] = error[:200]
        finally:
            fabric.barrier()
            if fabric.global_rank == 0:
                subprocess.run(["umount", "-l", str(where)], check=False)
    return report


def _mount(where: Path):
    run = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(where)], capture_output=True,
                         text=True)
    return None if run.returncode == 0 else f"cannot mount a tmpfs here: {run.stderr.strip() or run.returncode}"


if __name__ == "__main__":
    run_cases()
