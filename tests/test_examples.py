"""The pattern examples in ``examples/patterns`` run end to end on 2 CPU processes, as the README says."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).parent.parent / "examples" / "patterns"


@pytest.mark.parametrize(
    ("script", "expected"),
    [
        ("logging_metrics_generation.py", "step 5: probe loss"),
        ("ema_teacher.py", "saved student, teacher and optimizer"),
        ("trainer_weight_averaging.py", "validation loss of the averaged weights"),
    ],
)
def test_pattern_example_runs(script, expected, tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    assert expected in log, log[-4000:]
