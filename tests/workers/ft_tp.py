"""One replica group of two ranks with tensor parallelism inside it (``tensor_parallel_size=2``: a ``(shard=1, tp=2)``
mesh), trained with Fabric and ``FSDPStrategy(fault_tolerance=...)``, for ``tests/test_ft_tp.py``'s fault run.

    torchrun --nproc_per_node=2 ft_tp.py REPLICA_ID OUT_DIR STEPS [KILL_AT]

``KILL_AT`` (a number N): rank 1 of the group SIGKILLs itself in backward (a hook on the column-split layer's
output gradient: the model is one FSDP unit, so before any cross-group average of the step) N steps after the
attempt's first window, and torchrun stops rank 0. The lighthouse's address is read from ``OUT_DIR/lighthouse``.
Every group trains on the same batch at a step (seeded by the step alone), so the cross-group average is one group's
gradient. ``min_replicas=2``: a step needs both groups. A restarted group starts at step 0 from other weights, so
only a heal makes the groups equal. Each rank appends its pid to ``OUT_DIR/pids<id>``; at the end rank 0 writes the
full weights, the parameters' layout, the counters, the steps it healed at and did not commit to
``OUT_DIR/group<id>.pt``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
from lightning.fabric import Fabric

from ft_common import (Net, batch, fault_tolerance, full_weights, record_pid, start_from_other_weights, wait_for,
                       write_record)
from lightning_fsdp.fabric import FSDPStrategy

# Column-split then row-split: each rank holds half of a's rows and half of b's columns (a DTensor on the 2-D mesh),
# and b's output is summed over the two tp ranks.
PLAN = {"a": "colwise", "b": "rowwise"}


def main(replica_id: int, out: Path, steps: int, kill_after: int) -> None:
    rank = int(os.environ["RANK"])
    restarted = record_pid(out, replica_id) > 2  # the first attempt's two ranks wrote before
    strategy = FSDPStrategy(fault_tolerance=fault_tolerance(out, replica_id), tensor_parallel_size=2,
                            tensor_parallel_plan=PLAN)
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    torch.manual_seed(0)
    model = Net()
    if restarted:
        start_from_other_weights(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)  # momentum: TP-sharded state to heal
    model, optimizer = fabric.setup(model, optimizer)
    group = fabric.strategy.replica_group
    healed: list[int] = []
    uncommitted: list[int] = []
    kill_step = -1
    while group.current_step < steps:
        step = group.current_step
        model.module.kill_in = "backward" if rank == 1 and step == kill_step else ""
        loss = model(batch(step)).square().mean()  # the window opens here, and a healing group heals
        if group.current_step != step:
            healed.append(step)
        fabric.backward(loss)
        if not optimizer.step():  # the vote: False when a peer died in this window
            uncommitted.append(step)
        optimizer.zero_grad()
        if kill_step < 0:
            kill_step = step + kill_after if kill_after else steps + 1
    # What the run trained: each parameter's mesh axes and placements (a DTensor on the (shard, tp) mesh).
    layout = {k: [list(v.device_mesh.mesh_dim_names), [f"{type(p).__name__}({getattr(p, 'dim', '')})"
                                                        for p in v.placements]]
              for k, v in model.module.named_parameters()}
    full = full_weights(model.state_dict())  # on every rank: a collective over the group's mesh
    if rank == 0:
        write_record(out, replica_id, {"weights": full, "layout": layout, "steps": group.current_step,
                                       "uncommitted": uncommitted, "healed": healed})
    if replica_id == 0:
        wait_for(out / "group1.pt")


if __name__ == "__main__":
    os.environ.setdefault("RUST_LOG", "warn")
    main(int(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]) if len(sys.argv) > 4 else 0)
