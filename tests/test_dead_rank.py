"""A dead or hung rank is not a hang: the surviving rank fails with an error within the configured timeout."""

import json
import subprocess

import pytest

import forkserver
from launch import WORKERS, free_port, worker_env

TIMEOUT_S = 5.0


def _start(mode: str, tmp_path):
    port = free_port()
    procs = []
    for rank in (0, 1):
        env = worker_env(
            tmp_path, LFSDP_DEAD_MODE=mode, LFSDP_DEAD_TIMEOUT=str(TIMEOUT_S),
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
            GROUP_RANK="0", WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
        )
        procs.append(subprocess.Popen(
            [forkserver.python(), str(WORKERS / "dead_rank.py")], env=env,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        ))
    return procs


MODES = {"die": "forward", "hang": "forward", "die_in_backward": "backward", "die_in_step": "optimizer step",
         "die_in_all_reduce": "all_reduce", "die_in_full_load": "loading the checkpoint"}
# What the timing can tell on a shared 2-core machine, where twelve processes start at once and other jobs run: the
# hung peer sleeps 10 * TIMEOUT_S + 60 s, and without the configured timeout the survivor's collective waits for
# that sleep (or for gloo's 30-minute default). So the survivor must fail before a third of the peer's sleep is over,
# and, for the hung peer, not before the timeout (an earlier error would not be the timeout's). A tighter upper bound
# (TIMEOUT_S + 2.5 s, as measured alone) would fail on a busy machine without telling anything more.
UPPER_S = (10 * TIMEOUT_S + 60) / 3


@pytest.fixture(scope="module")
def survivors(tmp_path_factory):
    """Every mode's pair of processes at once: start-up (imports, rendezvous, one step) dominates and overlaps."""
    root = tmp_path_factory.mktemp("dead_rank")
    for mode in MODES:
        (root / mode).mkdir()
    started = {mode: _start(mode, root / mode) for mode in MODES}
    logs = {}
    for mode, (survivor, other) in started.items():
        try:
            logs[mode] = survivor.communicate(timeout=180)[0]
        finally:
            other.kill()
            other.wait()
    return root, logs


@pytest.mark.parametrize("mode", list(MODES))
def test_survivor_fails_within_timeout(mode, survivors):
    root, logs = survivors
    result_file = root / mode / f"survivor_{mode}.json"
    assert result_file.is_file(), f"the survivor recorded nothing; its output:\n{logs[mode][-4000:]}"
    record = json.loads(result_file.read_text())
    assert record["raised"] is not None, f"the survivor finished the step without its peer: {record}"
    assert record["elapsed_s"] < UPPER_S, f"the survivor waited past its timeout ({TIMEOUT_S} s): {record}"
    if mode == "hang":
        assert record["elapsed_s"] >= TIMEOUT_S * 0.95, f"failed before the timeout, so not by it: {record}"
    assert record["raised"] == "CollectiveFailure", record
    message = record["message"]
    # The message names the phase, the rank that failed (the other one), and the one reporting.
    assert message.startswith(f"A collective in {MODES[mode]}") and " failed on rank 1, " in message, message
    assert "(Reported by rank 0 of 2.)" in message and f"timeout=0:00:0{int(TIMEOUT_S)}" in message, message
    assert "HINT:" in message and "Backend error:" in message, message
