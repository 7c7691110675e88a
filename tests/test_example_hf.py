"""`examples/finetune_hf.py` run end to end as a user would (2 CPU processes): pretrained safetensors in, a
fine-tune, an export that `from_pretrained` reads back as exactly the fine-tuned weights."""

import subprocess
from pathlib import Path

import forkserver
from launch import script_env
from skips import require

require("transformers")  # a required test extra: where it is missing, this file fails, not skips

ROOT = Path(__file__).resolve().parents[1]


def test_finetune_hf_example(tmp_path):
    env = script_env()
    proc = subprocess.run([forkserver.python(), str(ROOT / "examples" / "finetune_hf.py"), "--out",
                           str(tmp_path / "run"), "--steps", "3"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=600)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]
    assert "loaded" in output and "into 2 shards" in output, output[-3000:]
    assert "step 2: loss" in output
    assert "gives the fine-tuned weights: True" in output, output[-3000:]
    assert (tmp_path / "run" / "export" / "model.safetensors").is_file()
