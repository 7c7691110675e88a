"""A dead or hung rank is not a hang: the surviving rank fails with an error, from the peer's death or from the
configured timeout, each told by the error itself rather than by a clock."""

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
# What ended the survivor's wait is in gloo's own error, which the CollectiveFailure carries: a dead peer closes the
# connection ("Connection reset by peer", "Connection closed by peer"), and a hung one (it sleeps until killed) is
# ended by the configured timeout ("Timed out waiting 5000ms"; gloo's default would be 1800000ms). No wall time is
# asserted: on a shared 2-core machine with twelve processes starting at once, a prompt failure can take any time.
# HANG_S only stops a survivor that waits on: far past the timeout and the start-up of all twelve processes, far
# below gloo's 30-minute default.
HANG_S = 180
DIED = ("Connection reset by peer", "Connection closed by peer")


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
            logs[mode] = survivor.communicate(timeout=HANG_S)[0]
        except subprocess.TimeoutExpired:
            survivor.kill()
            logs[mode] = f"the survivor still waited after {HANG_S} s (its timeout is {TIMEOUT_S} s): a hang\n"
            logs[mode] += survivor.communicate()[0]
        finally:
            other.kill()
            other.wait()
    return root, logs


@pytest.mark.parametrize("mode", list(MODES))
def test_survivor_fails_by_the_death_or_the_timeout(mode, survivors):
    root, logs = survivors
    result_file = root / mode / f"survivor_{mode}.json"
    assert result_file.is_file(), f"the survivor recorded nothing; its output:\n{logs[mode][-4000:]}"
    record = json.loads(result_file.read_text())
    assert record["raised"] is not None, f"the survivor finished the step without its peer: {record}"
    assert record["raised"] == "CollectiveFailure", record
    message = record["message"]
    # The message names the phase, the rank that failed (the other one), and the one reporting.
    assert message.startswith(f"A collective in {MODES[mode]}") and " failed on rank 1, " in message, message
    assert "(Reported by rank 0 of 2.)" in message and f"timeout=0:00:0{int(TIMEOUT_S)}" in message, message
    assert "HINT:" in message and "Backend error:" in message, message
    backend = message.split("Backend error:", 1)[1]
    if mode == "hang":  # ended by the configured timeout, not by gloo's default
        assert f"Timed out waiting {int(TIMEOUT_S * 1000)}ms" in backend, message
    else:  # ended by the peer's death, not by a timeout
        assert any(died in backend for died in DIED) and "Timed out" not in backend, message
