"""Two-rank Trainer cases for fault tolerance's gated step (``trainer.py``, ``_fronts/fault_tolerance_loop.py``),
with a scripted replica group in place of torchft's: its votes follow a list, so a step that does not commit happens
at a chosen window, on every rank alike, with no lighthouse. What the Trainer must then leave unchanged: the
parameters, the optimizer state, the step-interval LR scheduler and ``trainer.global_step``."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch
from lightning.pytorch import Callback
from torch.distributed.tensor import DTensor

from harness import case, run_cases
from trainer_common import LitGPT, loader, make_trainer, strategy

# A fault_tolerance argument that parses (one group, so the sampler cuts the data as without it); the group itself
# is the scripted one below, so nothing connects to this lighthouse.
FT = {"replica_id": 0, "num_replica_groups": 1, "lighthouse": "http://127.0.0.1:9"}


class ScriptedGroup:
    """The part of ``ReplicaGroup`` the Trainer uses, with votes read from a script."""

    def __init__(self, votes: list[bool]) -> None:
        self.votes = list(votes)
        self.committed: Any = None
        self.window_open = False
        self.windows = 0
        self.steps = 0  # committed steps: torchft's `current_step`
        self.checked: list[int] = []
        self.closed = False
        self.manager = None  # no torchft: nothing to heal (`trainer_heal.apply_heal_now`)

    def begin_window(self) -> None:
        if self.window_open:
            return
        self.window_open, self.committed = True, None
        self.windows += 1

    @contextmanager
    def aborting(self) -> Iterator[None]:
        yield

    def commit(self) -> bool:
        assert self.window_open, "a vote outside a window"
        self.window_open = False
        self.committed = self.votes.pop(0)
        self.steps += self.committed
        return self.committed

    def participating_rank(self) -> int:
        return 0  # the quorum the fit loop waits for before its first batch: this group alone, nothing to heal

    def check_step(self, committed_steps: int) -> None:
        self.checked.append(committed_steps)
        assert committed_steps == self.steps, (committed_steps, self.steps)

    def close(self) -> None:
        self.closed = True


def ft_strategy(group: ScriptedGroup, **kwargs: Any):
    s = strategy(fault_tolerance=FT, **kwargs)
    s._new_replica_group = lambda trainer: group
    return s


def _local(t: torch.Tensor) -> torch.Tensor:
    return (t.to_local() if isinstance(t, DTensor) else t).detach().clone()


class _Windows(Callback):
    """After each optimizer window's last batch: global_step, the LR, the local shards and the optimizer state."""

    def __init__(self, accumulate: int) -> None:
        self.accumulate, self.seen = accumulate, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if (batch_idx + 1) % self.accumulate:
            return
        optimizer = trainer.optimizers[0]
        state = {f"{i}.{k}": _local(v) for i, s in enumerate(optimizer.state.values()) for k, v in s.items()
                 if isinstance(v, torch.Tensor)}
        self.seen.append({
            "global_step": trainer.global_step, "lr": optimizer.param_groups[0]["lr"],
            "params": [_local(p) for p in pl_module.parameters()], "state": state,
            "batches": trainer.fit_loop.epoch_loop.batch_progress.total.completed,
        })


def _fit(votes: Any, accumulate: int = 2, **kwargs: Any) -> tuple[Any, Any, _Windows]:
    """4 windows (2 epochs of 4 batches per rank, 2 per window), momentum SGD and StepLR(3, 0.5) per step."""
    group = ScriptedGroup(votes) if votes is not None else None
    windows = _Windows(accumulate)
    s = ft_strategy(group, **kwargs) if group is not None else strategy(**kwargs)
    trainer = make_trainer(s, max_epochs=2, accumulate_grad_batches=accumulate, callbacks=[windows])
    trainer.fit(LitGPT(optimizer="sgd", scheduler=True), loader())
    return trainer, group, windows


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


@case
def a_vote_that_does_not_commit_moves_no_step_no_lr_no_weights():
    trainer, group, windows = _fit([True, False, True, True])
    steps = [w["global_step"] for w in windows.seen]
    assert steps == [1, 1, 2, 3], steps
    assert group.windows == 4 and group.votes == [], (group.windows, group.votes)  # one window per 2 batches
    assert group.checked == [1, 2, 3], group.checked  # the invariant, after each committed step
    first, failed = windows.seen[0], windows.seen[1]
    assert failed["lr"] == first["lr"], (first["lr"], failed["lr"])
    assert _equal(failed["params"], first["params"]), "parameters moved after a vote that did not commit"
    assert _equal(failed["state"], first["state"]), "optimizer state moved after a vote that did not commit"
    assert failed["batches"] == first["batches"] + 2, "the window's batches were consumed"
    assert not _equal(windows.seen[2]["params"], failed["params"]), "the next committed step trains"
    # StepLR(step_size=3): 3 committed steps halve the LR once; 4 counted steps would have too, so the schedule's
    # own count is checked as well.
    scheduler = trainer.lr_scheduler_configs[0].scheduler
    assert scheduler.last_epoch == 3 and trainer.global_step == 3, (scheduler.last_epoch, trainer.global_step)
    assert group.closed, "teardown leaves the quorum"
    return {"steps": steps, "lr": [w["lr"] for w in windows.seen]}


@case
def votes_that_all_commit_train_exactly_as_without_fault_tolerance():
    _, group, with_ft = _fit([True] * 4)
    _, _, without = _fit(None)
    assert group.votes == [] and group.checked == [1, 2, 3, 4], (group.votes, group.checked)
    assert len(with_ft.seen) == len(without.seen) == 4
    for a, b in zip(with_ft.seen, without.seen):
        assert _equal(a, b), "a run whose votes all commit differs from one without fault tolerance"
    return {"steps": [w["global_step"] for w in with_ft.seen]}


@case
def clipping_sees_the_gradients_before_the_vote_and_runs_each_window():
    class Norms(Callback):
        def __init__(self) -> None:
            self.calls = 0

        def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
            assert all(p.grad is not None for p in pl_module.parameters()), "clipping ran before backward"
            self.calls += 1

    norms, group = Norms(), ScriptedGroup([True, False, True, True])
    trainer = make_trainer(ft_strategy(group), max_epochs=2, accumulate_grad_batches=2, callbacks=[norms],
                           gradient_clip_val=0.01, gradient_clip_algorithm="norm")
    trainer.fit(LitGPT(), loader())
    assert norms.calls == 4 and trainer.global_step == 3, (norms.calls, trainer.global_step)
    return {"clip_calls": norms.calls}


class _Manual(LitGPT):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False


class _LBFGS(LitGPT):
    def configure_optimizers(self) -> Any:
        return torch.optim.LBFGS(self.parameters())


def _refused(module: LitGPT) -> str:
    try:
        make_trainer(ft_strategy(ScriptedGroup([True] * 8)), max_steps=2).fit(module, loader())
    except ValueError as err:
        return str(err)
    raise AssertionError(f"{type(module).__name__} was not refused")


@case
def what_the_vote_cannot_gate_is_refused_with_the_fix():
    messages = {
        "manual": _refused(_Manual()),
        "lbfgs": _refused(_LBFGS()),
    }
    assert "manual optimization" in messages["manual"] and "HINT: Set `self.automatic_optimization = True`" in \
        messages["manual"], messages["manual"]
    assert "LBFGS" in messages["lbfgs"] and "Invalid `fault_tolerance=" in messages["lbfgs"], messages["lbfgs"]
    return messages


if __name__ == "__main__":
    run_cases()
