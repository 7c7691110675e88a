"""Fault tolerance on the Trainer front (issue 44, design note sections 2 and 3): the vote gates the optimizer step,
``global_step`` and the step-interval LR schedulers (workers/ft_trainer.py, cases in the 2-rank pool, with a scripted
group in place of torchft's); the three Lightning sites wrapped for it, pinned by name and signature for the installed
Lightning (run this file under the oldest supported Lightning too); ``fault_tolerance`` in LightningCLI YAML."""

from __future__ import annotations

import inspect
import sys
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import pytest

from launch import case_tests
from lightning_fsdp._base import compat
from lightning_fsdp.engine.fault_tolerance.config import FaultTolerance

CASES = [
    "a_vote_that_does_not_commit_moves_no_step_no_lr_no_weights",
    "votes_that_all_commit_train_exactly_as_without_fault_tolerance",
    "clipping_sees_the_gradients_before_the_vote_and_runs_each_window",
    "what_the_vote_cannot_gate_is_refused_with_the_fix",
]
results, test_case = case_tests("ft_trainer.py", 2, CASES)


@pytest.mark.single_process
def test_the_wrapped_lightning_sites_exist_with_the_arguments_the_wrappers_take():
    from lightning_fsdp._fronts import fault_tolerance_loop, trainer_heal

    automatic, epoch_loop = compat.trainer_step_sites()
    for register in (fault_tolerance_loop.register, trainer_heal.register):
        register()
        register()  # idempotent: no wrapper around a wrapper
    expected = {(automatic, compat.TRAINER_OPTIMIZER_STEP): ["self", "batch_idx", "train_step_and_backward_closure"],
                (epoch_loop, compat.TRAINER_LR_SCHEDULERS_STEP): ["self", "interval", "update_plateau_schedulers"],
                (compat.trainer_fit_loop(), compat.TRAINER_FIT_RUN): ["self"]}
    for (owner, name), parameters in expected.items():
        wrapper = getattr(owner, name)
        original = wrapper.__wrapped__
        assert not hasattr(original, "__wrapped__"), f"{name} was wrapped twice"
        assert list(inspect.signature(original).parameters) == parameters, (name, inspect.signature(original))


@pytest.mark.single_process
def test_fault_tolerance_as_a_mapping_in_lightning_cli_yaml(tmp_path):
    from lightning.pytorch.cli import LightningCLI

    config = tmp_path / "config.yaml"
    config.write_text(
        "trainer:\n"
        "  accelerator: cpu\n"
        "  devices: 1\n"
        "  logger: false\n"
        f"  default_root_dir: {tmp_path}\n"
        "  strategy:\n"
        "    class_path: lightning_fsdp.trainer.FSDPStrategy\n"
        "    init_args:\n"
        "      fault_tolerance:\n"
        "        replica_id: 1\n"
        "        num_replica_groups: 2\n"
        "        lighthouse: http://head:29510\n"
        "        min_replicas: 2\n"
        "        quorum_timeout: 120\n"
    )
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    try:
        import cli_train
    finally:
        sys.path.pop(0)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sys, "argv", ["cli_train.py"])  # LightningCLI warns when pytest's own arguments are there too
        cli = LightningCLI(cli_train.GPTModule, cli_train.TokenData, run=False, args=[f"--config={config}"])
    assert cli.trainer.strategy.config.fault_tolerance == FaultTolerance(
        replica_id=1, num_replica_groups=2, lighthouse="http://head:29510", min_replicas=2, quorum_timeout=120.0)


class _Group:
    """A replica group whose vote is given, and whose ``aborting`` ends a step as a dead peer group's would."""

    def __init__(self, vote: bool) -> None:
        self.vote, self.commits, self.aborted = vote, 0, 0

    @contextmanager
    def aborting(self):
        try:
            yield
        except _PeerDied:
            self.aborted += 1

    def commit(self) -> bool:
        self.commits += 1
        return self.vote


class _PeerDied(Exception):
    pass


def _voted_step(vote: bool, closure):
    import torch

    from lightning_fsdp.trainer import FSDPTrainerPrecision

    weight = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([weight], lr=1.0)
    weight.grad = torch.ones(2)
    model = SimpleNamespace(automatic_optimization=True, trainer=None)
    precision, group = FSDPTrainerPrecision(), _Group(vote)
    precision._after_closure = lambda model, optimizer: None  # the Lightning hooks it calls need a Trainer
    result = precision._voted_step(group, optimizer, model, closure)
    return result, weight, group


@pytest.mark.single_process
def test_a_training_step_that_returns_none_is_refused_under_fault_tolerance():
    # Lightning refuses it itself on several ranks; a replica group of one rank reaches this check.
    with pytest.raises(RuntimeError, match=r"`training_step` returned None under fault_tolerance.*HINT: return the loss"):
        _voted_step(True, lambda: None)


@pytest.mark.single_process
def test_the_optimizer_steps_only_when_the_vote_commits_and_an_aborted_backward_still_votes():
    import torch
    from lightning.pytorch.loops.optimization.automatic import Closure

    _, weight, group = _voted_step(True, lambda: torch.tensor(1.0))
    assert group.commits == 1 and torch.equal(weight.detach(), torch.zeros(2)), weight
    _, weight, group = _voted_step(False, lambda: torch.tensor(1.0))
    assert group.commits == 1 and torch.equal(weight.detach(), torch.ones(2)) and weight.grad is None, weight

    def dies():
        raise _PeerDied()

    closure = Closure(dies)
    _, weight, group = _voted_step(False, closure)
    # Every rank of the group votes, the aborted one included (the vote is collective); Lightning's loop then reads
    # an empty result from the closure instead of raising that it never ran.
    assert group.aborted == 1 and group.commits == 1 and torch.equal(weight.detach(), torch.ones(2))
    assert closure.consume_result().loss is None
