"""One replica group of a fault-tolerant Fabric job: FSDP ``FULL_SHARD`` over this group's ranks, gradients averaged
with the other groups at every step through a lighthouse (torchft).

Run one ``torchrun`` per group (``launch.py`` in this folder does it all on one machine, lighthouse included)::

    lightning-fsdp lighthouse --min-replicas 2 &      # prints the address to export below
    export TORCHFT_LIGHTHOUSE=http://<host>:29510 NUM_REPLICA_GROUPS=2
    REPLICA_GROUP_ID=0 torchrun --nproc-per-node 2 --max-restarts 3 --master-port 29600 train.py \
        --min-replicas 2 --out run &
    REPLICA_GROUP_ID=1 torchrun --nproc-per-node 2 --max-restarts 3 --master-port 29700 train.py \
        --min-replicas 2 --out run --kill-at-step 8

``--kill-at-step K`` makes group rank 1 (``--kill-rank``) SIGKILL itself when the group reaches committed step K (before
its forward, or in its backward with ``--kill-in backward``), on the group's first attempt only (torchrun's
``TORCHELASTIC_RESTART_COUNT`` is 0): torchrun then stops the group's other rank and starts the whole group again,
which heals from a live group and trains on.

Every group trains on the same batch at a step, chosen by the committed step (:func:`batch`): the groups' average is
then one group's gradient exactly, so that the launcher can check the result bit for bit. A real job gives each group
a share of its own (``fabric.setup_dataloaders`` cuts the data over every rank of every group). Within a group each
rank takes its half of the step's rows, as data parallelism does.

At the end, group rank 0 writes ``<out>/group<REPLICA_GROUP_ID>.pt``: the full weights, the committed steps, where the
group healed, the steps that did not commit, its longest step and the pids of its ranks. Every process appends its
pid to ``<out>/pids<REPLICA_GROUP_ID>`` when it starts, so a restart shows as more lines.
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.fabric import Fabric
from torch import nn

from lightning_fsdp import FaultTolerance
from lightning_fsdp.fabric import FSDPStrategy

BATCH = 8  # rows of one step, split over a group's ranks
QUORUM_TIMEOUT_S = 60.0  # how long a group waits for a quorum: longer than a restarted group takes to come back


def make_model() -> nn.Module:
    torch.manual_seed(0)  # every group starts from the same weights (or pass init_sync=True)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2)  # moments and a step count: optimizer state to heal


def batch(step: int, rank: int, ranks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows of the step's batch: the same for every group, seeded by the committed step alone."""
    generator = torch.Generator().manual_seed(step)
    x, y = torch.randn(BATCH, 16, generator=generator), torch.randn(BATCH, 4, generator=generator)
    return x[rank::ranks], y[rank::ranks]


def _die_in_backward(module: nn.Module, inputs: tuple, output: torch.Tensor) -> None:
    output.register_hook(lambda grad: os.kill(os.getpid(), signal.SIGKILL))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20, help="committed steps to train")
    parser.add_argument("--out", type=Path, default=Path("runs/fault_tolerance"), help="where the records go")
    parser.add_argument("--kill-at-step", type=int, default=-1, metavar="K",
                        help="a rank SIGKILLs itself at committed step K, on the group's first attempt only")
    parser.add_argument("--kill-rank", type=int, default=1, help="which group rank --kill-at-step kills")
    parser.add_argument("--kill-in", choices=["step", "backward"], default="step",
                        help="where in step K: before its forward (step) or in the middle of its backward")
    parser.add_argument("--min-replicas", type=int, default=1,
                        help="groups a step needs to commit (as the lighthouse's --min-replicas)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    replica_id = int(os.environ["REPLICA_GROUP_ID"])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    with open(args.out / f"pids{replica_id}", "a") as f:
        f.write(f"{os.getpid()}\n")

    # replica_id, num_replica_groups and the lighthouse come from REPLICA_GROUP_ID, NUM_REPLICA_GROUPS and
    # TORCHFT_LIGHTHOUSE; the timeouts are set here.
    fault_tolerance = FaultTolerance(min_replicas=args.min_replicas, quorum_timeout=QUORUM_TIMEOUT_S, timeout=30.0)
    strategy = FSDPStrategy(fault_tolerance=fault_tolerance, auto_wrap_policy={nn.Linear})  # FULL_SHARD
    # Under torchrun, Fabric takes the group's ranks from torchrun's environment.
    fabric = Fabric(accelerator="cpu", devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")), strategy=strategy)
    fabric.launch()
    model = make_model()
    first_layer = model[0]
    model, optimizer = fabric.setup(model, make_optimizer(model))  # one model with its optimizer, set up together
    group = fabric.strategy.replica_group
    rank, ranks = fabric.global_rank, fabric.world_size  # this group's ranks, not the job's
    fabric.print(f"group {replica_id}, attempt {attempt}: {ranks} ranks, starting at committed step"
                 f" {group.current_step}")

    healed: list[list[int]] = []
    uncommitted: list[int] = []  # the step each window that did not commit was at
    longest = 0.0
    while group.current_step < args.steps:  # committed steps: a healed group goes on from the others' count
        step = group.current_step
        if step == args.kill_at_step and attempt == 0 and rank == args.kill_rank:
            print(f"group {replica_id} rank {rank}: SIGKILL at step {step}, {args.kill_in}", flush=True)
            if args.kill_in == "step":
                os.kill(os.getpid(), signal.SIGKILL)
            # In backward: from a hook on the first layer's output gradient, which comes after the last layer's
            # gradients were reduced and sent to the cross-group average, and before the first layer's.
            first_layer.register_forward_hook(_die_in_backward)
        started = time.monotonic()
        x, y = batch(step, rank, ranks)
        loss = F.mse_loss(model(x), y)  # the step's window opens here; a group that is behind heals first
        # Healed: this window's batch was for the old step, but torchft leaves a healing group's gradient out of the
        # average, so only the live groups' count (and under --min-replicas 2, with one live group, none commits).
        if group.current_step != step:
            healed.append([step, group.current_step])
            fabric.print(f"group {replica_id} healed from step {step} to step {group.current_step}")
        fabric.backward(loss)
        if not optimizer.step():  # the vote: False when a peer group died during the step (nothing was stepped)
            uncommitted.append(group.current_step)
        optimizer.zero_grad()
        longest = max(longest, time.monotonic() - started)
        if group.current_step % 5 == 0 and group.current_step != step:
            fabric.print(f"group {replica_id}: step {group.current_step}, loss {loss.item():.4f}")

    full = {k: v.full_tensor().clone() for k, v in model.state_dict().items()}  # collective over the group
    pids = [None] * ranks
    dist.all_gather_object(pids, os.getpid())
    if rank == 0:
        torch.save({"weights": full, "steps": group.current_step, "healed": healed, "uncommitted": uncommitted,
                    "longest_step_s": longest, "quorum_timeout_s": group.config.quorum_timeout, "pids": pids,
                    "attempt": attempt}, args.out / f"group{replica_id}.pt")
    fabric.print(f"group {replica_id} finished {group.current_step} steps (attempt {attempt}, healed at {healed},"
                 f" {len(uncommitted)} steps not committed)")


if __name__ == "__main__":
    os.environ.setdefault("RUST_LOG", "warn")  # torchft's Rust side logs every quorum at INFO otherwise
    main()
