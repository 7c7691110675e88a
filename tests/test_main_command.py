"""The README's first command, `bash examples/train.sh`, run end to end exactly as a user would (defaults: 2 CPU
processes), plus the full-checkpoint variant of its script, `examples/train_gpt.py`, with fewer steps."""

import re
import subprocess
from pathlib import Path

import pytest
import torch

import forkserver
from launch import script_env

# The README command and its full-checkpoint variant side by side, two processes each: both cores stay busy
# (conftest.py runs such tests late).
pytestmark = pytest.mark.fills_both_cores

ROOT = Path(__file__).resolve().parents[1]


FULL_VARIANT = ["--steps", "20", "--resume-steps", "10", "--log-every", "10", "--state-dict-type", "full"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """The README command, its `--help` and the full-checkpoint variant, started side by side: each run leaves a core
    idle much of its time (start-up, the second process's start, saving, loading), so together they take little
    more than the longest alone. Each runs in a folder of its own, where the default relative ``--out`` lands."""
    started = {}
    # The README's command exactly: its script, the venv's own Python, real processes, the default arguments.
    folder = tmp_path_factory.mktemp("default")
    started["default"] = (folder, subprocess.Popen(["bash", str(ROOT / "examples" / "train.sh")], cwd=folder,
                                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    # The script passes its arguments on to examples/train_gpt.py (the README's `bash examples/train.sh --steps 300
    # --state-dict-type full`): `--help` shows that in one process that stops before any training.
    folder = tmp_path_factory.mktemp("help")
    started["help"] = (folder, subprocess.Popen(["bash", str(ROOT / "examples" / "train.sh"), "--help"], cwd=folder,
                                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    # The variant is about the full checkpoint, not the start-up, which the default run holds already: its processes
    # are forked from the suite's warm servers (tests/forkserver), which saves each the 4 to 5 s of a real start.
    folder = tmp_path_factory.mktemp("full")
    started["full"] = (folder, subprocess.Popen(
        [forkserver.python(), str(ROOT / "examples" / "train_gpt.py"), *FULL_VARIANT, "--out", str(folder / "ck")],
        cwd=folder, env=script_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    yield started
    for _, proc in started.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _finished(runs: dict, name: str) -> tuple[Path, str]:
    folder, proc = runs[name]
    output, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, output[-6000:]
    return folder, output


def _val(output: str, label: str) -> float:
    match = re.search(rf"val loss {label}: ([0-9.]+)", output)
    assert match, f"no 'val loss {label}' line in:\n{output[-3000:]}"
    return float(match.group(1))


def test_readme_main_command_trains_saves_and_resumes(runs):
    tmp_path, output = _finished(runs, "default")  # the relative default --out lands in its folder
    before = _val(output, "before training")
    after = _val(output, r"after \d+ steps")
    assert after < before - 0.5, f"loss did not go down enough: {before} -> {after}"
    assert "resumed from step 150" in output and "resumed run continued from step 150 to step 200" in output, output
    checkpoint = tmp_path / "checkpoints" / "gpt" / "step-000150"
    assert (checkpoint / ".metadata").is_file() and (checkpoint / "meta.pt").is_file()
    assert str(checkpoint) in output


def test_the_readme_command_passes_its_arguments_to_the_script(runs):
    _, output = _finished(runs, "help")
    assert "usage:" in output and "--state-dict-type" in output and "--resume-steps" in output, output[-3000:]


def test_full_checkpoint_variant_loads_without_the_package(runs):
    tmp_path, output = _finished(runs, "full")
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
