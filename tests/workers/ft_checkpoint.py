"""One replica group of one rank, trained with Fabric and ``FSDPStrategy(fault_tolerance=...)``, for
``tests/test_ft_checkpoint.py``: checkpoints under fault tolerance (issue 44).

    python ft_checkpoint.py REPLICA_ID OUT_DIR PLAN_JSON

The lighthouse's address is read from ``OUT_DIR/lighthouse``. Every group trains on the same batch at a step (seeded
by the committed step alone), so the weights after ``s`` committed steps are those of a run without fault tolerance,
bit for bit, whichever groups took part. ``PLAN_JSON`` says what this process does:

- ``steps``: train until torchft has committed this many steps; ``min_replicas``, ``quorum_timeout``, ``init_sync``:
  the argument's;
- ``load``: a checkpoint (relative to ``OUT_DIR``) to resume from with ``fabric.load`` before the first step;
- ``save_at``: committed steps after which this group asks to save ``OUT_DIR/ckpt/step-<8 digits>`` (only the group
  ranked 0 in the last quorum writes); ``{"model", "optimizer"}``, momentum included;
- ``in_save``: ``{"step-...": "pause" | "die"}``: inside that save, once its files are written and before its commit,
  write ``OUT_DIR/saving-<name>`` and either wait for ``OUT_DIR/go-<name>`` or SIGKILL this process;
- ``gates``: ``{"<step>": "<name>"}``: before that step (or the first one after it), write
  ``OUT_DIR/at-<name>-<id>`` and wait for ``OUT_DIR/<name>``;
- ``preemption``: install ``Preemption(action="exit")`` and check ``requested()`` after every step; when agreed,
  save ``step-<committed>`` and ``finish`` (exit status 143 for SIGTERM);
- ``stay_for``: a file to wait for after the last step, staying in the quorum until a peer is done.

A ``FaultToleranceError`` ends the loop and is recorded with the seconds its step took. At the end the process writes
``OUT_DIR/result<id>-<attempt>.json``: the step it started at (after any load), the steps it healed at, what it saved
and whether it wrote, the error, its longest step; and its full weights to ``OUT_DIR/weights<id>-<attempt>.pt``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
from lightning.fabric import Fabric
from torch import nn

from lightning_fsdp import FaultToleranceError
from lightning_fsdp.checkpoint import save as save_module
from lightning_fsdp.fabric import FSDPStrategy
from lightning_fsdp.preemption import Preemption

WAIT_S = 60.0


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def batch(step: int) -> torch.Tensor:
    return torch.randn(4, 6, generator=torch.Generator().manual_seed(step))


def _wait_for(path: Path) -> None:
    deadline = time.monotonic() + WAIT_S
    while not path.exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"{path} did not appear within {WAIT_S} s")
        time.sleep(0.01)


def _fault_in_save(out: Path, faults: dict[str, str]) -> None:
    """Stop chosen saves between their written files and their commit (see the module's ``in_save``)."""
    original = save_module._write_then_commit

    def write_then_commit(store, write, staged, target, comm):  # noqa: ANN001 - the wrapped function's own
        name = Path(str(target)).name
        action = faults.get(name)

        def written_then_fault() -> None:
            write()
            if action is None:
                return
            (out / f"saving-{name}").touch()
            if action == "die":
                os.kill(os.getpid(), signal.SIGKILL)
            _wait_for(out / f"go-{name}")

        return original(store, written_then_fault, staged, target, comm)

    save_module._write_then_commit = write_then_commit


def main(replica_id: int, out: Path, plan: dict) -> None:
    began = time.time()
    with open(out / f"pids{replica_id}", "a") as f:
        f.write(f"{os.getpid()}\n")
    attempt = len((out / f"pids{replica_id}").read_text().split())
    fault_tolerance = {"replica_id": replica_id, "num_replica_groups": 2,
                       "lighthouse": (out / "lighthouse").read_text(), "min_replicas": plan["min_replicas"],
                       "timeout": 10.0, "quorum_timeout": plan.get("quorum_timeout", 30.0), "connect_timeout": 10.0,
                       "init_sync": plan.get("init_sync", False)}
    strategy = FSDPStrategy(fault_tolerance=fault_tolerance, auto_wrap_policy={nn.Linear})
    fabric = Fabric(accelerator="cpu", devices=1, strategy=strategy)
    fabric.launch()
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)  # momentum: state the checkpoint must hold
    model, optimizer = fabric.setup(model, optimizer)
    group = fabric.strategy.replica_group
    _fault_in_save(out, plan.get("in_save", {}))
    result: dict = {"healed": [], "saved": [], "error": None, "longest_step_s": 0.0, "began": began,
                    "set_up": time.time()}
    if plan.get("load"):
        fabric.load(out / plan["load"], {"model": model, "optimizer": optimizer})
    result["start_step"] = group.current_step
    preemption = Preemption(action="exit").install() if plan.get("preemption") else None
    gates = plan.get("gates", {})

    def save(step: int) -> None:
        name = f"step-{step:08d}"
        writes = fabric.strategy._writes_checkpoints()
        fabric.save(out / "ckpt" / name, {"model": model, "optimizer": optimizer})
        result["saved"].append([name, writes])

    def finish() -> None:
        full = {k: v.full_tensor().clone() for k, v in model.state_dict().items()}
        torch.save(full, out / f"weights{replica_id}-{attempt}.pt")
        result["steps"], result["ended"] = group.current_step, time.time()
        (out / f"result{replica_id}-{attempt}.json").write_text(json.dumps(result))

    while group.current_step < plan["steps"]:
        step = group.current_step
        due = [key for key in gates if step >= int(key)]  # a gate passed over by a heal is met at the next step
        gate = gates.pop(min(due, key=int)) if due else None
        if gate:
            (out / f"at-{gate}-{replica_id}").touch()
            _wait_for(out / gate)
        started = time.monotonic()
        try:
            loss = model(batch(step)).square().mean()  # the window opens here, and a healing group heals
            # A heal moves the step, or, at the same step (init_sync at step 0), keeps the group out of the vote.
            if group.current_step != step or not group.manager.is_participating():
                result["healed"].append(step)
            fabric.backward(loss)
            committed = optimizer.step()
            optimizer.zero_grad()
        except FaultToleranceError as err:
            result["error"], result["error_after_s"] = str(err), time.monotonic() - started
            break
        result["longest_step_s"] = max(result["longest_step_s"], time.monotonic() - started)
        if preemption is not None and preemption.requested():
            save(group.current_step)
            result["preempted_at"] = group.current_step
            finish()
            preemption.finish(fabric)
        if committed and group.current_step in plan.get("save_at", ()):
            save(group.current_step)
    finish()
    if plan.get("stay_for"):
        _wait_for(out / plan["stay_for"])


if __name__ == "__main__":
    os.environ.setdefault("RUST_LOG", "warn")
    main(int(sys.argv[1]), Path(sys.argv[2]), json.loads(sys.argv[3]))
