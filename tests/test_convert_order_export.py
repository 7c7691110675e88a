"""Issue 45 items 6 and 7: ``lightning-fsdp convert`` keeps the source's commit order on every store, and a
safetensors export to a URL replaces the previous one without ever leaving a mix (``checkpoint/convert.py``'s
docstring). In this process (``run_cli``), against the suite's S3 server (``tests/s3server.py``) and local folders.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load as load_safetensors

from inprocess import run_cli

pytestmark = pytest.mark.single_process

STEPS = (100, 200, 110)  # saved in this order: 200 was abandoned by a rollback to 100, then 110 was saved


@pytest.fixture()
def s3(s3_server, monkeypatch):
    s3_server.setenv(monkeypatch)
    return s3_server


def _rolled_back_run(root):
    """save 100, save 200, load 100, save 110: full checkpoints as the strategy writes them (each records its order)."""
    from lightning_fsdp.checkpoint.io.full_writer import write_full_checkpoint

    root.mkdir()
    for step in STEPS:
        write_full_checkpoint(root / f"step-{step}", {"model": {"w": torch.full((8,), float(step))}, "step": step},
                              is_writer=True)
    return root


def _convert(src, dst, to, *extra):
    run = run_cli(["convert", str(src), str(dst), "--to", to, *extra])
    assert run.returncode == 0, run.stderr
    return dst


def _names(paths):
    return [str(p).rstrip("/").rsplit("/", 1)[-1] for p in paths]


def test_convert_keeps_the_commit_order_so_latest_stays_after_a_rollback(tmp_path, s3):
    """Old code: every converted copy recorded a new order, so converting the abandoned 200 made it `latest`."""
    from lightning_fsdp.checkpoint.convert import convert
    from lightning_fsdp.checkpoint.latest import commit_order_of, newest_good_checkpoint, step_checkpoints

    run = _rolled_back_run(tmp_path / "run")
    order = {step: commit_order_of(run / f"step-{step}") for step in STEPS}
    assert order[100] < order[200] < order[110]

    # Into the run's own folder, under a name that ends in the step: 110 stays the newest.
    _convert(run / "step-200", run / "sharded-200", "sharded")
    assert commit_order_of(run / "sharded-200") == order[200]
    assert newest_good_checkpoint(run) == run / "step-110"

    # Copies in another folder (sharded, then full from those) and in a bucket, written newest first: each keeps its
    # source's order exactly, so each place's newest is 110 still.
    bucket = f"s3://{s3.bucket()}"
    for step in reversed(STEPS):
        _convert(run / f"step-{step}", tmp_path / "sharded" / f"step-{step}", "sharded")
        _convert(tmp_path / "sharded" / f"step-{step}", tmp_path / "full" / f"step-{step}.pt", "full")
        _convert(run / f"step-{step}", f"{bucket}/run/step-{step}", "sharded")
    for where, suffix in ((tmp_path / "sharded", ""), (tmp_path / "full", ".pt"), (f"{bucket}/run", "")):
        listed = step_checkpoints(where)
        assert _names(listed) == [f"step-{s}{suffix}" for s in STEPS], where
        assert [commit_order_of(p) for p in listed] == [order[s] for s in STEPS], where
        assert _names([newest_good_checkpoint(where)]) == [f"step-110{suffix}"], where

    # From a bucket: the COMMIT's order, not the one the objects inside it record (a remote save's manifest is
    # written before its COMMIT draws its own); to a bucket (a full file), to a folder, and through the Python API.
    _convert(f"{bucket}/run/step-200", f"{bucket}/full/step-200.pt", "full")
    assert commit_order_of(f"{bucket}/full/step-200.pt") == order[200]
    _convert(f"{bucket}/full/step-200.pt", tmp_path / "back" / "step-200", "sharded")
    assert commit_order_of(tmp_path / "back" / "step-200") == order[200]
    convert(f"{bucket}/run/step-110", tmp_path / "back" / "step-110.pt", to="full")
    assert commit_order_of(tmp_path / "back" / "step-110.pt") == order[110]


def test_a_source_without_an_order_gives_a_copy_without_one(tmp_path, s3):
    """Old code: a plain torch.save file (no order: it sorts by step, first) became the newest checkpoint."""
    from lightning_fsdp.checkpoint.latest import commit_order_of, newest_good_checkpoint

    run = _rolled_back_run(tmp_path / "run")
    torch.save({"model": {"w": torch.zeros(8)}}, tmp_path / "plain-500.pt")
    _convert(tmp_path / "plain-500.pt", run / "step-500", "sharded")
    url = _convert(tmp_path / "plain-500.pt", f"s3://{s3.bucket()}/run/step-500", "sharded")
    assert commit_order_of(run / "step-500") is None and commit_order_of(url) is None
    assert newest_good_checkpoint(run) == run / "step-110"


class Four(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(4, 4, bias=False) for _ in range(4))


def _weights(value: float) -> dict[str, torch.Tensor]:
    return {f"layers.{i}.weight": torch.full((4, 4), value + i) for i in range(4)}  # 64 bytes each


def _export(tmp_path, value, url, *extra):
    source = tmp_path / f"weights-{value}.pt"
    torch.save(_weights(value), source)
    return _convert(source, url, "safetensors", "--overwrite", *extra)


def _check_only_the_new_export(fs, prefix, value, foreign, *, ours: bool):
    """Every object under ``prefix`` is the export's entry point, a file our reader chooses (those the index names,
    or ``model.safetensors``), or a foreign file; those files hold the new weights exactly, and (``ours``: it costs a
    second) our ``load_pretrained`` reads them."""
    from lightning_fsdp import load_pretrained
    from lightning_fsdp.checkpoint.hf import safetensors_files

    files = safetensors_files(f"s3://{prefix}")
    entry = "model.safetensors" if _names(files) == ["model.safetensors"] else "model.safetensors.index.json"
    assert set(_names(fs.find(prefix))) == {entry, *_names(files)} | foreign
    read = {}
    for file in files:
        read.update(load_safetensors(fs.cat_file(file)))
    expected = _weights(value)
    assert read.keys() == expected.keys() and all(torch.equal(read[k], expected[k]) for k in expected)
    if ours:
        load_pretrained(model := Four(), f"s3://{prefix}")
        assert all(torch.equal(model.state_dict()[k], expected[k]) for k in expected)


def test_an_export_to_a_url_replaces_the_previous_one_whole_and_leaves_foreign_files(tmp_path, s3):
    """Old code: re-exporting with fewer shards left the old ones; a one-file export over a sharded one left the old
    index, through which our reader loaded the old weights; a sharded one over a one-file one left model.safetensors,
    which transformers reads first."""
    fs = s3.filesystem()
    prefix = f"{s3.bucket()}/hf"
    url = f"s3://{prefix}"
    foreign = {"config.json", "tokenizer.json"}
    for name in foreign:  # a user's files beside the weights, as `save_pretrained` leaves them
        fs.pipe_file(f"{prefix}/{name}", b"mine: " + name.encode())
    # 4 shards, then 2, then one file, then 4 shards again, each with other weights. Our load_pretrained is run where
    # the old code made it read the previous weights (through the index a one-file export left).
    for value, extra in ((1.0, ["--max-shard-size", "64B"]), (2.0, ["--max-shard-size", "128B"]), (3.0, []),
                         (4.0, ["--max-shard-size", "64B"])):
        _export(tmp_path, value, url, *extra)
        _check_only_the_new_export(fs, prefix, value, foreign, ours=value == 3.0)
    for name in foreign:  # byte for byte as the user left them
        assert fs.cat_file(f"{prefix}/{name}") == b"mine: " + name.encode()

    # The Python API writes the same plain folder (old code: a COMMIT layout that no Hugging Face reader reads).
    from lightning_fsdp.checkpoint.convert import convert

    convert(tmp_path / "weights-2.0.pt", f"s3://{prefix}-api", to="safetensors")
    assert _names(s3.filesystem().find(f"{prefix}-api")) == ["model.safetensors"]
