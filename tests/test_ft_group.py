"""Fault tolerance across replica groups (issue 44): the ``fault_tolerance`` argument's checks
(engine/fault_tolerance/config.py, in this process), :class:`ReplicaGroup` as one group of one rank against a real
torchft lighthouse (workers/ft_group.py, cases in the 1-rank pool), and two groups of one rank, each its own world
in its own process, whose averaged gradients are exact (workers/ft_pair.py)."""

from __future__ import annotations

import importlib.util
import subprocess
from dataclasses import asdict

import pytest
import torch
from torch import nn

import forkserver
from launch import WORKERS, case_tests, worker_env
from lightning_fsdp.engine.fault_tolerance import config as ft_config
from lightning_fsdp.engine.fault_tolerance.config import FaultTolerance, parse_fault_tolerance
from skips import require

require("torchft")  # the `test` extra's: a missing torchft fails here, it does not skip

CASES = [
    "windows_commit_and_the_hook_averages_once_per_unit_per_window",
    "an_aborted_backward_is_reset_not_committed_and_training_goes_on",
    "a_lighthouse_shut_down_mid_run_is_a_fault_tolerance_error_within_the_quorum_timeout",
    "an_unreachable_lighthouse_is_refused_at_setup_with_its_address_and_how_to_start_one",
    "a_model_with_two_fsdp_roots_is_refused",
]
results, test_case = case_tests("ft_group.py", 1, CASES)

ENV = {"REPLICA_GROUP_ID": "1", "NUM_REPLICA_GROUPS": "3", "TORCHFT_LIGHTHOUSE": "http://head:29510"}


# --- the argument ---------------------------------------------------------------------------------------------


@pytest.mark.single_process
def test_the_dataclass_a_dict_and_the_environment_give_the_same_config():
    from_env = parse_fault_tolerance({}, environ=ENV)
    assert from_env == FaultTolerance(replica_id=1, num_replica_groups=3, lighthouse="http://head:29510")
    assert parse_fault_tolerance(from_env, environ={}) == from_env
    assert parse_fault_tolerance(asdict(from_env), environ={}) == from_env
    # The argument wins over the environment.
    mine = parse_fault_tolerance({"replica_id": 2, "min_replicas": 2, "quorum_timeout": 5}, environ=ENV)
    assert (mine.replica_id, mine.min_replicas, mine.delta("quorum_timeout").total_seconds()) == (2, 2, 5.0)
    assert parse_fault_tolerance(None, environ=ENV) is None


@pytest.mark.single_process
@pytest.mark.parametrize(("value", "env", "error", "match"), [
    ("yes", ENV, TypeError, r"Invalid `fault_tolerance='yes'`.*Allowed: None \(off\), a lightning_fsdp.FaultTolerance"),
    ({"replica": 1}, ENV, TypeError, r"Unknown field\(s\) 'replica'.*replica_id, num_replica_groups"),
    ({}, {**ENV, "REPLICA_GROUP_ID": ""}, ValueError,
     r"`fault_tolerance.replica_id=None`.*REPLICA_GROUP_ID is not set.*HINT: Set REPLICA_GROUP_ID"),
    ({}, {**ENV, "REPLICA_GROUP_ID": "one"}, ValueError, r"REPLICA_GROUP_ID='one' is not a whole number"),
    ({}, {**ENV, "REPLICA_GROUP_ID": "3"}, ValueError,
     r"`fault_tolerance.replica_id=3`.*\[0, 3\) for num_replica_groups=3.*HINT: Number the groups 0 to 2"),
    ({"num_replica_groups": 0}, ENV, ValueError, r"`fault_tolerance.num_replica_groups=0`.*an int >= 1"),
    ({"min_replicas": 4}, ENV, ValueError, r"`fault_tolerance.min_replicas=4`.*an int in \[1, 3\]"),
    ({"timeout": 0}, ENV, ValueError, r"`fault_tolerance.timeout=0`.*greater than 0.*HINT: Pass e.g. `timeout=60`"),
    ({"quorum_timeout": "60"}, ENV, TypeError, r"`fault_tolerance.quorum_timeout='60'`"),
    ({"connect_timeout": float("inf")}, ENV, ValueError, r"`fault_tolerance.connect_timeout=inf`"),
    ({"max_uncommitted_steps": -1}, ENV, ValueError, r"`fault_tolerance.max_uncommitted_steps=-1`"),
    ({"init_sync": 1}, ENV, TypeError, r"`fault_tolerance.init_sync=1`.*True or False"),
    ({}, {k: v for k, v in ENV.items() if k != "TORCHFT_LIGHTHOUSE"}, ValueError,
     r"`fault_tolerance.lighthouse=None`.*TORCHFT_LIGHTHOUSE is not set.*HINT: start one with `lightning-fsdp"
     r" lighthouse --min-replicas 1`"),
    ({}, {**ENV, "TORCHFT_LIGHTHOUSE": "head:29510"}, ValueError,
     r"`fault_tolerance.lighthouse='head:29510'`.*environment variable TORCHFT_LIGHTHOUSE.*'http://head-node:29510'"),
    ({"lighthouse": "http://head"}, ENV, ValueError, r"Write the scheme and the port"),
])
def test_every_bad_value_names_the_field_what_is_allowed_and_the_fix(value, env, error, match):
    with pytest.raises(error, match=match):
        parse_fault_tolerance(value, environ=env)


@pytest.mark.single_process
def test_a_missing_torchft_names_the_extra(monkeypatch):
    real = ft_config.importlib.util.find_spec
    monkeypatch.setattr(ft_config.importlib.util, "find_spec", lambda name, *a: None if name == "torchft" else real(name, *a))
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'lightning-fsdp\[ft\]'"):
        parse_fault_tolerance({}, environ=ENV)


@pytest.mark.single_process
def test_a_torchft_timeout_variable_that_overrides_the_argument_warns():
    with pytest.warns(UserWarning, match=r"TORCHFT_QUORUM_TIMEOUT_SEC='5' is set.*quorum_timeout=60"):
        parse_fault_tolerance({}, environ={**ENV, "TORCHFT_QUORUM_TIMEOUT_SEC": "5"})


# --- two groups, each its own world ---------------------------------------------------------------------------

STEPS = 8


def _pair():
    """workers/ft_pair.py as a module: its model and batches make the reference."""
    spec = importlib.util.spec_from_file_location("ft_pair", WORKERS / "ft_pair.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _replay(participants: dict[int, int]) -> dict[str, torch.Tensor]:
    """SGD with momentum on the gradients torchft averages at each committed step: group 0's alone, or the two
    groups' sum halved (a healing group adds zeros and is not counted)."""
    pair = _pair()
    net = pair.model()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        grads = []
        for group in range(participants[step]):
            net.zero_grad()
            net(pair.batch(group, step)).square().mean().backward()
            grads.append([p.grad.clone() for p in net.parameters()])
        for p, *gs in zip(net.parameters(), *grads):
            p.grad = gs[0] if len(gs) == 1 else (gs[0] + gs[1]) / 2
        opt.step()
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


@pytest.mark.single_process
def test_a_group_that_joins_behind_heals_and_two_groups_average_exactly(tmp_path):
    env = worker_env(tmp_path)
    # The pools' environment has a fork server (started with them); waiting for it costs nothing once it serves, and
    # two forked groups start in well under a second where real ones take 4 s each.
    forkserver.wait_until_serving(forkserver.prewarm({k: v for k, v in env.items() if k not in ("RANK", "LOCAL_RANK")}),
                                  timeout_s=120)
    logs = [open(tmp_path / f"group{g}.log", "w") for g in (0, 1)]  # noqa: SIM115 - closed below
    procs = []
    try:
        for g in (0, 1):
            procs.append(subprocess.Popen(
                [forkserver.python(), str(WORKERS / "ft_pair.py"), str(g), str(tmp_path), str(STEPS)],
                env=env, stdout=logs[g], stderr=subprocess.STDOUT))
        # Bound against a hang only: the run took about 2 s here (2026-11-28); the groups' own timeouts are 30 s.
        codes = [p.wait(timeout=180) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for log in logs:
            log.close()
    output = "\n".join((tmp_path / f"group{g}.log").read_text()[-3000:] for g in (0, 1))
    assert codes == [0, 0], output
    first, second = (torch.load(tmp_path / f"group{g}.pt") for g in (0, 1))
    participants = first["participants"]
    assert sorted(participants) == list(range(STEPS)), participants
    assert participants[0] == participants[1] == 1, participants  # group 0 alone before group 1 starts
    joint = [s for s, n in participants.items() if n == 2]
    assert len(joint) >= 2 and joint == list(range(joint[0], STEPS)), participants  # then both, to the end
    # Group 1 healed once, at the step before its first joint one, and counts the same participants from there.
    assert (first["healed"], second["healed"]) == (0, 1), (first["healed"], second["healed"])
    assert second["participants"] == {s: n for s, n in participants.items() if s >= joint[0] - 1}, second
    assert first["bytes"][0] > 0 and first["bytes"][0] == second["bytes"][1], (first["bytes"], second["bytes"])
    want = _replay(participants)
    for name, tensor in want.items():
        assert torch.equal(first["weights"][name], tensor), name
        assert torch.equal(second["weights"][name], tensor), name
