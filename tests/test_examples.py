"""The pattern examples in ``examples/patterns`` run end to end on 2 CPU processes, as the README says."""

import os
import signal
import subprocess
from pathlib import Path

import pytest

import forkserver
from launch import script_env

from lightning_fsdp._base.compat import WeightAveraging

EXAMPLES = Path(__file__).parent.parent / "examples" / "patterns"


@pytest.mark.parametrize(
    ("script", "expected"),
    [
        ("logging_metrics_generation.py", "step 5: probe loss"),
        ("ema_teacher.py", "saved student, teacher and optimizer"),
        pytest.param("trainer_weight_averaging.py", "validation loss of the averaged weights",
                     marks=pytest.mark.skipif(WeightAveraging is None, reason="WeightAveraging needs Lightning 2.6")),
    ],
)
def test_pattern_example_runs(script, expected, tmp_path):
    env = script_env()
    # Its own session: Fabric starts the second rank as a child, and a timeout must end both, not leave that rank
    # holding the output pipe open.
    proc = subprocess.Popen([forkserver.python(), str(EXAMPLES / script)], cwd=tmp_path, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
        raise AssertionError(f"{script} did not finish in 600 s:\n{log[-4000:]}") from None
    assert proc.returncode == 0, log[-4000:]
    assert expected in log, log[-4000:]
