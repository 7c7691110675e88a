"""One replica group of one rank, trained with Fabric and ``FSDPStrategy(fault_tolerance=...)``, for
``tests/test_ft_fabric.py``'s fault run.

    python ft_fabric.py REPLICA_ID OUT_DIR STEPS [KILL]

``KILL`` is ``PHASE@N`` with PHASE one of forward, backward, optimizer: group 1's process SIGKILLs itself N committed
steps after its first window (where a restarted attempt heals) at that point of the step (in the model's forward; in a hook on an
activation's gradient during backward; in an optimizer step pre-hook). The lighthouse's address is read from
``OUT_DIR/lighthouse``. Every group trains on the same batch at a step (seeded by the committed step alone), so the
average of the groups' gradients is exactly one group's, and the weights must equal a run without faults bit for bit.
``min_replicas=2``: a step needs both groups, so group 0 waits in its quorum (never longer than the quorum timeout)
while group 1 restarts, and every kill meets group 0 mid-step (``tests/test_ft_group.py`` shows a group training
alone under ``min_replicas=1``). The first attempt of group 1 starts beside group 0 from the same seed; each
restarted one starts at step 0 from other weights and must heal. Each
process appends its pid to ``OUT_DIR/pids<id>``, and at the end writes its full weights, its counters, the steps it
healed at and did not commit, and its longest step, to ``OUT_DIR/group<id>.pt``.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import torch
from lightning.fabric import Fabric
from torch import nn

from lightning_fsdp.fabric import FSDPStrategy

WAIT_S = 60.0


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 8), nn.Linear(8, 3)
        self.kill_in = ""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kill_in == "forward":
            os.kill(os.getpid(), signal.SIGKILL)
        hidden = self.a(x)
        if self.kill_in == "backward":  # mid-backward: b's gradients exist, a's and the cross-group average not yet
            hidden.register_hook(lambda grad: os.kill(os.getpid(), signal.SIGKILL))
        return self.b(torch.relu(hidden))


def batch(step: int) -> torch.Tensor:
    return torch.randn(4, 6, generator=torch.Generator().manual_seed(step))


def main(replica_id: int, out: Path, steps: int, kill: str) -> None:
    with open(out / f"pids{replica_id}", "a") as f:
        f.write(f"{os.getpid()}\n")
    attempt = len((out / f"pids{replica_id}").read_text().split())
    phase, _, after = kill.partition("@")
    fault_tolerance = {"replica_id": replica_id, "num_replica_groups": 2, "lighthouse": (out / "lighthouse").read_text(),
                       "min_replicas": 2, "timeout": 10.0, "quorum_timeout": 30.0, "connect_timeout": 10.0}
    strategy = FSDPStrategy(fault_tolerance=fault_tolerance, auto_wrap_policy={nn.Linear})  # three units: a, b, root
    fabric = Fabric(accelerator="cpu", devices=1, strategy=strategy)
    fabric.launch()
    torch.manual_seed(0)
    model = Net()
    if replica_id == 1 and attempt > 1:  # a restarted group starts from other weights: only a heal makes them equal
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)  # momentum: optimizer state to heal
    model, optimizer = fabric.setup(model, optimizer)
    group = fabric.strategy.replica_group
    healed: list[int] = []
    uncommitted: list[int] = []
    longest = 0.0
    kill_step = -1
    while group.current_step < steps:
        step = group.current_step
        killing = step == kill_step
        model.module.kill_in = phase if killing else ""
        if killing and phase == "optimizer":
            optimizer.optimizer.register_step_pre_hook(lambda *args: os.kill(os.getpid(), signal.SIGKILL))
        started = time.monotonic()
        loss = model(batch(step)).square().mean()  # the window opens here, and a healing group heals
        if group.current_step != step:
            healed.append(step)
        fabric.backward(loss)
        if not optimizer.step():  # the vote: False when a peer died in this window, and nothing was stepped
            uncommitted.append(step)
        optimizer.zero_grad()
        longest = max(longest, time.monotonic() - started)
        if kill_step < 0:  # counted from the attempt's first window (where a restarted attempt heals)
            kill_step = step + int(after) if after else steps + 1
    # Each group asks to save to a path of its own: only the group ranked 0 in the last quorum writes.
    fabric.save(out / f"checkpoint{replica_id}", {"model": model, "optimizer": optimizer, "step": group.current_step})
    full = {k: v.full_tensor().clone() for k, v in model.state_dict().items()}
    torch.save({"weights": full, "steps": group.current_step, "uncommitted": uncommitted, "healed": healed,
                "longest_step_s": longest}, out / f"group{replica_id}.pt")
    if replica_id == 0:  # stay in the quorum until group 1 has its last step
        _wait_for(out / "group1.pt")


def _wait_for(path: Path) -> None:
    deadline = time.monotonic() + WAIT_S
    while not path.exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"{path} did not appear within {WAIT_S} s")
        time.sleep(0.01)


if __name__ == "__main__":
    os.environ.setdefault("RUST_LOG", "warn")
    main(int(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4] if len(sys.argv) > 4 else "")
