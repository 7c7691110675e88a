"""The README's first command, `bash examples/train.sh`, run end to end exactly as a user would (defaults: 2 CPU
processes), plus the full-checkpoint variant of its script, `examples/train_gpt.py`, with fewer steps."""

import re
import subprocess
from pathlib import Path

import pytest
import torch

import forkserver
import launch
from launch import script_env

ROOT = Path(__file__).resolve().parents[1]


FULL_VARIANT = ["--steps", "20", "--resume-steps", "10", "--log-every", "10", "--state-dict-type", "full"]


@launch.start_early
def _start(root: Path) -> dict:
    """The README command, its `--help` and the full-checkpoint variant, started side by side in the background ahead of
    the tests (``launch.start_early``: with the first test after the single_process group), each in a folder of its own, where the default relative ``--out`` lands,
    its output in ``output.txt`` there. They wait more than they compute: on the 2-core reference machine
    (2026-11-29) the README command alone took 31 s of wall time for 23 s of CPU (two real processes starting, then
    waiting on each other's collectives), and the three side by side in the foreground cost the suite 39 s with a core
    idle half the time. In the background, beside the other tests' launches, their waits overlap those tests' work,
    and the tests here read what they left."""
    started = {}

    def run(name: str, command: list[str], **kwargs) -> None:
        folder = root / name
        folder.mkdir()
        with open(folder / "output.txt", "w") as output:  # a file, not a pipe that nobody reads until the test runs
            proc = launch.popen_in_background(command, cwd=folder, stdout=output, stderr=subprocess.STDOUT, text=True,
                                              **kwargs)
        started[name] = (folder, proc)

    # The README's command exactly: its script, the venv's own Python, real processes, the default arguments.
    run("default", ["bash", str(ROOT / "examples" / "train.sh")])
    # The script passes its arguments on to examples/train_gpt.py (the README's `bash examples/train.sh --steps 300
    # --state-dict-type full`): `--help` shows that in one process that stops before any training.
    run("help", ["bash", str(ROOT / "examples" / "train.sh"), "--help"])
    # The variant is about the full checkpoint, not the start-up, which the default run holds already: its processes
    # are forked from the suite's warm servers (tests/forkserver), which saves each the 4 to 5 s of a real start.
    full = root / "full"
    run("full", [forkserver.python(), str(ROOT / "examples" / "train_gpt.py"), *FULL_VARIANT, "--out", str(full / "ck")],
        env=script_env())
    return started


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """The runs started ahead of the tests, or now where nothing started them."""
    started = launch.early(__name__) or _start(tmp_path_factory.mktemp("readme"))
    yield started
    launch.stop_background([proc for _, proc in started.values()])


def _finished(runs: dict, name: str) -> tuple[Path, str]:
    folder, proc = runs[name]
    proc.wait(timeout=600)
    output = (folder / "output.txt").read_text()
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
