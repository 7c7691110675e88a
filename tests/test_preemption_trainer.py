"""Preemption with the Trainer: a simulated SLURM job and ``fit(ckpt_path="last")`` (issue 20).

The SLURM job is 2 processes started as srun starts them (``SLURM_*`` variables, no torchrun), with a fake
``scontrol`` on ``PATH`` that records its arguments. SIGUSR1 reaches both ranks mid-fit (SLURM signals every task
of the step): the hpc checkpoint must be written once, in this project's sharded format, the requeue called once,
and the next launch of the same job must resume from it on its own and end with the uninterrupted run's weights.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
from pathlib import Path

import pytest
import torch

import forkserver
from launch import WORKERS, early, free_port, start_early, torchrun, worker_env
from test_preemption import LAUNCH_LIMIT_S, PG_TIMEOUT_S, _wait, assert_same_weights

# Two-rank Trainer runs, killed, requeued and resumed: both cores stay busy (conftest.py runs such tests late).
pytestmark = pytest.mark.fills_both_cores

SIGUSR1_EXIT = 138  # 128 + SIGUSR1
JOB_ID = "4242"


def _make_fake_scontrol(bin_dir: Path) -> Path:
    """``bin_dir`` with a fake ``scontrol`` that records its arguments in ``$LFSDP_PRE_ROOT/scontrol.log``."""
    script = bin_dir / "scontrol"
    script.write_text('#!/bin/sh\necho "$@" >> "$LFSDP_PRE_ROOT/scontrol.log"\n')
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return bin_dir


def _srun_env(root: Path, bin_dir: Path, rank: int, port: str, **extra: str) -> dict[str, str]:
    """The environment of rank ``rank`` of a simulated ``srun``: SLURM's variables, none of torchrun's."""
    env = worker_env(root / "out", LFSDP_PRE_ROOT=str(root), LFSDP_TEST_PG_TIMEOUT=PG_TIMEOUT_S, **extra)
    for name in [k for k in env if k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "GROUP_RANK", "LOCAL_WORLD_SIZE")
                 or k.startswith("TORCHELASTIC") or k.startswith("SLURM_")]:
        del env[name]
    env.update(SLURM_NTASKS="2", SLURM_NTASKS_PER_NODE="2", SLURM_NNODES="1", SLURM_NODEID="0",
               SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank), SLURM_JOB_ID=JOB_ID, SLURM_JOB_NAME="train",
               SLURM_NODELIST="127.0.0.1", MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
               PATH=f"{bin_dir}{os.pathsep}{env['PATH']}")
    return env


@start_early
def _warm_server_for_the_job(folder: Path) -> tuple[Path, str | None]:
    """The fake ``scontrol``'s folder, made ahead of the tests (``launch.start_early``), and a warm server for the
    simulated job's environment started at once, in the background. The SLURM variables and that ``PATH`` are an
    environment of their own (tests/forkserver): without this, the first job's two ranks ran as real processes (4 to
    5 s of imports each, the summary's "2 x preempt_trainer.py") and a server was started at the second request
    anyway; now its imports happen once, beside the earlier tests, and every rank of every job is forked."""
    bin_dir = _make_fake_scontrol(folder)
    server = forkserver.prewarm(_srun_env(folder, bin_dir, 0, "0"))  # a forked rank sets its own SLURM_PROCID again
    return bin_dir, server


@pytest.fixture(scope="module")
def fake_scontrol(tmp_path_factory) -> Path:
    """The folder holding the fake ``scontrol`` (:func:`_warm_server_for_the_job`): one folder for every run, so that
    every run has the same ``PATH`` and the same warm server forks its ranks (a new ``PATH`` is a new environment,
    whose first ranks run as real processes: tests/forkserver)."""
    bin_dir, server = early(__name__) or _warm_server_for_the_job(tmp_path_factory.mktemp("fake_slurm_bin"))
    # Started long before in a whole run, it serves already; in a run of this file alone, the wait is the imports
    # that the first job's ranks would otherwise pay each, in real processes.
    forkserver.wait_until_serving(server)
    return bin_dir


def srun(root: Path, bin_dir: Path, **extra: str) -> tuple[list[int], str]:
    port = str(free_port())
    procs = [subprocess.Popen([forkserver.python(), str(WORKERS / "preempt_trainer.py")],
                              env=_srun_env(root, bin_dir, rank, port, **extra),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in (0, 1)]
    return _wait(procs)


@pytest.fixture(scope="module")
def trainer_reference(tmp_path_factory, fake_scontrol) -> Path:
    root = tmp_path_factory.mktemp("trainer_reference")
    codes, log = srun(root, fake_scontrol)
    assert codes == [0, 0], log[-4000:]
    return root / "final.pt"


def test_slurm_sigusr1_saves_requeues_and_resumes(tmp_path, trainer_reference, fake_scontrol):
    from lightning_fsdp.checkpoint.integrity.verify import verify_checkpoint

    root = tmp_path
    record = root / "scontrol.log"
    # Global step 3 is the last step of epoch 1 (2 steps per epoch): the save after it is at an epoch boundary.
    codes, log = srun(root, fake_scontrol, LFSDP_PRE_SIGNAL="SIGUSR1:0+1:3")
    assert codes == [SIGUSR1_EXIT, SIGUSR1_EXIT], log[-4000:]
    saved = sorted(p.name for p in root.iterdir() if "hpc_ckpt" in p.name)
    assert saved == ["hpc_ckpt_1.ckpt"], saved
    assert (root / "hpc_ckpt_1.ckpt").is_dir() and verify_checkpoint(root / "hpc_ckpt_1.ckpt")
    assert record.read_text().splitlines() == [f"requeue {JOB_ID}"]
    assert not (root / "final.pt").exists()

    codes, log = srun(root, fake_scontrol)  # the requeued job: same script, no ckpt_path
    assert codes == [0, 0], log[-4000:]
    result = json.loads((root / "result.json").read_text())
    assert result == {"started_at": 4, "global_step": 10}, result
    assert record.read_text().splitlines() == [f"requeue {JOB_ID}"]  # still once
    assert_same_weights(root / "final.pt", trainer_reference)


def test_sigterm_to_one_rank_then_fit_ckpt_path_last(tmp_path, trainer_reference):
    root = tmp_path
    env = worker_env(root / "out", LFSDP_PRE_ROOT=str(root), LFSDP_TEST_PG_TIMEOUT=PG_TIMEOUT_S,
                     LFSDP_PRE_SIGNAL="SIGTERM:1:5")
    env = {k: v for k, v in env.items() if not k.startswith("SLURM_")}
    proc = subprocess.run(torchrun("preempt_trainer.py", 2), env=env, capture_output=True, text=True,
                          timeout=LAUNCH_LIMIT_S)
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "exitcode  : 143" in log, log[-4000:]  # torchrun reports each rank's status
    assert (root / "checkpoints" / "last.ckpt").is_dir(), log[-4000:]
    env["LFSDP_PRE_SIGNAL"], env["LFSDP_PRE_RESUME"] = "", "last"
    proc = subprocess.run(torchrun("preempt_trainer.py", 2), env=env, capture_output=True, text=True,
                          timeout=LAUNCH_LIMIT_S)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    result = json.loads((root / "result.json").read_text())
    assert result == {"started_at": 6, "global_step": 10}, result
    assert_same_weights(root / "final.pt", trainer_reference)
