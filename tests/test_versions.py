"""The torch and Lightning releases users have (issue 19, part 3). Two-rank cases in ``workers/versions.py``; the
rest here runs in one process. CI runs this file in each venv of `.ci/run` (pinned, newest torch, oldest Lightning).
"""

from __future__ import annotations

import ast
import json
import pickle
import subprocess
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorProperties

import forkserver
import lightning_fsdp
from launch import case_tests, script_env
from lightning_fsdp import cli
from lightning_fsdp.checkpoint.integrity.safe_pickle import load_dcp_metadata
from lightning_fsdp.checkpoint.io.readers import UsageError, open_checkpoint

CASES = [
    "joint_setup_trains_and_the_unpickling_opt_in_works_as_named",
    "a_torch_2_15_checkpoint_loads_or_names_the_torch_it_needs_on_every_rank",
]
results, test_case = case_tests("versions.py", 2, CASES)

SRC = Path(lightning_fsdp.__file__).parent  # the package under test, wherever PYTHONPATH puts it
FIXTURE = Path(__file__).parent / "fixtures" / "torch215_sharded"  # see fixtures/make_torch215_sharded.py
TORCH = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])


@pytest.mark.single_process
def test_inspect_reads_or_explains_a_checkpoint_written_by_torch_2_15(capsys):
    status = cli.main(["inspect", str(FIXTURE), "--json"])
    out, err = capsys.readouterr()
    if TORCH >= (2, 15):  # the newest-torch CI venv: torch 2.15 reads its own format
        assert status == 0, err
        assert json.loads(out)["format"] == "sharded"
        return
    assert status == 2, (out, err)
    for part in ("written by torch 2.15 or newer", f"torch {torch.__version__}, installed here", "torch>=2.15",
                 "lightning-fsdp convert"):
        assert part in err, f"{part!r} not in: {err}"
    assert "corrupted" not in err, err  # what it said before: "may be truncated or corrupted"


def _newer_format_checkpoint(path: Path, monkeypatch) -> Path:
    """A real DCP checkpoint whose ``.metadata`` holds ``TensorProperties`` states one field longer than this torch
    writes: what the next torch that adds a field (as 2.15 added ``strides``) would write."""
    dcp.save({"model": {"w": torch.ones(2, 3)}}, checkpoint_id=path, no_dist=True)
    metadata = load_dcp_metadata(path / ".metadata")
    own = TensorProperties.__getstate__
    with monkeypatch.context() as patch:
        patch.setattr(TensorProperties, "__getstate__", lambda self: (*own(self), None))
        (path / ".metadata").write_bytes(pickle.dumps(metadata))
    return path


@pytest.mark.single_process
def test_a_newer_tensor_metadata_names_the_recorded_writer_and_the_needed_torch(tmp_path, monkeypatch):
    from lightning_fsdp.checkpoint.formats.torch_versions import NewerTorchFormatError

    path = _newer_format_checkpoint(tmp_path / "ckpt", monkeypatch)
    # The control: this torch itself fails on the file, with the bare message the issue quotes.
    with pytest.raises(ValueError, match="too many values to unpack"):
        pickle.loads((path / ".metadata").read_bytes())
    # Without a record of the writer: inferred from the format, on both unpickling paths.
    for allow_pickle in (False, True):
        with pytest.raises(NewerTorchFormatError) as caught:
            load_dcp_metadata(path / ".metadata", allow_pickle=allow_pickle)
        assert f"torch {torch.__version__}, installed here, cannot read its format" in str(caught.value)
        assert str(path) in str(caught.value)
    # With the version this package records beside every sharded save: named exactly.
    manifest = {"format": 1, "torch": "9.1.0+cpu", "save_id": "other", "items": []}  # the keys every manifest has
    (path / "checksums.json").write_text(json.dumps(manifest))
    with pytest.raises(UsageError, match=r"was written by torch 9\.1\.0\+cpu, and torch .* cannot read"):
        open_checkpoint(path)


@pytest.mark.single_process
def test_an_older_torch_format_still_reads(tmp_path):
    # The check must not refuse what this torch reads: its own files (and, under torch 2.15, 2.13's 5-field states).
    dcp.save({"model": {"w": torch.ones(2, 3)}}, checkpoint_id=tmp_path, no_dist=True)
    metadata = load_dcp_metadata(tmp_path / ".metadata")
    assert tuple(metadata.state_dict_metadata["model.w"].size) == (2, 3)


def _private_imports(tree: ast.AST) -> list[str]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in ("torch", "lightning"):
            private_module = any(part.startswith("_") for part in node.module.split("."))
            names = [alias.name for alias in node.names if alias.name.startswith("_") or private_module]
            found += [f"{node.module}.{name}" for name in names]
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            root = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name) and root.id in ("torch", "lightning"):
                found.append(ast.unparse(node))
    return found


COMPAT = SRC / "_base" / "compat.py"  # the one module that may name torch's and Lightning's private names


@pytest.mark.single_process
def test_every_private_torch_and_lightning_name_is_in_compat():
    offenders = {}
    for file in sorted(SRC.rglob("*.py")):
        if file == COMPAT:
            continue
        names = _private_imports(ast.parse(file.read_text()))
        if names:
            offenders[str(file.relative_to(SRC))] = names
    assert not offenders, f"private torch/Lightning names outside _base/compat.py: {offenders}"
    assert _private_imports(ast.parse(COMPAT.read_text())), "the scan finds nothing even in _base/compat.py"


@pytest.mark.single_process
def test_the_package_imports_and_trains_nothing_averaged_without_weight_averaging():
    # Lightning 2.5 has no `WeightAveraging`; Fabric-only users and the Trainer front must still import. Here the
    # installed Lightning's callback is hidden before the package is imported (the oldest-Lightning CI venv runs
    # the same check on the real 2.5).
    script = (
        "import lightning.pytorch.callbacks as callbacks\n"
        "if hasattr(callbacks, 'WeightAveraging'):\n"
        "    del callbacks.WeightAveraging\n"
        "import lightning_fsdp, lightning_fsdp.trainer, lightning_fsdp.fabric\n"
        "from lightning.pytorch import Trainer\n"
        "from lightning.pytorch.callbacks import Callback\n"
        "from lightning_fsdp import averaging\n"
        "trainer = Trainer(callbacks=[Callback()], logger=False, enable_checkpointing=False,"
        " enable_progress_bar=False, enable_model_summary=False)\n"
        "assert averaging.averaged_modules(trainer) == []\n"
        "print('ok')\n"
    )
    # Forked from a warm server, which has imported Lightning (as the script's first line does) but not this package.
    proc = subprocess.run([forkserver.python(), "-c", script], env=script_env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-2000:]
