"""A dead or hung rank is not a hang: the surviving rank fails with an error within the configured timeout."""

import json
import subprocess
import sys

import pytest

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
            [sys.executable, str(WORKERS / "dead_rank.py")], env=env,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        ))
    return procs


@pytest.mark.parametrize("mode", ["die", "hang", "die_in_full_load"])
def test_survivor_fails_within_timeout(mode, tmp_path):
    survivor, other = _start(mode, tmp_path)
    try:
        # Start-up (imports, rendezvous, one step) takes ~10 s here; the failure itself must take about TIMEOUT_S.
        log = survivor.communicate(timeout=120)[0]
    finally:
        other.kill()
        other.wait()
    result_file = tmp_path / f"survivor_{mode}.json"
    assert result_file.is_file(), f"the survivor recorded nothing; its output:\n{log[-4000:]}"
    record = json.loads(result_file.read_text())
    assert record["raised"] is not None, f"the survivor finished the step without its peer: {record}"
    assert record["elapsed_s"] < TIMEOUT_S + 15, record
    assert record["raised"] == "CollectiveFailure", record
    message = record["message"]
    # The message names the rank that failed (the other one), and the one reporting.
    assert message.startswith("A collective in ") and " failed on rank 1, " in message, message
    assert "(Reported by rank 0 of 2.)" in message and f"timeout=0:00:0{int(TIMEOUT_S)}" in message, message
    assert "HINT:" in message and "Backend error:" in message, message
