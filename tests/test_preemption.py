"""Preemption and restarts with real signals and real kills (issue 20).

- Fabric: SIGTERM to both ranks at the same step, to one rank only, inside a save, inside validation. Each launch
  must write a complete checkpoint, exit with the configured status (143 = 128 + SIGTERM) on every rank, and not
  hang (every launch is bounded; the process-group timeout is 20 s); the chain of resumed launches must end with
  exactly the weights of an uninterrupted run (fp32, same seed, data order and dataloader position).
- ``torchrun --max-restarts=2`` with a rank SIGKILLed at a step, then mid-save: exit 0, at most K steps recomputed
  per failure, exact final weights.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

import forkserver
from launch import WORKERS, free_port, worker_env

PG_TIMEOUT_S = "20"
LAUNCH_LIMIT_S = 240  # a hang fails here, far below pytest's own limits
TOTAL, EVERY, VAL_EVERY = 14, 4, 3
SIGTERM_EXIT = 143


def _env(work: Path, **extra: str) -> dict[str, str]:
    return worker_env(work / "out", LFSDP_PRE_DIR=str(work / "ckpt"), LFSDP_PRE_TOTAL=str(TOTAL),
                      LFSDP_PRE_EVERY=str(EVERY), LFSDP_PRE_VAL_EVERY=str(VAL_EVERY),
                      LFSDP_TEST_PG_TIMEOUT=PG_TIMEOUT_S, **extra)


def run_ranks(script: str, env: dict[str, str], world: int = 2) -> tuple[list[int], str]:
    """One process per rank, as torchrun or srun start them, so each rank's own exit status is seen."""
    port = str(free_port())
    procs = []
    for rank in range(world):
        rank_env = dict(env, MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank), LOCAL_RANK=str(rank),
                        GROUP_RANK="0", WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
        procs.append(subprocess.Popen([forkserver.python(), str(WORKERS / script)], env=rank_env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    return _wait(procs)


def _wait(procs: list[subprocess.Popen]) -> tuple[list[int], str]:
    logs = []
    try:
        for proc in procs:
            logs.append(proc.communicate(timeout=LAUNCH_LIMIT_S)[0])
    except subprocess.TimeoutExpired:
        for proc in procs:
            proc.kill()
        pytest.fail(f"a launch hung for {LAUNCH_LIMIT_S} s; output so far:\n{''.join(logs)[-4000:]}")
    return [p.returncode for p in procs], "\n".join(logs)


def runs(work: Path) -> list[dict]:
    path = work / "runs.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def assert_same_weights(got_file: Path, want_file: Path) -> None:
    got, want = torch.load(got_file, weights_only=True), torch.load(want_file, weights_only=True)
    assert got.keys() == want.keys()
    differ = [k for k in want if not torch.equal(got[k], want[k])]
    assert not differ, f"not bitwise equal to the uninterrupted run: {differ}"


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("reference")
    codes, log = run_ranks("preempt_train.py", _env(work))
    assert codes == [0, 0], log[-4000:]
    return work / "final.pt"


# (events, step the emergency save is expected at); each launch resumes from the previous one's checkpoints.
CHAIN = [
    ("0:sigterm:0+1:2", 3),  # both ranks, the same step: signalled during step 3, saved at its end
    ("0:sigterm:1:4", 5),  # rank 1 only: rank 0 learns it in the agreement
    ("0:sigterm_in_save:0:8", 9),  # inside rank 0's DCP write of the periodic save after step 8
    ("0:sigterm_in_val:1:12", 13),  # between validation batches after step 12
]


@pytest.fixture(scope="module")
def chain(tmp_path_factory) -> tuple[Path, list]:
    work = tmp_path_factory.mktemp("chain")
    launches = []
    for events, _ in CHAIN + [("", None)]:
        launches.append(run_ranks("preempt_train.py", _env(work, LFSDP_PRE_EVENTS=events, LFSDP_PRE_KEEP="2")))
        if events == "":
            break
    return work, launches


@pytest.mark.parametrize("index", range(len(CHAIN)), ids=[c[0] for c in CHAIN])
def test_signal_gives_agreed_save_and_configured_exit(chain, index):
    work, launches = chain
    codes, log = launches[index]
    events, expected_step = CHAIN[index]
    fired = sorted(p.name for p in work.glob("fired-*"))
    assert codes == [SIGTERM_EXIT, SIGTERM_EXIT], f"{events}: exit codes {codes}, fired {fired}\n{log[-4000:]}"
    saves = [r for r in runs(work) if r["event"] == "emergency_save"]
    assert saves[index]["step"] == expected_step and saves[index]["signal"] == "SIGTERM", saves
    # The next launch resumed from exactly that checkpoint, which `StepCheckpoints.resume` takes only when it is
    # complete and passes every checksum.
    starts = [r for r in runs(work) if r["event"] == "start"]
    assert starts[index + 1]["resumed"] == saves[index]["path"], (starts, saves)


def test_resumed_chain_equals_uninterrupted_run(chain, reference):
    work, launches = chain
    codes, log = launches[-1]
    assert codes == [0, 0], log[-4000:]
    starts = [r["from_step"] for r in runs(work) if r["event"] == "start"]
    assert starts == [0, 3, 5, 9, 13], starts
    assert_same_weights(work / "final.pt", reference)
    # keep_last=2 after the last save (step 13 emergency, then periodic step 12 was before it): two newest kept
    kept = sorted(p.name for p in (work / "ckpt").iterdir() if not p.name.startswith("."))
    assert kept == ["step-00000012", "step-00000013"], kept


def test_torchrun_restarts_after_kills(tmp_path, reference):
    work = tmp_path
    # Attempt 0: rank 1 SIGKILLed at the start of step 6 (5 steps done, the last save at 4). Attempt 1: resumed from
    # 4, rank 0 SIGKILLed inside its DCP write of the save after step 8. Attempt 2: resumed from 4, finishes.
    env = _env(work, LFSDP_PRE_EVENTS="0:kill:1:5;1:kill_in_save:0:8")
    # `--standalone` (c10d rendezvous on a free port): each restart rendezvouses in a fresh round. With the static
    # `--master_addr/--master_port` rendezvous, torch reuses the first attempt's store, and the restarted ranks'
    # gloo connects to the dead ranks' stale addresses ("connectFullMesh failed ... Connection refused").
    cmd = [forkserver.python(), "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "--max-restarts=2",
           "--monitor-interval=0.2", str(WORKERS / "preempt_train.py")]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=LAUNCH_LIMIT_S * 2)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    starts = [(r["attempt"], r["from_step"]) for r in runs(work) if r["event"] == "start"]
    assert starts == [(0, 0), (1, 4), (2, 4)], starts
    steps = [tuple(map(int, line.split())) for line in (work / "steps.rank0").read_text().splitlines()]
    done = {a: max(s for b, s in steps if b == a) for a in (0, 1)}
    lost = [done[0] - 4, done[1] - 4]
    assert all(n <= EVERY for n in lost), f"recomputed {lost} steps per failure, more than K={EVERY}"
    assert_same_weights(work / "final.pt", reference)
