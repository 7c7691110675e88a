"""Preemption: a signal that reaches any rank makes every rank save at the next step boundary, then exit or requeue.

Clusters announce the end of a job with a signal: SIGTERM (a spot reclaim, Kubernetes), SIGUSR1 (SLURM, some
seconds before the time limit). Often only some ranks get it, and at different times. Two rules follow:

- **Nothing collective in the signal handler.** A save is a sequence of collectives; run from a handler it would
  interleave with the collectives of the interrupted step, and a rank that got no signal would never join it.
  The handler only records the signal.
- **One cheap agreement at each step boundary.** :meth:`Preemption.requested` all-reduces (MAX) one integer on
  every rank: 0, or the signal this rank got. Every rank calls it at the same point of every step, so the ranks
  that got no signal learn of it in the same collective, and all of them save the same, complete step. A rank that
  died instead makes that collective fail after the process group's timeout, with the usual message, never hang.

Fabric::

    preemption = Preemption(action="exit")    # SIGTERM and SIGUSR1 by default
    preemption.install()                       # on every rank, after fabric.launch()
    for step in range(start, total):
        train_step(...)
        if preemption.requested():             # one all_reduce
            fabric.save(ckpt_dir / f"step-{step + 1:08d}", state)
            preemption.finish(fabric)          # waits for the save's commit, then exits (or requeues, or returns)

With the Trainer, :class:`PreemptionCallback` does the same at each optimizer step boundary.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from typing import Any, Iterable, Optional, Union

import torch
import torch.distributed as dist

from lightning_fsdp._base.failures import explain_collective_failure

__all__ = ["Preemption", "ACTIONS", "DEFAULT_SIGNALS", "requeue_slurm_job"]

ACTIONS = ("exit", "requeue", "stop")
DEFAULT_SIGNALS = ("SIGTERM", "SIGUSR1")
SignalInput = Union[str, int, signal.Signals]


class Preemption:
    """Turns a signal on any rank into an agreed emergency save on every rank.

    Args:
        signals: the signals that announce a preemption: names (``"SIGTERM"``, ``"USR1"``) or numbers. Default
            SIGTERM and SIGUSR1.
        action: what :meth:`finish` does after the save: ``"exit"`` ends the process with ``exit_code``;
            ``"requeue"`` asks SLURM to requeue the job (``scontrol requeue``, from global rank 0) and then exits;
            ``"stop"`` returns, and the training loop ends on its own.
        exit_code: the exit status for ``"exit"`` and ``"requeue"``. Default ``128 + signal number`` (143 for SIGTERM),
            what a process killed by that signal reports, so schedulers and ``torchrun --max-restarts`` treat the job
            as interrupted, not finished, and restart it. Pass ``0`` where a preempted job must count as done.
    """

    def __init__(
        self,
        *,
        signals: Iterable[SignalInput] = DEFAULT_SIGNALS,
        action: str = "exit",
        exit_code: Optional[int] = None,
    ) -> None:
        if action not in ACTIONS:
            raise ValueError(
                f"`Preemption(action={action!r})` is not supported; allowed: {', '.join(map(repr, ACTIONS))}. HINT:"
                " `Preemption(action='exit')` exits after the emergency save, `'requeue'` requeues a SLURM job first."
            )
        if exit_code is not None and (not isinstance(exit_code, int) or not 0 <= exit_code <= 255):
            raise ValueError(
                f"`Preemption(exit_code={exit_code!r})` must be an int from 0 to 255, or None for 128 + the signal"
                " number. HINT: `Preemption(exit_code=0)` makes a preempted job count as finished."
            )
        self.signals = tuple(_as_signal(s) for s in signals)
        if not self.signals:
            raise ValueError("`Preemption(signals=())` names no signal. HINT: leave the default (SIGTERM, SIGUSR1).")
        self.action = action
        self.exit_code = exit_code
        self._received = 0  # the signal number this rank got, 0 for none; written by the handler only
        self._agreed = 0  # the signal every rank agreed on
        self._previous: dict[int, Any] = {}

    # --- the handler: records only -----------------------------------------------------------------------------

    def install(self) -> "Preemption":
        """Catch the configured signals in this process (call it on every rank, from the main thread)."""
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError(
                "`Preemption.install()` must run in the main thread: Python delivers signals only there. HINT: call"
                " it from the training script itself, after `fabric.launch()`."
            )
        for sig in self.signals:
            if sig not in self._previous:
                self._previous[sig] = signal.signal(sig, self._record)
        return self

    def uninstall(self) -> None:
        """Put back the handlers that were there before :meth:`install`."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        self._previous = {}

    def _record(self, signum: int, frame: Any) -> None:
        # Only a store: the handler may run between any two bytecodes, in the middle of a collective or a save.
        if not self._received:
            self._received = signum

    @property
    def received(self) -> Optional[signal.Signals]:
        """The signal this rank received, if any (not agreed: other ranks may not know yet)."""
        return signal.Signals(self._received) if self._received else None

    # --- the agreement, at step boundaries -----------------------------------------------------------------

    def requested(self) -> bool:
        """Whether any rank has received a preemption signal, agreed by every rank. Call it on every rank at the same
        point of every step (after the optimizer step): it is one all-reduce of one integer."""
        if self._agreed:
            return True
        local = self._received
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
            flag = torch.tensor([local], dtype=torch.int64, device=device)
            with explain_collective_failure("the preemption agreement"):
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            local = int(flag.item())
        self._agreed = local
        return bool(local)

    @property
    def agreed_signal(self) -> Optional[signal.Signals]:
        """The agreed signal (the highest number any rank got), once :meth:`requested` returned True."""
        return signal.Signals(self._agreed) if self._agreed else None

    # --- after the save ------------------------------------------------------------------------------------

    def finish(self, fabric: Any = None) -> None:
        """After the emergency save, on every rank: wait until the save is committed (a background save too), then
        exit or requeue as configured; with ``action="stop"``, return."""
        if not self._agreed:
            raise RuntimeError(
                "`Preemption.finish()` was called although no preemption was agreed. HINT: call it only when"
                " `preemption.requested()` returned True, after the emergency save."
            )
        strategy = getattr(fabric, "strategy", None)
        if strategy is not None and hasattr(strategy, "wait_for_saves"):
            strategy.wait_for_saves()
        if self.action == "requeue" and _global_rank() == 0:
            requeue_slurm_job()
        if fabric is not None:
            fabric.barrier()  # rank 0 has requeued before any rank exits: SLURM may kill the job when one exits
        if self.action == "stop":
            return
        sys.stdout.flush()
        sys.stderr.flush()
        sys.exit(self.exit_status)

    @property
    def exit_status(self) -> int:
        return self.exit_code if self.exit_code is not None else 128 + self._agreed


def requeue_slurm_job() -> int:
    """Ask SLURM to requeue this job (``scontrol requeue <id>``; the array task for array jobs). Returns scontrol's
    exit status; a failure is printed, not raised: the checkpoint is saved, and a user can resubmit."""
    array_job, array_task = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    job = f"{array_job}_{array_task}" if array_job and array_task else os.environ.get("SLURM_JOB_ID", "")
    if not re.fullmatch(r"[0-9_]+", job):
        print(f"[lightning-fsdp] cannot requeue: SLURM_JOB_ID is {job!r}, not a SLURM job id.", file=sys.stderr)
        return 1
    result = subprocess.run(["scontrol", "requeue", job], check=False).returncode
    print(f"[lightning-fsdp] requeued SLURM job {job}" if result == 0
          else f"[lightning-fsdp] `scontrol requeue {job}` failed with status {result}", file=sys.stderr, flush=True)
    return result


def _global_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else int(os.environ.get("RANK", "0"))


def _as_signal(value: SignalInput) -> int:
    given = value
    if isinstance(value, str):
        name = value.upper() if value.upper().startswith("SIG") else "SIG" + value.upper()
        found = getattr(signal.Signals, name, None)
        if found is None:
            raise ValueError(
                f"`Preemption(signals=[..., {value!r}])`: no signal of that name. HINT: use names like 'SIGTERM',"
                " 'SIGUSR1', 'SIGUSR2' or signal numbers."
            )
        value = found
    if isinstance(value, int) and value in (int(signal.SIGKILL), int(signal.SIGSTOP)):
        raise ValueError(
            f"`Preemption(signals=[..., {given!r}])`: SIGKILL and SIGSTOP cannot be caught. HINT: for lost ranks, resume"
            " from the newest checkpoint instead (`fabric.load('<dir>/latest', state)`)."
        )
    try:
        return int(signal.Signals(int(value)))
    except (ValueError, TypeError):
        raise ValueError(
            f"`Preemption(signals=[..., {given!r}])` is not a signal. HINT: use names like 'SIGTERM' or signal numbers."
        ) from None
