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

from ft_common import (Net, batch, fault_tolerance, full_weights, record_pid, start_from_other_weights, wait_for,
                       write_record)
from lightning_fsdp.fabric import FSDPStrategy


def main(replica_id: int, out: Path, steps: int, kill: str) -> None:
    attempt = record_pid(out, replica_id)
    phase, _, after = kill.partition("@")
    strategy = FSDPStrategy(fault_tolerance=fault_tolerance(out, replica_id),
                            auto_wrap_policy={nn.Linear})  # three units: a, b, root
    fabric = Fabric(accelerator="cpu", devices=1, strategy=strategy)
    fabric.launch()
    torch.manual_seed(0)
    model = Net()
    if replica_id == 1 and attempt > 1:
        start_from_other_weights(model)
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
    write_record(out, replica_id, {"weights": full_weights(model.state_dict()), "steps": group.current_step,
                                   "uncommitted": uncommitted, "healed": healed, "longest_step_s": longest})
    if replica_id == 0:
        wait_for(out / "group1.pt")


if __name__ == "__main__":
    os.environ.setdefault("RUST_LOG", "warn")
    main(int(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4] if len(sys.argv) > 4 else "")
