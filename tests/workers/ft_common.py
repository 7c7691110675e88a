"""What the workers of the two-group fault runs share (ft_fabric.py, ft_trainer_fault.py, ft_tp.py; the test side:
tests/ft_harness.py): the model and its batches, the fault-tolerance settings, the pid each process records (the test
counts a group's starts by them, a worker its attempt), the final record each group writes for the test to compare,
and group 0's wait for group 1.

Every group trains on the same batch at a step, so the average of the groups' gradients is one group's, and
``min_replicas=2``: a step needs both groups, so group 0 waits in its quorum (never longer than the quorum timeout)
while group 1 restarts.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import torch
from torch import nn

WAIT_S = 60.0


class Net(nn.Module):
    """Two linear layers. ``kill_in`` ("forward" or "backward", else nothing) SIGKILLs the process at that point of
    its next forward or backward; in backward, from a hook on the first layer's output gradient: the second layer's
    gradients exist, the first's and the cross-group average not yet."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 8), nn.Linear(8, 3)
        self.kill_in = ""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kill_in == "forward":
            os.kill(os.getpid(), signal.SIGKILL)
        hidden = self.a(x)
        if self.kill_in == "backward":
            hidden.register_hook(lambda grad: os.kill(os.getpid(), signal.SIGKILL))
        return self.b(torch.relu(hidden))


def batch(step: int) -> torch.Tensor:
    """The step's batch, seeded by the step alone: the same in every group."""
    return torch.randn(4, 6, generator=torch.Generator().manual_seed(step))


def fault_tolerance(out: Path, replica_id: int) -> dict:
    """The settings every group runs with; the lighthouse's address is read from ``OUT/lighthouse``."""
    return {"replica_id": replica_id, "num_replica_groups": 2, "lighthouse": (out / "lighthouse").read_text(),
            "min_replicas": 2, "timeout": 10.0, "quorum_timeout": 30.0, "connect_timeout": 10.0}


def record_pid(out: Path, replica_id: int) -> int:
    """Append this process's pid to ``OUT/pids<id>``; returns how many pids the file holds with it."""
    with open(out / f"pids{replica_id}", "a") as f:
        f.write(f"{os.getpid()}\n")
    return len((out / f"pids{replica_id}").read_text().split())


def start_from_other_weights(model: nn.Module) -> None:
    """A restarted group starts from other weights (each parameter + 1): only a heal makes the groups equal."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)


def full_weights(state_dict: dict) -> dict[str, torch.Tensor]:
    """The full tensors of a sharded state dict (a collective over the group's mesh)."""
    return {k: v.full_tensor().clone() for k, v in state_dict.items()}


def write_record(out: Path, replica_id: int, record: dict) -> None:
    """The group's final record, ``OUT/group<id>.pt``, which the test compares; written whole or not at all, as group
    0 waits for group 1's (:func:`wait_for`)."""
    torch.save(record, out / f"group{replica_id}.tmp")
    os.replace(out / f"group{replica_id}.tmp", out / f"group{replica_id}.pt")


def wait_for(path: Path) -> None:
    """Until ``path`` exists: group 0 stays in the quorum until group 1 has its last step."""
    deadline = time.monotonic() + WAIT_S
    while not path.exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"{path} did not appear within {WAIT_S} s")
        time.sleep(0.01)
