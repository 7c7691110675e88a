"""A Fabric training loop that survives preemption and lost ranks.

- Saves every ``--every`` steps into ``--out`` (``step-00000100``, ...), keeping the newest ``--keep``.
- On SIGTERM or SIGUSR1 on any rank, every rank saves at the end of the current step and the job exits with
  143/138 (or requeues itself under SLURM with ``--requeue``), so the next start loses nothing.
- On (re)start, it resumes from the newest checkpoint that is complete and passes verification, including the
  position in the data.

Run it under torchrun, which restarts the whole job when a rank dies::

    torchrun --nproc_per_node=2 --max-restarts=3 examples/preemptible_train.py --steps 200 --every 50

or under SLURM (``#SBATCH --signal=USR1@120`` sends SIGUSR1 two minutes before the time limit)::

    srun python examples/preemptible_train.py --requeue
"""

from __future__ import annotations

import argparse
import itertools
import os

import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lightning_fsdp.fabric import FSDPStrategy
from lightning_fsdp.preemption import Preemption
from lightning_fsdp.step_checkpoints import StepCheckpoints


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--every", type=int, default=50, help="save every this many steps")
    parser.add_argument("--keep", type=int, default=3, help="keep this many newest checkpoints")
    parser.add_argument("--out", default="checkpoints/preemptible")
    parser.add_argument("--requeue", action="store_true", help="requeue the SLURM job after the emergency save")
    parser.add_argument("--width", type=int, default=256, help="hidden size of the toy model")
    parser.add_argument("--log-every", type=int, default=10)
    args = parser.parse_args()

    # Under torchrun or srun, one process per device: Fabric takes the count from the launcher's environment.
    devices = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("SLURM_NTASKS_PER_NODE", "1")))
    fabric = Fabric(accelerator="auto", devices=devices, num_nodes=int(os.environ.get("SLURM_NNODES", "1")),
                    strategy=FSDPStrategy())
    fabric.launch()
    # Signals are only recorded from here on; the ranks agree on them once per step, below.
    preemption = Preemption(action="requeue" if args.requeue else "exit").install()

    torch.manual_seed(0)
    width = args.width
    model = nn.Sequential(nn.Embedding(64, width), nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width),
                          nn.Linear(width, 64))
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    tokens = torch.randint(0, 64, (4096, 33), generator=torch.Generator().manual_seed(0))
    sampler = DistributedSampler(TensorDataset(tokens), num_replicas=fabric.world_size, rank=fabric.global_rank)
    loader = DataLoader(TensorDataset(tokens), batch_size=8, sampler=sampler)

    checkpoints = StepCheckpoints(fabric, args.out, keep_last=args.keep)
    state = {"model": model, "optimizer": optimizer, "step": 0}
    resumed = checkpoints.resume(state)  # None on a fresh start
    fabric.print(f"resumed from {resumed} at step {state['step']}" if resumed else "starting from scratch")

    step = state["step"]
    while step < args.steps:
        # The data position is a function of the step: the epoch's order, minus the batches already trained on.
        epoch, position = divmod(step, len(loader))
        sampler.set_epoch(epoch)
        for (batch,) in itertools.islice(loader, position, None):
            logits = model(batch[:, :-1].to(fabric.device))
            loss = F.cross_entropy(logits.reshape(-1, 64), batch[:, 1:].reshape(-1).to(fabric.device))
            fabric.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            state["step"] = step
            if preemption.requested():  # one all-reduce: did any rank get a signal?
                fabric.print(f"preempted ({preemption.agreed_signal.name}): saving step {step}")
                checkpoints.save(state)
                preemption.finish(fabric)  # exits (or requeues and exits)
            if step % args.every == 0:
                checkpoints.save(state)
                fabric.print(f"saved step {step}", flush=True)
            if step % args.log_every == 0:
                fabric.print(f"step {step} loss {loss.item():.4f}", flush=True)
            if step >= args.steps:
                break
    fabric.print(f"done at step {step}")


if __name__ == "__main__":
    main()
