"""The ``lightning-fsdp`` command: inspect, convert between full and sharded, export safetensors, one-line errors,
and conversions that stream (peak memory far below the model's size).

Real checkpoints come from the strategy itself (``workers/make_checkpoints.py``, 2 ranks, saved once sharded and
once full from the same trained model and optimizer); the memory bound is measured in a child process
(``workers/convert_memory.py``), started first because it takes longest.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from launch import WORKERS, pooled
from lightning_fsdp.checkpoint.convert import convert
from lightning_fsdp.cli import main

# The README's claim, "near the largest tensor or shard", as a number: a conversion's extra peak stays under
# TENSORS_BOUND largest tensors plus one output shard. Measured here (4 MiB tensors, 20 MB shards): to full 10-11 MB
# (2.6 tensors), to sharded 6 MB (1.5). Safetensors output streams a tensor at a time, so the one-file exports
# (no shard term) must stay under TENSORS_BOUND tensors too: 0.08x of the 201 MB model, where holding every weight
# (the writer before streaming) took 1.0x.
TENSORS_BOUND = 4


# ------------------------------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module", autouse=True)
def memory_run(tmp_path_factory):
    """Start the memory measurement at once: it writes and converts 200 MB, and runs while the other tests do."""
    out = tmp_path_factory.mktemp("convert_memory")
    proc = subprocess.Popen([sys.executable, str(WORKERS / "convert_memory.py"), str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    yield proc, out
    if proc.poll() is None:  # the memory test was deselected or failed early: stop the run and its child
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
    shutil.rmtree(out, ignore_errors=True)  # 1.2 GB; pytest keeps old temp directories around


made = pooled("make_checkpoints.py", 2, name="made")  # its cases run in the 2-rank pool's launch


@pytest.fixture(scope="module")
def strategy(made):
    made.check("save_sharded_and_full_checkpoints")
    return made


@pytest.fixture(scope="module")
def ckpt(strategy) -> Path:
    return strategy.out / "ckpt"


def cli(capsys, *args) -> tuple[int, str, str]:
    status = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return status, out, err


def load(path: Path):
    return torch.load(path, map_location="cpu", weights_only=True)


def assert_same(actual, expected, where="checkpoint"):
    """Equal values, types, key order and dtypes, all the way down."""
    assert type(actual) is type(expected), f"{where}: {type(actual).__name__} != {type(expected).__name__}"
    if isinstance(expected, dict):
        assert list(actual) == list(expected), f"{where}: keys {list(actual)} != {list(expected)}"
        for key in expected:
            assert_same(actual[key], expected[key], f"{where}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), f"{where}: length {len(actual)} != {len(expected)}"
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_same(a, e, f"{where}[{i}]")
    elif isinstance(expected, torch.Tensor):
        assert actual.dtype == expected.dtype and torch.equal(actual, expected), f"{where}: tensors differ"
    else:
        assert actual == expected, f"{where}: {actual!r} != {expected!r}"


def by_name(tensors: dict) -> dict:
    """safetensors stores tensors in an order of its own: compare by name."""
    return dict(sorted(tensors.items()))


def flat_tensors(contents: dict) -> list[tuple[str, list[int], str]]:
    """(name, shape, dtype) of a full file's model and optimizer tensors, named the way DCP names them."""
    rows = [(f"model.{k}", v) for k, v in contents["model"].items()]
    rows += [(f"optimizer.state.{p}.{k}", v) for p, s in contents["optimizer"]["state"].items() for k, v in s.items()]
    return [(name, list(t.shape), str(t.dtype).removeprefix("torch.")) for name, t in rows]


# --------------------------------------------------------------------------------------------- conversions


def test_sharded_to_full_matches_the_strategys_full_checkpoint(ckpt, tmp_path, capsys):
    status, out, err = cli(capsys, "convert", ckpt / "sharded", tmp_path / "full.pt", "--to", "full")
    assert status == 0, err
    assert out.strip() == f"wrote {tmp_path / 'full.pt'} (full)" and err == ""
    # Optimizer state keyed by parameter name, param_groups with name lists, meta.pt entries at the top level.
    assert_same(load(tmp_path / "full.pt"), load(ckpt / "full.pt"))
    assert [p.name for p in tmp_path.iterdir()] == ["full.pt"]  # no staging left behind


def test_full_to_sharded_to_full_round_trip(ckpt, tmp_path, capsys):
    assert cli(capsys, "convert", ckpt / "full.pt", tmp_path / "sharded", "--to", "sharded")[0] == 0
    assert sorted(p.name for p in (tmp_path / "sharded").iterdir()) == [".metadata", "__0_0.distcp", "checksums.json", "meta.pt"]
    assert load(tmp_path / "sharded" / "meta.pt") == {"step": 3, "note": {"run": "cli-test", "lr": 0.01}}
    assert cli(capsys, "convert", tmp_path / "sharded", tmp_path / "again.pt", "--to", "full")[0] == 0
    assert_same(load(tmp_path / "again.pt"), load(ckpt / "full.pt"))


def test_converted_checkpoints_load_into_the_strategy(strategy):
    strategy.check("converted_checkpoints_load_back_exactly")


def test_safetensors_single_file_and_directory(ckpt, tmp_path, capsys):
    weights = load(ckpt / "full.pt")["model"]
    assert cli(capsys, "convert", ckpt / "sharded", tmp_path / "model.safetensors", "--to", "safetensors")[0] == 0
    assert cli(capsys, "convert", ckpt / "full.pt", tmp_path / "hf", "--to", "safetensors")[0] == 0
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["model.safetensors"]
    for file in (tmp_path / "model.safetensors", tmp_path / "hf" / "model.safetensors"):
        assert_same(by_name(load_file(file)), by_name(weights), str(file))  # unprefixed names
        with safe_open(file, "pt") as handle:
            assert handle.metadata() == {"format": "pt"}  # transformers refuses files without it
        umask = os.umask(0)
        os.umask(umask)
        assert stat.S_IMODE(file.stat().st_mode) == 0o666 & ~umask


def test_safetensors_shards_and_index(ckpt, tmp_path, capsys):
    weights = load(ckpt / "full.pt")["model"]
    status, _, err = cli(capsys, "convert", ckpt / "sharded", tmp_path / "hf", "--to", "safetensors",
                         "--max-shard-size", "8KB")
    assert status == 0, err
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert index["metadata"] == {"total_size": sum(t.nbytes for t in weights.values())}
    assert list(index["weight_map"]) == list(weights)
    files = sorted(set(index["weight_map"].values()))
    count = len(files)
    assert count >= 3 and files == [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == sorted([*files, "model.safetensors.index.json"])
    loaded = {}
    for file in files:
        shard = load_file(tmp_path / "hf" / file)
        assert sorted(shard) == sorted(k for k, f in index["weight_map"].items() if f == file)
        assert len(shard) == 1 or sum(t.nbytes for t in shard.values()) <= 8000, f"{file} is over 8KB"
        loaded.update(shard)
    assert_same(by_name(loaded), by_name(weights))


def test_safetensors_with_several_models_prefixes_names_or_exports_one(tmp_path, capsys):
    model, ema = {"fc.weight": torch.randn(3, 2)}, {"fc.weight": torch.randn(3, 2)}
    torch.save({"model": model, "ema": ema, "optimizer": {"state": {}, "param_groups": []}, "step": 1},
               tmp_path / "two.pt")
    assert cli(capsys, "convert", tmp_path / "two.pt", tmp_path / "both.safetensors", "--to", "safetensors")[0] == 0
    assert_same(by_name(load_file(tmp_path / "both.safetensors")),
                by_name({"model.fc.weight": model["fc.weight"], "ema.fc.weight": ema["fc.weight"]}))
    assert cli(capsys, "convert", tmp_path / "two.pt", tmp_path / "ema.safetensors", "--to", "safetensors",
               "--model", "ema")[0] == 0
    assert_same(by_name(load_file(tmp_path / "ema.safetensors")), by_name(ema))
    status, _, err = cli(capsys, "convert", tmp_path / "two.pt", tmp_path / "x.safetensors", "--to", "safetensors",
                         "--model", "student")
    assert status == 2 and "Allowed: model, ema" in err and not (tmp_path / "x.safetensors").exists()


def test_strip_prefix_detected_for_trainer_checkpoints_and_explicit_otherwise(tmp_path, capsys):
    weights = {"model.model.embed.weight": torch.randn(4, 2), "model.lm_head.weight": torch.randn(3, 2)}
    hf_names = {"model.embed.weight": weights["model.model.embed.weight"], "lm_head.weight": weights["model.lm_head.weight"]}
    trainer = {"state_dict": weights, "pytorch-lightning_version": "2.6.6", "global_step": 2}
    torch.save(trainer, tmp_path / "trainer.ckpt")
    # A Trainer checkpoint whose LightningModule holds every weight in `self.model`: detected and said.
    status, out, _ = cli(capsys, "convert", tmp_path / "trainer.ckpt", tmp_path / "auto", "--to", "safetensors")
    assert status == 0 and "stripped 'model.' from 2 names" in out, out
    assert_same(by_name(load_file(tmp_path / "auto" / "model.safetensors")), by_name(hf_names))
    # Kept on request.
    status, out, _ = cli(capsys, "convert", tmp_path / "trainer.ckpt", tmp_path / "kept.safetensors", "--to",
                         "safetensors", "--strip-prefix", "")
    assert status == 0 and "names kept as saved" in out
    assert_same(by_name(load_file(tmp_path / "kept.safetensors")), by_name(weights))
    # Not a Trainer checkpoint (no `pytorch-lightning_version`): nothing is guessed, but an explicit prefix works.
    torch.save({"model": weights}, tmp_path / "fabric.pt")
    status, out, _ = cli(capsys, "convert", tmp_path / "fabric.pt", tmp_path / "f1.safetensors", "--to", "safetensors")
    assert status == 0 and "no prefix to strip detected" in out
    assert_same(by_name(load_file(tmp_path / "f1.safetensors")), by_name(weights))
    status, out, _ = cli(capsys, "convert", tmp_path / "fabric.pt", tmp_path / "f2.safetensors", "--to", "safetensors",
                         "--strip-prefix", "model.")
    assert status == 0 and "stripped 'model.' from 2 names (as asked)" in out
    assert_same(by_name(load_file(tmp_path / "f2.safetensors")), by_name(hf_names))
    # A prefix that not every name has is refused, naming the weight; so is a prefix with several models.
    status, _, err = cli(capsys, "convert", tmp_path / "fabric.pt", tmp_path / "x.safetensors", "--to", "safetensors",
                         "--strip-prefix", "model.model.")
    assert status == 2 and "'model.lm_head.weight' does not start with it" in err and "HINT" in err
    torch.save({"model": weights, "ema": weights}, tmp_path / "two.pt")
    status, _, err = cli(capsys, "convert", tmp_path / "two.pt", tmp_path / "x.safetensors", "--to", "safetensors",
                         "--strip-prefix", "model.")
    assert status == 2 and "--model model" in err
    status, _, err = cli(capsys, "convert", tmp_path / "fabric.pt", tmp_path / "x.pt", "--to", "full",
                         "--strip-prefix", "model.")
    assert status == 2 and "`--strip-prefix` applies to `--to safetensors` only" in err
    assert not (tmp_path / "x.safetensors").exists() and not (tmp_path / "x.pt").exists()


def test_a_bare_state_dict_file_converts_as_one_model(tmp_path, capsys):
    weights = {"fc.weight": torch.randn(4, 4), "fc.bias": torch.randn(4)}
    torch.save(weights, tmp_path / "bare.pt")
    assert cli(capsys, "convert", tmp_path / "bare.pt", tmp_path / "w.safetensors", "--to", "safetensors")[0] == 0
    assert_same(by_name(load_file(tmp_path / "w.safetensors")), by_name(weights))
    assert cli(capsys, "convert", tmp_path / "bare.pt", tmp_path / "sharded", "--to", "sharded")[0] == 0
    assert cli(capsys, "convert", tmp_path / "sharded", tmp_path / "full.pt", "--to", "full")[0] == 0
    assert_same(load(tmp_path / "full.pt"), {"model": weights})  # the key our loader reads


def test_optimizer_state_keyed_by_parameter_ids_round_trips(tmp_path, capsys):
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    contents = {"model": dict(model.state_dict()), "optimizer": opt.state_dict()}  # state keyed 0, 1
    torch.save(contents, tmp_path / "plain.pt")
    assert cli(capsys, "convert", tmp_path / "plain.pt", tmp_path / "sharded", "--to", "sharded")[0] == 0
    assert cli(capsys, "convert", tmp_path / "sharded", tmp_path / "again.pt", "--to", "full")[0] == 0
    assert_same(load(tmp_path / "again.pt"), load(tmp_path / "plain.pt"))


def test_views_odd_shapes_and_shared_storages_convert_exactly(tmp_path, capsys):
    # torch.save keeps views as views: loaded back (memory-mapped, as conversions read), a tensor can sit at an
    # offset of a storage longer than itself, or overlap another one. Every output must hold just its elements.
    base = torch.randn(200, generator=torch.Generator().manual_seed(0))
    history = torch.arange(12.0)
    model = {
        "embed.weight": base[:74].view(37, 2),  # a vocabulary of 37: no even split on 2 ranks
        "head.weight": base[74:80].view(3, 2),  # a 3-way head
        "head.bias": base[80:83],
        "overlap": base[78:90],  # overlaps head.weight and head.bias
        "tied": base[:74].view(37, 2),
        "moments": torch.randn(5, 7).t(),  # not contiguous
    }
    torch.save({"model": model, "recent": history[8:], "step": 4}, tmp_path / "views.pt")
    expected = {"model": {k: v.contiguous() for k, v in model.items()}, "recent": torch.tensor([8.0, 9, 10, 11]),
                "step": 4}
    assert cli(capsys, "convert", tmp_path / "views.pt", tmp_path / "sharded", "--to", "sharded")[0] == 0
    # `recent` comes back from meta.pt as a view at offset 8: the full writer must write its 4 elements only.
    assert cli(capsys, "convert", tmp_path / "sharded", tmp_path / "full.pt", "--to", "full")[0] == 0
    assert_same(load(tmp_path / "full.pt"), expected)  # without mmap, torch.load checks each record's size
    assert_same(torch.load(tmp_path / "full.pt", weights_only=True, mmap=True), expected)
    status, _, err = cli(capsys, "convert", tmp_path / "views.pt", tmp_path / "w.safetensors", "--to", "safetensors")
    assert status == 0, err
    assert_same(by_name(load_file(tmp_path / "w.safetensors")), by_name(expected["model"]))


def test_safetensors_export_streams_the_file_safetensors_itself_writes(tmp_path, capsys):
    """The streamed export is byte for byte what ``safetensors.torch.save_file`` writes for the same weights (one
    file, and each shard of a sharded export), and reads back exactly: odd shapes, several dtypes, 0-d and empty
    tensors, tied and overlapping views of one storage (each name gets its own copy of its bytes, as before), and a
    strided view."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(1)
    base = torch.randn(300, generator=g)
    model = {
        "embed.weight": base[:111].view(37, 3),  # odd shape, a view at offset 0 of a longer storage
        "head.weight": base[:111].view(37, 3),  # tied to embed.weight
        "overlap": base[100:130],  # overlaps embed.weight
        "norm.weight": torch.randn(7, generator=g).to(torch.bfloat16),
        "proj.weight": torch.randn(5, 3, generator=g).to(torch.float16),
        "moments": torch.randn(5, 7, generator=g).t(),  # not contiguous
        "positions": torch.arange(-6, 7, dtype=torch.int64).view(13, 1),
        "codes": torch.randint(-128, 127, (9,), dtype=torch.int8, generator=g),
        "mask": torch.rand(3, 5, generator=g) > 0.5,
        "double": torch.randn(2, 2, dtype=torch.float64, generator=g),
        "scale": torch.tensor(0.125),  # 0-d
        "step": torch.tensor(7, dtype=torch.int64),  # 0-d, another dtype
        "empty": torch.zeros(0, 4),
        "empty.half": torch.zeros(3, 0, dtype=torch.float16),
    }
    expected = {k: v.clone(memory_format=torch.contiguous_format) for k, v in model.items()}
    torch.save({"model": model, "step": 3}, tmp_path / "src.pt")
    assert cli(capsys, "convert", tmp_path / "src.pt", tmp_path / "sharded", "--to", "sharded")[0] == 0
    save_file(expected, str(tmp_path / "reference.safetensors"), metadata={"format": "pt"})
    reference = (tmp_path / "reference.safetensors").read_bytes()
    for source in ("src.pt", "sharded"):
        out = tmp_path / f"{source}.safetensors"
        status, _, err = cli(capsys, "convert", tmp_path / source, out, "--to", "safetensors")
        assert status == 0, err
        assert_same(by_name(load_file(out)), by_name(expected), str(out))
        assert out.read_bytes() == reference, f"{out} differs from what safetensors writes"
        # Sharded export: every shard is the file safetensors writes for its tensors, and the index names them.
        status, _, err = cli(capsys, "convert", tmp_path / source, tmp_path / f"{source}-hf", "--to", "safetensors",
                             "--max-shard-size", "200B")
        assert status == 0, err
        index = json.loads((tmp_path / f"{source}-hf" / "model.safetensors.index.json").read_text())
        assert list(index["weight_map"]) == list(model) and len(set(index["weight_map"].values())) >= 4
        for file in set(index["weight_map"].values()):
            names = [n for n, f in index["weight_map"].items() if f == file]
            save_file({n: expected[n] for n in names}, str(tmp_path / "ref-shard"), metadata={"format": "pt"})
            assert (tmp_path / f"{source}-hf" / file).read_bytes() == (tmp_path / "ref-shard").read_bytes(), file


def test_sharded_reads_verify_every_piece_of_a_large_tensor(tmp_path, capsys):
    """A sharded item is read and hashed in 1 MiB pieces (and its zip headers from cached blocks): a tensor of
    several pieces, of an odd size, converts back exactly, and a flipped byte in its last piece, or in the zip
    record after it, is caught and named."""
    g = torch.Generator().manual_seed(2)
    model = {"big": torch.randn(3 * 2**18 + 7, generator=g), "small": torch.randn(5, generator=g)}
    torch.save({"model": model}, tmp_path / "src.pt")
    assert cli(capsys, "convert", tmp_path / "src.pt", tmp_path / "sharded", "--to", "sharded")[0] == 0
    assert cli(capsys, "convert", tmp_path / "sharded", tmp_path / "back.pt", "--to", "full")[0] == 0
    assert_same(load(tmp_path / "back.pt")["model"], model)
    items = json.loads((tmp_path / "sharded" / "checksums.json").read_text())["items"]
    shard, offset, length, _, name = next(i for i in items if i[4] == "model.big")
    for where in (offset + length - 4096, offset + length - 10):  # the data's last piece; the zip's end record
        file = tmp_path / "sharded" / shard
        data = bytearray(file.read_bytes())
        data[where] ^= 0x10
        file.write_bytes(bytes(data))
        status, _, err = cli(capsys, "convert", tmp_path / "sharded", tmp_path / "bad.pt", "--to", "full")
        assert status == 2 and str(file) in err and "'model.big'" in err and "corrupted" in err, err
        data[where] ^= 0x10
        file.write_bytes(bytes(data))
    assert not (tmp_path / "bad.pt").exists()


def test_overwrite_replaces_previous_output_only_when_asked(ckpt, tmp_path, capsys):
    target = tmp_path / "out.pt"
    torch.save({"model": {"w": torch.zeros(1)}}, target)
    before = target.read_bytes()
    status, _, err = cli(capsys, "convert", ckpt / "sharded", target, "--to", "full")
    assert status == 2 and "--overwrite" in err and target.read_bytes() == before
    assert cli(capsys, "convert", ckpt / "sharded", target, "--to", "full", "--overwrite")[0] == 0
    assert_same(load(target), load(ckpt / "full.pt"))
    export = tmp_path / "hf"
    assert cli(capsys, "convert", ckpt / "full.pt", export, "--to", "safetensors", "--max-shard-size", "8KB")[0] == 0
    assert cli(capsys, "convert", ckpt / "full.pt", export, "--to", "safetensors", "--overwrite")[0] == 0
    assert sorted(p.name for p in export.iterdir()) == ["model.safetensors"]  # the old shards went with the old dir
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "out.pt"]


def test_a_failed_conversion_leaves_nothing_behind(ckpt, tmp_path):
    def interrupt(done: int, total: int) -> None:
        if done:
            raise KeyboardInterrupt

    for to, target in (("full", tmp_path / "x.pt"), ("safetensors", tmp_path / "hf"), ("sharded", tmp_path / "s")):
        with pytest.raises(KeyboardInterrupt):
            convert(ckpt / ("full.pt" if to == "sharded" else "sharded"), target, to=to, progress=interrupt)
    assert list(tmp_path.iterdir()) == []


def test_progress_bar_only_when_asked_or_on_a_terminal(ckpt, tmp_path, capsys):
    status, _, err = cli(capsys, "convert", ckpt / "sharded", tmp_path / "a.pt", "--to", "full")
    assert status == 0 and err == ""  # stderr is not a terminal here
    status, _, err = cli(capsys, "convert", ckpt / "sharded", tmp_path / "b.pt", "--to", "full", "--progress")
    assert status == 0 and err.lstrip("\r").startswith("full") and "100%" in err and "B/s" in err, err  # tqdm's
    assert err.endswith("\n") and err.count("\n") == 1


# ------------------------------------------------------------------------------------------------- inspect


@pytest.mark.parametrize("source, world_size", [("sharded", 2), ("full.pt", 1)])
def test_inspect_json(ckpt, capsys, source, world_size):
    status, out, err = cli(capsys, "inspect", ckpt / source, "--json", "--tensors")
    assert status == 0, err
    info = json.loads(out)
    contents = load(ckpt / "full.pt")
    model_bytes = sum(t.nbytes for t in contents["model"].values())
    assert info["format"] == source.removesuffix(".pt") and info["world_size"] == world_size
    assert info["models"] == {"model": {
        "parameters": sum(t.numel() for t in contents["model"].values()), "bytes": model_bytes,
        "dtypes": {"float32": {"parameters": model_bytes // 4, "bytes": model_bytes}}}}
    states = [t for s in contents["optimizer"]["state"].values() for t in s.values()]
    assert info["optimizers"] == {"optimizer": {
        "state_tensors": len(states), "bytes": sum(t.nbytes for t in states), "param_groups": 1}}
    assert info["metadata_keys"] == ["step", "note"]
    assert [(t["name"], t["shape"], t["dtype"]) for t in info["tensors"]] == flat_tensors(contents)


def test_inspect_text(ckpt, capsys):
    status, out, _ = cli(capsys, "inspect", ckpt / "sharded")
    lines = out.splitlines()
    assert status == 0 and lines[:3] == [f"checkpoint   {ckpt / 'sharded'}", "format       sharded", "world size   2"]
    assert "model        model: 7,680 parameters, 30.7 kB" in lines
    assert "optimizer    optimizer: 72 state tensors, 61.5 kB, 1 param group" in lines
    assert lines[-1] == "metadata     step, note" and "tensors" not in lines
    status, out, _ = cli(capsys, "inspect", ckpt / "full.pt", "--tensors")
    lines = out.splitlines()
    assert status == 0 and "world size   1 (single file)" in lines
    rows = [line.split() for line in lines[lines.index("tensors") + 1:]]
    assert [(r[0], r[-1]) for r in rows] == [(name, dtype) for name, _, dtype in flat_tensors(load(ckpt / "full.pt"))]
    assert ["model.head.weight", "[32,", "16]", "float32"] in rows


# -------------------------------------------------------------------------------------------------- errors


def _bad_inputs(ckpt: Path, tmp: Path) -> dict[str, tuple[list, str]]:
    (tmp / "notes.txt").write_text("not a checkpoint")
    (tmp / "empty-dir").mkdir()
    (tmp / "w.safetensors").write_bytes(b"\0" * 16)
    (tmp / "user-dir").mkdir()
    (tmp / "user-dir" / "thesis.tex").write_text("precious")
    shutil.copytree(ckpt / "sharded", tmp / "truncated")
    shard = tmp / "truncated" / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    sharded, full = ckpt / "sharded", ckpt / "full.pt"
    return {
        "missing path": (["inspect", tmp / "nope"], "does not exist"),
        "file that is not a checkpoint": (["inspect", tmp / "notes.txt"], "is not a torch.save zip archive"),
        "directory that is not a checkpoint": (["convert", tmp / "empty-dir", tmp / "o.pt", "--to", "full"],
                                               "without DCP's '.metadata' file"),
        "truncated shard": (["convert", tmp / "truncated", tmp / "o.pt", "--to", "full"], "could not be read"),
        "safetensors as the source": (["convert", tmp / "w.safetensors", tmp / "o.pt", "--to", "full"],
                                      "cannot be converted back"),
        "existing DST": (["convert", sharded, tmp / "notes.txt", "--to", "full"], "already exists"),
        "overwriting user files": (["convert", sharded, tmp / "user-dir", "--to", "full", "--overwrite"],
                                   "not a sharded checkpoint"),
        "unknown --to": (["convert", sharded, tmp / "o.pt", "--to", "onnx"], "invalid choice: 'onnx'"),
        "missing --to": (["convert", sharded, tmp / "o.pt"], "required: --to"),
        "no command": ([], "required: {inspect,convert,plan,clean,lighthouse}"),
        "bad --max-shard-size unit": (["convert", sharded, tmp / "hf", "--to", "safetensors", "--max-shard-size",
                                       "12XB"], "Invalid size '12XB'"),
        "zero --max-shard-size": (["convert", sharded, tmp / "hf", "--to", "safetensors", "--max-shard-size", "0"],
                                  "Invalid size '0'"),
        "--max-shard-size without safetensors": (["convert", sharded, tmp / "o.pt", "--to", "full",
                                                  "--max-shard-size", "1GB"], "applies to `--to safetensors` only"),
        "shards into a file name": (["convert", sharded, tmp / "o.safetensors", "--to", "safetensors",
                                     "--max-shard-size", "1GB"], "names a file"),
        "same format": (["convert", sharded, tmp / "o", "--to", "sharded"], "already a sharded checkpoint"),
        "DST inside SRC": (["convert", full, full / "o", "--to", "sharded"], "overlaps SRC"),
    }


CASES = ["missing path", "file that is not a checkpoint", "directory that is not a checkpoint", "truncated shard",
         "safetensors as the source", "existing DST", "overwriting user files", "unknown --to", "missing --to",
         "no command", "bad --max-shard-size unit", "zero --max-shard-size", "--max-shard-size without safetensors",
         "shards into a file name", "same format", "DST inside SRC"]


@pytest.mark.parametrize("case", CASES)
def test_bad_input_exits_2_with_one_line(ckpt, tmp_path, capsys, case):
    args, expected = _bad_inputs(ckpt, tmp_path)[case]
    before = sorted(p.name for p in tmp_path.iterdir())
    status, out, err = cli(capsys, *args)
    assert status == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("lightning-fsdp: error: "), err
    assert expected in err and "HINT: " in err and "Traceback" not in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing written, nothing removed
    assert (tmp_path / "notes.txt").read_text() == "not a checkpoint"


def test_objects_beyond_weights_need_allow_pickle(tmp_path, capsys):
    import argparse  # a hyperparameter Namespace, as in many training scripts: not in weights_only's allowlist

    import torch.distributed.checkpoint as dcp

    hparams = argparse.Namespace(lr=0.1)
    torch.save({"model": {"w": torch.ones(2)}, "hparams": hparams}, tmp_path / "ck.pt")
    # In DCP, a param group entry: DCP's own loader would unpickle it with weights_only=False.
    groups = [{"hp": hparams, "params": ["w"]}]
    state = {"model": {"w": torch.ones(2)}, "optimizer": {"state": {}, "param_groups": groups}}
    with pytest.warns(UserWarning, match="single process"):
        dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp_path / "sharded"), no_dist=True)
    for path, entry in ((tmp_path / "ck.pt", f"{str(tmp_path / 'ck.pt')!r} holds objects"),
                        (tmp_path / "sharded", "The entry 'optimizer.param_groups.0.hp'")):
        status, _, err = cli(capsys, "inspect", path)
        assert status == 2 and err.count("\n") == 1 and entry in err, err
        assert "HINT: if you trust this checkpoint" in err and "--allow-pickle" in err
        status, out, _ = cli(capsys, "inspect", path, "--allow-pickle", "--json")
        assert status == 0 and json.loads(out)["format"] in ("full", "sharded")
    _, out, _ = cli(capsys, "inspect", tmp_path / "ck.pt", "--allow-pickle", "--json")
    assert json.loads(out)["metadata_keys"] == ["hparams"]


def test_entry_points_run_as_commands(ckpt, tmp_path):
    """`python -m lightning_fsdp` and the installed `lightning-fsdp` script, run at the same time."""
    script = Path(sys.executable).with_name("lightning-fsdp")
    module = subprocess.Popen([sys.executable, "-m", "lightning_fsdp", "inspect", str(ckpt / "sharded"), "--json"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    command = subprocess.Popen([str(script), "convert", str(tmp_path / "nope"), str(tmp_path / "o.pt"), "--to", "full"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = module.communicate(timeout=120)
    assert module.returncode == 0 and json.loads(out)["world_size"] == 2, err
    assert "Warning" not in err, err
    out, err = command.communicate(timeout=120)
    assert command.returncode == 2 and out == "" and err.count("\n") == 1 and "does not exist" in err, err


# -------------------------------------------------------------------------------------------------- memory


def test_conversions_stream_with_bounded_memory(memory_run):
    proc, out = memory_run
    stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stderr[-4000:]
    measured = json.loads(stdout.strip().splitlines()[-1])
    size = measured["model_bytes"]
    assert size > 200e6
    largest = measured["largest_tensor_bytes"]
    assert largest * 40 < size, "the model must be many tensors, or the bound below says nothing"
    for conversion, extra in measured["extra_peak_bytes"].items():
        bound = TENSORS_BOUND * largest + measured["shard_bytes"][conversion]
        assert extra < bound, (f"{conversion}: {extra / 1e6:.1f} MB extra, over {bound / 1e6:.1f} MB"
                               f" ({TENSORS_BOUND} x the largest tensor, {largest / 1e6:.1f} MB, plus one shard)")
    # The conversions did convert: every output holds the whole model.
    index = json.loads((out / "out-full-st" / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == size and len(set(index["weight_map"].values())) >= 10
    written = torch.load(out / "out-full.pt", mmap=True, weights_only=True)["model"]
    assert sum(t.nbytes for t in written.values()) == size
    assert (out / "out-sharded" / "__0_0.distcp").stat().st_size > size
    for one_file in ("out-one.safetensors", "out-one-full.safetensors"):
        with safe_open(out / one_file, "pt") as handle:
            assert len(list(handle.keys())) == 96 and (out / one_file).stat().st_size > size
