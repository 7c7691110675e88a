"""Small contracts of the command line: ``inspect --verify`` has one exit status for any failed verification, and
``plan --help`` documents every option with its allowed values; ``plan``'s bad-input lines carry one hint, in the
command line's own terms."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import forkserver
from launch import script_env

from lightning_fsdp.cli import _parser, main
from lightning_fsdp.engine.config import ShardingStrategy
from lightning_fsdp.engine.precision import SUPPORTED_PRECISION

SAVE = """
import sys, torch
from lightning.fabric import Fabric
from lightning_fsdp.fabric import FSDPStrategy
fabric = Fabric(accelerator="cpu", devices=1, strategy=FSDPStrategy())
fabric.launch()
model = fabric.setup(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)))
fabric.save(sys.argv[1], {"model": model, "step": 3})
"""

MODEL = """
import torch
def build():
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
def batch():
    return torch.randn(4, 8)
"""


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> Path:
    where = tmp_path_factory.mktemp("verify")
    (where / "save.py").write_text(SAVE)
    env = script_env()
    proc = subprocess.run([forkserver.python(), str(where / "save.py"), str(where / "ckpt")], cwd=where, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return where / "ckpt"


def _flip_copy(src: Path, dst: Path, name: str) -> Path:
    subprocess.run(["cp", "-r", str(src), str(dst)], check=True)
    data = bytearray((dst / name).read_bytes())
    data[len(data) - 30] ^= 1
    (dst / name).write_bytes(bytes(data))
    return dst


@pytest.mark.parametrize("damaged", ["__0_0.distcp", "meta.pt", ".metadata"])
def test_inspect_verify_exits_1_for_any_file_that_fails_its_checksum(sharded, tmp_path, capsys, damaged):
    assert main(["inspect", "--verify", str(sharded)]) == 0, capsys.readouterr()
    capsys.readouterr()
    bad = _flip_copy(sharded, tmp_path / "bad", damaged)
    status = main(["inspect", "--verify", str(bad)])
    err = capsys.readouterr().err
    assert status == 1, (status, err)
    assert len(err.strip().splitlines()) == 1 and str(bad / damaged) in err and "HINT:" in err, err


def test_inspect_verify_exits_1_for_a_full_file_cut_short_and_a_missing_shard(sharded, tmp_path, capsys):
    # Both are files that fail verification, so status 1 with the damage hint; before, a cut-short full file was
    # "not a checkpoint" (status 2) and a missing shard got `convert`'s hint about DST (status 1).
    import torch

    full = tmp_path / "full.pt"
    torch.save({"model": torch.nn.Linear(64, 64).state_dict(), "step": 3}, full)
    assert main(["inspect", "--verify", str(full)]) == 0, capsys.readouterr()
    cut = tmp_path / "cut.pt"
    cut.write_bytes(full.read_bytes()[: full.stat().st_size // 2])
    missing = tmp_path / "missing"
    subprocess.run(["cp", "-r", str(sharded), str(missing)], check=True)
    (missing / "__0_0.distcp").unlink()
    for path, named in ((cut, cut), (missing, missing / "__0_0.distcp")):
        capsys.readouterr()
        status = main(["inspect", "--verify", str(path)])
        err = capsys.readouterr().err
        assert status == 1, (path, status, err)
        assert len(err.strip().splitlines()) == 1 and repr(str(named)) in err, err
        assert "HINT: the checkpoint is damaged" in err and "DST" not in err, err
    # Without --verify a cut-short file is still input the user can fix (status 2), and so is a zip that torch.save
    # did not write, with --verify or not.
    assert main(["inspect", str(cut)]) == 2
    other = tmp_path / "other.zip"
    import zipfile

    with zipfile.ZipFile(other, "w") as archive:
        archive.writestr("notes.txt", "not a checkpoint")
    assert main(["inspect", "--verify", str(other)]) == 2


# What each value-taking option's help must show: its allowed values, or its form by an example. An option missing
# here fails the test, so a new option must say what it takes; "see the docs" names neither.
_PLAN_FORMS = {
    "--model": ["mypkg.models:build", "path/to/file.py:build"],
    "--inputs": ["a tensor", "a tuple", "a dict"],
    "--world-size": ["an integer >= 1"],
    "--num-nodes": ["an integer >= 1"],
    "--sharding-strategy": [strategy.value for strategy in ShardingStrategy],
    "--auto-wrap-policy": ["module classes", "'auto'"],
    "--activation-checkpointing-policy": ["module classes", "JSON", "'blocks'", "'every'", "'save_ops'"],
    "--reshard-after-forward": ["reshard", "keep", "INT", "JSON"],
    "--forward-prefetch": ["an integer >= 0"],
    "--backward-prefetch": ["an integer >= 0"],
    "--precision": list(SUPPORTED_PRECISION),
    "--device-mesh": ["e.g. 2,4"],
    "--tensor-parallel-size": ["a divisor of --world-size"],
    "--tensor-parallel-plan": ["'auto'", "JSON", "e.g.", "mypkg.plans:PLAN"],
    "--optimizer": ["adamw", "adam", "sgd"],
    "--accumulate-grad-batches": ["an integer >= 1"],
    "--memory-budget": ["80GB", "70GiB", "bytes"],
}


def test_plan_help_documents_every_option_and_its_allowed_values():
    sub = next(a for a in _parser()._actions if a.dest == "command").choices["plan"]
    options = {a.option_strings[-1]: a for a in sub._actions if a.option_strings}
    takes_value = {name for name, action in options.items() if action.nargs != 0}
    assert takes_value == set(_PLAN_FORMS), sorted(takes_value ^ set(_PLAN_FORMS))
    for name, action in options.items():
        text = action.help or ""
        assert len(text.split()) >= 4, (name, text)  # even a flag says what it does
        missing = [needle for needle in _PLAN_FORMS.get(name, []) + list(action.choices or []) if needle not in text]
        assert not missing, f"{name}'s help {text!r} does not show {missing}"


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--precision", "fp8"], "`--precision 'bf16-mixed'`"),
        (["--memory-budget", "lots"], "Invalid size 'lots'"),
        (["--world-size", "0"], "--world-size"),
        (["--device-mesh", "2by1"], "REPLICATE,SHARD"),
        (["--reshard-after-forward", "maybe"], "'maybe'"),
        (["--sharding-strategy", "FULL"], "`--sharding-strategy 'FULL'`"),
        (["--optimizer", "sgx"], "'sgx'"),
    ],
)
def test_plan_bad_input_is_one_sentence_with_one_hint_in_the_options_terms(tmp_path, monkeypatch, capsys, args,
                                                                           needle):
    (tmp_path / "cli_contract_model.py").write_text(MODEL)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "cli_contract_model", raising=False)  # `plan` registers the file under its stem
    argv = ["plan", "--model", "cli_contract_model.py:build", "--inputs", "cli_contract_model.py:batch",
            "--world-size", "2"]
    status = main(argv + args)
    err = capsys.readouterr().err
    assert status == 2 and len(err.strip().splitlines()) == 1, (status, err)
    assert needle in err and err.count("HINT:") == 1, err
    assert ".." not in err.replace("...", ""), err
    assert "Fabric(" not in err and "Trainer(" not in err, err
