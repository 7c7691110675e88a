"""The README's first command, `bash examples/train.sh`, run end to end exactly as a user would (defaults: 2 CPU
processes), plus the full-checkpoint variant with fewer steps."""

import re
import subprocess
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _run(cwd: Path, *args: str) -> str:
    proc = subprocess.run(
        ["bash", str(ROOT / "examples" / "train.sh"), *args], cwd=cwd, capture_output=True, text=True, timeout=600
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]
    return output


def _val(output: str, label: str) -> float:
    match = re.search(rf"val loss {label}: ([0-9.]+)", output)
    assert match, f"no 'val loss {label}' line in:\n{output[-3000:]}"
    return float(match.group(1))


def test_readme_main_command_trains_saves_and_resumes(tmp_path):
    output = _run(tmp_path)  # relative default --out lands in tmp_path
    before = _val(output, "before training")
    after = _val(output, r"after \d+ steps")
    assert after < before - 0.5, f"loss did not go down enough: {before} -> {after}"
    assert "resumed from step 150" in output and "resumed run continued from step 150 to step 200" in output, output
    checkpoint = tmp_path / "checkpoints" / "gpt" / "step-000150"
    assert (checkpoint / ".metadata").is_file() and (checkpoint / "meta.pt").is_file()
    assert str(checkpoint) in output


def test_full_checkpoint_variant_loads_without_the_package(tmp_path):
    output = _run(tmp_path, "--steps", "20", "--resume-steps", "10", "--log-every", "10", "--state-dict-type", "full",
                  "--out", str(tmp_path / "ck"))
    assert "resumed from step 20" in output, output[-3000:]
    files = sorted((tmp_path / "ck").glob("*.pt"))
    assert [f.name for f in files] == ["step-000020.pt", "step-000030.pt"], files
    contents = torch.load(files[0], weights_only=True)
    weights = contents["model"]
    assert weights and all(isinstance(v, torch.Tensor) and type(v) is torch.Tensor for v in weights.values())
    assert not any("_forward_module" in k or "_checkpoint_wrapped" in k or "_orig_mod" in k for k in weights)
    assert isinstance(contents["optimizer"]["state"], dict) and contents["optimizer"]["param_groups"]


if __name__ == "__main__":  # pragma: no cover
    pytest.main([__file__])
