"""Agreed emergency saves for the Trainer: ``Trainer(callbacks=[PreemptionCallback()])``.

Lightning's own handling runs collectives inside the signal handler: with ``SLURMEnvironment(auto_requeue=True)``
its SIGUSR1 handler calls ``trainer.save_checkpoint`` right there, and its SIGTERM handler broadcasts from rank 0.
A rank that got no signal never joins that save, and the interrupted step's collectives interleave with it. This
callback replaces those handlers for the duration of ``fit`` with :class:`~lightning_fsdp.preemption.Preemption`'s,
which only record the signal; the ranks agree at the end of each optimizer step (one all-reduce) and all save that
step, through the strategy, so the checkpoint is in this project's format.

Where it saves, so that the next run resumes on its own:

- under SLURM with ``SLURMEnvironment(auto_requeue=True)``: Lightning's next ``hpc_ckpt_<n>.ckpt`` in
  ``default_root_dir``; rank 0 requeues the job (``scontrol requeue``), and the requeued job's ``fit`` loads it
  without a ``ckpt_path`` (Lightning picks the newest ``hpc_ckpt_*`` on SLURM);
- elsewhere: ``last.ckpt`` in the ``ModelCheckpoint`` directory, which ``fit(ckpt_path="last")`` loads.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, Iterable, Optional

from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.callbacks import Callback

from lightning_fsdp.preemption import DEFAULT_SIGNALS, Preemption, SignalInput, requeue_slurm_job

__all__ = ["PreemptionCallback"]


class PreemptionCallback(Callback):
    """Save every rank's state at the next optimizer step after a preemption signal reaches any rank, then stop.

    Args:
        signals: as for :class:`~lightning_fsdp.preemption.Preemption`. Default SIGTERM and SIGUSR1 (under SLURM,
            SIGTERM and ``SLURMEnvironment.requeue_signal``).
        action: ``"stop"`` ends ``fit`` normally after the save; ``"exit"`` then exits the process with
            ``exit_code``; ``"requeue"`` requeues the SLURM job from rank 0, then exits. Default ``"requeue"`` under
            ``SLURMEnvironment(auto_requeue=True)``, else ``"exit"``.
        exit_code: as for ``Preemption`` (default 128 + the signal number).
        dirpath: where the emergency checkpoint goes outside SLURM (default the ``ModelCheckpoint`` directory, else
            ``<default_root_dir>/checkpoints``); it is named ``last.ckpt``.

    After ``fit``, ``callback.saved`` is the emergency checkpoint's path (None when there was no preemption).
    """

    def __init__(
        self,
        *,
        signals: Optional[Iterable[SignalInput]] = None,
        action: Optional[str] = None,
        exit_code: Optional[int] = None,
        dirpath: Optional[str] = None,
    ) -> None:
        Preemption(signals=signals or DEFAULT_SIGNALS, action=action or "exit", exit_code=exit_code)  # validate now
        self._signals, self._action, self._exit_code, self._dirpath = signals, action, exit_code, dirpath
        self._preemption: Optional[Preemption] = None
        self.saved: Optional[Path] = None

    def _slurm_requeue(self, trainer: Any) -> Optional[SLURMEnvironment]:
        env = trainer._accelerator_connector.cluster_environment
        return env if isinstance(env, SLURMEnvironment) and env.auto_requeue else None

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        # Lightning registers its handlers just before the training stage runs; these replace them until teardown.
        slurm = self._slurm_requeue(trainer)
        signals = self._signals or (("SIGTERM", slurm.requeue_signal) if slurm is not None else DEFAULT_SIGNALS)
        action = self._action or ("requeue" if slurm is not None else "exit")
        self._preemption = Preemption(signals=signals, action=action, exit_code=self._exit_code).install()
        self.saved = None

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self._preemption is None or (batch_idx + 1) % trainer.accumulate_grad_batches != 0:
            return  # mid-accumulation: the gradients of a half step are in no checkpoint, so never save here
        if not self._preemption.requested():
            return
        path = self._target(trainer)
        trainer.save_checkpoint(path)
        if hasattr(trainer.strategy, "wait_for_saves"):  # this project's strategy: a background save is committed
            trainer.strategy.wait_for_saves()
        if self._preemption.action == "requeue" and trainer.is_global_zero:
            requeue_slurm_job()
        trainer.strategy.barrier()
        self.saved = path if "://" in str(path) else Path(path)  # a URL stays a URL (Path would fold "s3://")
        trainer.should_stop = True

    def _target(self, trainer: Any) -> str:
        if self._slurm_requeue(trainer) is not None:
            path = trainer._checkpoint_connector.hpc_save_path(trainer.default_root_dir)
        else:
            directory = self._dirpath or getattr(trainer.checkpoint_callback, "dirpath", None)
            path = os.path.join(directory or os.path.join(trainer.default_root_dir, "checkpoints"), "last.ckpt")
        # Every rank must write to the same path, and each lists the directory on its own: rank 0's choice.
        return trainer.strategy.broadcast(path)

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        preemption = self._preemption
        if self.saved is not None and preemption is not None and preemption.action in ("exit", "requeue"):
            preemption.uninstall()
            sys.stdout.flush()
            sys.stderr.flush()
            raise SystemExit(preemption.exit_status)

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if self._preemption is not None:
            self._preemption.uninstall()  # Lightning's own, which its signal connector then restores in turn
            self._preemption = None
