"""A Fabric training loop that survives preemption and lost ranks, with real signals and kills at chosen points.

Run as a plain distributed script (by torchrun, or one process per rank with RANK/WORLD_SIZE set). Environment:

- ``LFSDP_PRE_DIR``: the step-checkpoint directory; ``LFSDP_PRE_TOTAL`` steps in all; a periodic save every
  ``LFSDP_PRE_EVERY`` steps; validation every ``LFSDP_PRE_VAL_EVERY`` steps; ``LFSDP_PRE_KEEP`` for ``keep_last``.
- ``LFSDP_PRE_EVENTS``: ``attempt:kind:ranks:step`` items separated by ``;``. ``attempt`` is torchrun's restart count
  (0 outside torchrun restarts); ``ranks`` is ``0``, ``1`` or ``0+1``; ``step`` counts completed steps. Kinds:
  ``sigterm``/``sigusr1`` (sent to itself at the start of that step, so it lands in the middle of it),
  ``sigterm_in_save`` (sent from inside DCP's write of the periodic save after that step), ``sigterm_in_val``
  (sent between the validation batches after that step), ``kill`` (SIGKILL at the start of that step) and
  ``kill_in_save`` (SIGKILL inside the DCP write of the periodic save after that step).

Rank 0 appends what each run did to ``<dir>/../runs.jsonl``; every rank appends each completed step to
``<dir>/../steps.rank<r>``; the final full weights go to ``<dir>/../final.pt``.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from common import full_params, loss_fn, make_fabric
from lightning_fsdp.preemption import Preemption
from lightning_fsdp.step_checkpoints import StepCheckpoints
from models import TinyTransformer

DIR = Path(os.environ["LFSDP_PRE_DIR"])
WORK = DIR.parent
TOTAL = int(os.environ.get("LFSDP_PRE_TOTAL", "14"))
EVERY = int(os.environ.get("LFSDP_PRE_EVERY", "4"))
VAL_EVERY = int(os.environ.get("LFSDP_PRE_VAL_EVERY", "0"))
KEEP = int(os.environ["LFSDP_PRE_KEEP"]) if os.environ.get("LFSDP_PRE_KEEP") else None
ASYNC = os.environ.get("LFSDP_PRE_ASYNC") == "1"
ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
RANK = int(os.environ["RANK"])


def _events() -> dict[tuple[str, int], str]:
    """``(kind, step) -> signal`` for this rank and attempt."""
    mine = {}
    for item in filter(None, os.environ.get("LFSDP_PRE_EVENTS", "").split(";")):
        attempt, kind, ranks, step = item.split(":")
        if int(attempt) == ATTEMPT and str(RANK) in ranks.split("+"):
            mine[(kind, int(step))] = kind
    return mine


EVENTS = _events()


def _log(record: dict) -> None:
    if RANK == 0:
        with open(WORK / "runs.jsonl", "a") as f:
            f.write(json.dumps({"attempt": ATTEMPT, "time": time.time(), **record}) + "\n")


def _fire(kind: str, step: int) -> None:
    if (kind, step) not in EVENTS:
        return
    (WORK / f"fired-{ATTEMPT}-{kind}-{step}.rank{RANK}").write_text(str(time.time()))
    if kind.startswith("kill"):
        print(f"[rank {RANK}] SIGKILL at {kind} {step}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    sig = signal.SIGUSR1 if kind == "sigusr1" else signal.SIGTERM
    os.kill(os.getpid(), sig)


def _arm_in_save(step: int) -> None:
    """Make the periodic save after ``step`` receive its event from inside DCP's write of this rank's shard."""
    kinds = [k for k in ("sigterm_in_save", "kill_in_save") if (k, step) in EVENTS]
    if not kinds:
        return
    from lightning_fsdp.checkpoint.integrity.sharded_write import ChecksumWriter

    original = ChecksumWriter.write_data

    def write_data(self, plan, planner):
        ChecksumWriter.write_data = original  # once
        _fire(kinds[0], step)
        return original(self, plan, planner)

    ChecksumWriter.write_data = write_data


def main() -> None:
    torch.set_num_threads(1)
    fabric = make_fabric(2, async_save=ASYNC)
    preemption = Preemption(action="exit").install()
    torch.manual_seed(0)
    plain = TinyTransformer()
    model, optimizer = fabric.setup(plain, torch.optim.AdamW(plain.parameters(), lr=1e-2))
    data = torch.randint(0, 32, (32, 9), generator=torch.Generator().manual_seed(7))
    sampler = DistributedSampler(TensorDataset(data), num_replicas=2, rank=fabric.global_rank, shuffle=True, seed=0)
    loader = DataLoader(TensorDataset(data), batch_size=2, sampler=sampler)
    checkpoints = StepCheckpoints(fabric, DIR, keep_last=KEEP)

    state = {"model": model, "optimizer": optimizer, "step": 0}
    resumed = checkpoints.resume(state)
    _log({"event": "start", "from_step": state["step"], "resumed": None if resumed is None else resumed.name})
    step = state["step"]
    while step < TOTAL:
        epoch, position = divmod(step, len(loader))
        sampler.set_epoch(epoch)  # the data order of this epoch, then skip what the checkpoint already trained on
        for (batch,) in itertools.islice(loader, position, None):
            _fire("sigterm", step)
            _fire("sigusr1", step)
            _fire("kill", step)
            fabric.backward(loss_fn(model, batch))
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            state["step"] = step
            with open(WORK / f"steps.rank{RANK}", "a") as f:
                f.write(f"{ATTEMPT} {step}\n")
            if preemption.requested():  # the step boundary: every rank agrees here
                path = checkpoints.save(state)
                _log({"event": "emergency_save", "step": step, "path": path.name,
                      "signal": preemption.agreed_signal.name})
                preemption.finish(fabric)
            if EVERY and step % EVERY == 0:
                _arm_in_save(step)
                checkpoints.save(state)
            if VAL_EVERY and step % VAL_EVERY == 0:
                with torch.no_grad():
                    for i in range(2):
                        if i == 1:
                            _fire("sigterm_in_val", step)
                        loss_fn(model, data[i * 2:(i + 1) * 2])
            if step >= TOTAL:
                break
    weights = full_params(model)
    fabric.strategy.wait_for_saves()
    if RANK == 0:
        torch.save(weights, WORK / "final.pt")
    _log({"event": "done", "step": step})


if __name__ == "__main__":
    main()
