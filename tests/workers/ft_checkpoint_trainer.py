"""Two-rank Trainer cases for torchft's step in the Trainer's checkpoints (``_fronts/replica_checkpoint.py``, called
from ``trainer.py``'s ``save_checkpoint`` and ``load_checkpoint``), with a scripted replica group in place of
torchft's, as in workers/ft_trainer.py: its votes follow a list and its counters are plain ints, so the checkpoint's
counters and what a resume gives the group are seen exactly, with no lighthouse."""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Optional

import torch
from lightning.pytorch import Callback

from harness import case, run_cases
from trainer_common import LitGPT, loader, make_trainer, strategy

FT = {"replica_id": 0, "num_replica_groups": 1, "lighthouse": "http://127.0.0.1:9"}  # parses; nothing connects
KEY = "fault_tolerance"


class ScriptedGroup:
    """The part of ``ReplicaGroup`` the Trainer uses, votes from a script, and torchft's counters as plain ints."""

    def __init__(self, votes: list[bool]) -> None:
        self.votes = list(votes)
        self.committed: Any = None
        self.window_open = False
        self.steps = 0
        self.batches = 0
        self.loaded: list[dict] = []
        self.manager = None  # no torchft: nothing to heal

    def begin_window(self) -> None:
        if not self.window_open:
            self.window_open, self.committed = True, None

    @contextmanager
    def aborting(self) -> Iterator[None]:
        yield

    def commit(self) -> bool:
        self.window_open = False
        self.committed = self.votes.pop(0)
        self.steps += self.committed
        self.batches += 2 * self.committed  # as if two groups took part
        return self.committed

    def participating_rank(self) -> int:
        return 0  # the writer

    def check_step(self, committed_steps: int) -> None:
        assert committed_steps == self.steps, (committed_steps, self.steps)

    def state_dict(self) -> dict[str, int]:
        return {"step": self.steps, "batches_committed": self.batches}

    def load_state_dict(self, state: dict[str, int]) -> None:
        assert not self.window_open, "loaded inside a window"
        self.loaded.append(dict(state))
        self.steps, self.batches = state["step"], state["batches_committed"]

    def close(self) -> None:
        pass


class _SaveAtEnd(Callback):
    """``trainer.save_checkpoint`` at the end of the last epoch, while the replica group is still joined."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if trainer.current_epoch == trainer.max_epochs - 1:
            trainer.save_checkpoint(self.path)


def _fit(group: Optional[ScriptedGroup], epochs: int, save: Optional[Path] = None, resume: Optional[Path] = None):
    """``epochs`` epochs of 2 windows (4 batches per rank, 2 per window), momentum SGD."""
    s = strategy(fault_tolerance=FT) if group is not None else strategy()
    if group is not None:
        s._new_replica_group = lambda trainer: group
    trainer = make_trainer(s, max_epochs=epochs, accumulate_grad_batches=2,
                           callbacks=[_SaveAtEnd(save)] if save is not None else [])
    trainer.fit(LitGPT(optimizer="sgd"), loader(), ckpt_path=resume)
    return trainer


def _out(name: str) -> Path:
    return Path(os.environ["LFSDP_TEST_OUT"]) / "ft_checkpoint_trainer" / name


def _saved_counters(path: Path) -> Any:
    """The counters in a sharded checkpoint's plain entries (``meta.pt``) or a full one's file."""
    return torch.load(path / "meta.pt" if path.is_dir() else path, weights_only=True).get(KEY, "absent")


@case
def a_trainer_checkpoint_holds_torchfts_step_and_a_resume_gives_it_back_before_the_first_window():
    path = _out("with")
    first = ScriptedGroup([True, False])  # 2 windows, 1 committed: global_step 1
    trainer = _fit(first, 1, save=path)
    assert trainer.global_step == 1 == first.steps, (trainer.global_step, first.steps)
    saved = _saved_counters(path)
    assert saved == {"step": 1, "batches_committed": 2}, saved
    resumed = ScriptedGroup([True, True])
    trainer = _fit(resumed, 2, resume=path)
    # The counters came back before any window, and the loop's invariant held after each later step.
    assert resumed.loaded == [{"step": 1, "batches_committed": 2}], resumed.loaded
    assert trainer.global_step == 3 == resumed.steps, (trainer.global_step, resumed.steps)
    return {"saved": saved}


@case
def a_checkpoint_saved_without_fault_tolerance_resumes_torchft_at_its_global_step():
    path = _out("without")
    trainer = _fit(None, 1, save=path)
    assert trainer.global_step == 2 and _saved_counters(path) == "absent", trainer.global_step
    resumed = ScriptedGroup([True, True])
    trainer = _fit(resumed, 2, resume=path)
    assert resumed.loaded == [{"step": 2, "batches_committed": 0}], resumed.loaded
    assert trainer.global_step == 4 == resumed.steps, (trainer.global_step, resumed.steps)


if __name__ == "__main__":
    run_cases()
