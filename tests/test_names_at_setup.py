"""Strategy arguments that name modules by dotted string are read against the model at setup, and import nothing at
construction (issue 21, E13): ``reshard_after_forward={"model.layers.0": True}`` in a script named ``model.py``
used to import ``model`` -- the script itself -- inside ``FSDPStrategy(...)``, running it a second time."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from torch import nn

import forkserver
from launch import LAUNCH_TIMEOUT_S, free_port, worker_env
from lightning_fsdp.engine.resharding import parse_reshard_after_forward
from lightning_fsdp.fabric import FSDPStrategy
from lightning_fsdp.trainer import FSDPStrategy as TrainerFSDPStrategy

SCRIPT = Path(__file__).parent / "fixtures" / "script_named_model" / "model.py"


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)


class Holder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Module()
        self.model.layers = nn.ModuleList(Layer() for _ in range(2))


def _choose(value, model: nn.Module) -> dict[str, object]:
    """The per-unit choices of ``value`` for ``model``, its ``Layer`` blocks and its root as units."""
    names = {id(m): n for n, m in model.named_modules()}
    units = {names[id(m)]: m for m in [model, *(m for m in model.modules() if isinstance(m, Layer))]}
    choices = parse_reshard_after_forward(value).choose(units, [model], None, module_names=names.values())
    return {name: choices[id(m)] for name, m in units.items()}


@pytest.mark.parametrize("front", [FSDPStrategy, TrainerFSDPStrategy], ids=["fabric", "trainer"])
def test_construction_imports_nothing(front, monkeypatch):
    """A module name with dots, a class path and a misspelled module: none is imported by the constructor."""
    import importlib

    imported: list[str] = []
    real_import = importlib.import_module
    monkeypatch.setattr(importlib, "import_module", lambda name, *args: imported.append(name) or real_import(name, *args))
    front(reshard_after_forward={"model.layers.0": False, "no_such_pkg_xyz.Block": 2, "root": True})
    assert imported == [], imported


def test_a_submodule_name_wins_over_a_module_of_the_same_dotted_name():
    # `json.decoder` is an importable module with a class `JSONDecoder`; here it is also a submodule path.
    model = nn.Module()
    model.json = nn.Module()
    model.json.decoder = Layer()
    model.other = Layer()
    assert _choose({"json.decoder": False}, model) == {"": None, "json.decoder": False, "other": None}


def test_class_keys_by_import_path_base_class_and_re_export():
    model = Holder()
    here = f"{__name__}.Layer"
    assert _choose({here: False}, model) == {"": None, "model.layers.0": False, "model.layers.1": False}
    assert _choose({"torch.nn.Module": 2}, model) == {"": 2, "model.layers.0": 2, "model.layers.1": 2}
    # the most specific key wins whatever the order
    assert _choose({"model.layers.1": True, here: False}, model) == {
        "": None, "model.layers.0": False, "model.layers.1": True}


def test_keys_that_match_nothing_or_name_no_class_fail_at_setup_with_the_units():
    model = Holder()
    with pytest.raises(TypeError, match=r"'math.pi' is 3.14.*not an nn.Module class.*HINT"):
        _choose({"math.pi": True}, model)
    with pytest.raises(ValueError, match=r"'model.layers.7' matches no FSDP unit.*'model.layers.0'"):
        _choose({"model.layers.7": True}, model)
    with pytest.raises(ValueError, match=r"'model' names a submodule that is not an FSDP unit"):
        _choose({"model": True}, model)


@pytest.mark.parametrize("front", ["fabric", "trainer"])
def test_a_script_named_model_py_runs_once_per_rank_and_the_key_reaches_its_submodule(front, tmp_path):
    log = tmp_path / "imports.log"
    out = tmp_path / "out"
    command = [forkserver.python(), "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
               f"--master_port={free_port()}", str(SCRIPT), front]
    proc = subprocess.run(command, env=worker_env(out, LFSDP_IMPORT_LOG=str(log)), capture_output=True, text=True,
                          timeout=LAUNCH_TIMEOUT_S)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    assert sorted(log.read_text().split("\n")[:-1]) == ["0 __main__", "1 __main__"], log.read_text()
    for rank in range(2):
        plan = json.loads((out / f"{front}.rank{rank}.json").read_text())
        assert plan == {"model.layers.0": "reshard", "model.layers.1": "keep", "model.layers.2": "keep"}, plan
