"""Two-rank cases for issue 12, parts 1 and 2: checkpoints that cannot run code and cannot lie.

- Crafted files (DCP ``.metadata``, ``meta.pt``, a full file, a Trainer ``.ckpt``) whose unpickling would create a
  marker file: each is first shown to create it under plain unpickling, then every load path must refuse it on
  every rank, naming the file, with no marker anywhere.
- Corrupted checkpoints (a flipped byte in a shard or in a full file's tensor, a shard copied from another
  checkpoint) raise the same error on both ranks, naming the file and the tensor; the good checkpoint still
  loads exactly; an old checkpoint without checksums loads with a note; async saves record checksums;
  checkpoints recorded with CRC-32 (before xxh3) still verify.
"""

from __future__ import annotations

import contextlib
import io
import json
import pickle
import shutil
import tempfile
import warnings
import zipfile
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from common import full_params, loss_fn, make_fabric, shared_tmpdir
from harness import case, run_cases
from lightning_fsdp.checkpoint.integrity.safe_pickle import load_dcp_metadata
from lightning_fsdp.checkpoint.integrity.zip_index import tensor_record_names
from lightning_fsdp.checkpoint.integrity.verify import verify_checkpoint
from models import TinyTransformer, make_batch

WORLD = 2


class Payload:
    """Unpickling this creates ``marker``: what a crafted checkpoint would do, harmlessly."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))




def _setup(fabric, seed=0):
    torch.manual_seed(seed)
    plain = TinyTransformer()
    return fabric.setup(plain, torch.optim.AdamW(plain.parameters(), lr=1e-2))


def _train(fabric, model, opt, step=0):
    fabric.backward(loss_fn(model, make_batch(step, fabric.global_rank)))
    opt.step()
    opt.zero_grad()


def same_tensors(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _expect_refusal(fabric, what: str, load, names: Path, marker: Path) -> str:
    """``load`` must raise on this rank with a message naming ``names``, and no rank may see the marker."""
    try:
        load()
    except Exception as err:  # noqa: BLE001 - the point is that it raises, with a clear message
        message = f"{type(err).__name__}: {err}"
    else:
        raise AssertionError(f"{what}: a crafted checkpoint loaded")
    fabric.barrier()
    assert not marker.exists(), f"{what}: the payload ran (marker {marker} exists)"
    assert str(names) in message, f"{what}: the error does not name {names}: {message}"
    return message[:200]


def _plain_unpickling_runs(fabric, load_plainly, marker: Path) -> None:
    """The control: the very same bytes do run the payload when unpickled plainly, so the test can fail."""
    if fabric.global_rank == 0:
        load_plainly()
        assert marker.exists(), "the payload did not run under plain unpickling; the test would prove nothing"
        marker.unlink()
    fabric.barrier()


@case
def crafted_files_run_no_code_on_any_rank():
    fabric = make_fabric(WORLD)
    full_fabric = make_fabric(WORLD, state_dict_type="full")
    model, opt = _setup(fabric)
    root = shared_tmpdir(fabric)
    marker = root / "MARKER"
    report = {}

    # DCP's .metadata: fabric.load and fabric.load_raw.
    sharded = root / "sharded"
    fabric.save(sharded, {"model": model, "optimizer": opt})
    dcp_meta = sharded / ".metadata"
    if fabric.global_rank == 0:
        metadata = load_dcp_metadata(dcp_meta)
        metadata.planner_data = {"payload": Payload(marker)}
        dcp_meta.write_bytes(pickle.dumps(metadata))
    fabric.barrier()
    _plain_unpickling_runs(fabric, lambda: pickle.loads(dcp_meta.read_bytes()), marker)
    report["load .metadata"] = _expect_refusal(
        fabric, "load", lambda: fabric.load(sharded, {"model": model, "optimizer": opt}), dcp_meta, marker)
    report["load_raw .metadata"] = _expect_refusal(
        fabric, "load_raw", lambda: fabric.load_raw(sharded, model), dcp_meta, marker)

    # meta.pt of a sharded checkpoint.
    sharded2 = root / "sharded2"
    fabric.save(sharded2, {"model": model, "step": 1})
    meta_pt = sharded2 / "meta.pt"
    if fabric.global_rank == 0:
        torch.save({"step": 1, "payload": Payload(marker)}, meta_pt)
    fabric.barrier()
    _plain_unpickling_runs(fabric, lambda: torch.load(meta_pt, weights_only=False), marker)
    report["meta.pt"] = _expect_refusal(fabric, "meta.pt", lambda: fabric.load(sharded2, {"model": model}),
                                        meta_pt, marker)

    # A full file: fabric.load and fabric.load_raw.
    full_path = root / "full.pt"
    full_fabric.save(full_path, {"model": model})
    if fabric.global_rank == 0:
        contents = torch.load(full_path, weights_only=True)
        contents["payload"] = Payload(marker)
        torch.save(contents, full_path)
    fabric.barrier()
    _plain_unpickling_runs(fabric, lambda: torch.load(full_path, weights_only=False), marker)
    report["full"] = _expect_refusal(fabric, "full", lambda: fabric.load(full_path, {"model": model}),
                                     full_path, marker)
    report["full load_raw"] = _expect_refusal(fabric, "full load_raw", lambda: fabric.load_raw(full_path, model),
                                              full_path, marker)
    return report


@case
def trainer_refuses_crafted_checkpoints_on_every_rank():
    from trainer_common import LitGPT, loader, make_trainer, strategy

    root = Path(torch.distributed.get_rank() == 0 and tempfile.mkdtemp() or "")
    holder = [str(root)]
    torch.distributed.broadcast_object_list(holder, src=0)
    root = Path(holder[0])
    marker = root / "MARKER"
    report = {}
    for kind in ("sharded", "full"):
        model = LitGPT()
        trainer = make_trainer(strategy(state_dict_type=kind), max_epochs=1)
        trainer.fit(model, loader(8))
        path = root / f"{kind}.ckpt"
        trainer.save_checkpoint(path)
        victim = path / ".metadata" if kind == "sharded" else path
        if torch.distributed.get_rank() == 0:
            if kind == "sharded":
                metadata = load_dcp_metadata(victim)
                metadata.planner_data = {"payload": Payload(marker)}
                victim.write_bytes(pickle.dumps(metadata))
                plain = lambda: pickle.loads(victim.read_bytes())  # noqa: E731
            else:
                contents = torch.load(victim, weights_only=True)
                contents["payload"] = Payload(marker)
                torch.save(contents, victim)
                plain = lambda: torch.load(victim, weights_only=False)  # noqa: E731
            plain()
            assert marker.exists(), "the payload did not run under plain unpickling"
            marker.unlink()
        torch.distributed.barrier()
        try:
            make_trainer(strategy()).validate(LitGPT(), loader(8), ckpt_path=path, verbose=False)
        except Exception as err:  # noqa: BLE001
            message = f"{type(err).__name__}: {err}"
        else:
            raise AssertionError(f"{kind}: the Trainer loaded a crafted checkpoint")
        torch.distributed.barrier()
        assert not marker.exists(), f"{kind}: the payload ran"
        assert str(victim) in message, message
        report[kind] = message[:200]
    return report


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as file:
        file.seek(offset)
        byte = file.read(1)
        file.seek(offset)
        file.write(bytes([byte[0] ^ 0x10]))


def _expect_corruption(fabric, what: str, load, file: Path, tensor) -> dict:
    """``tensor``: the name the error must give, or a set of names any one of which it may give (a copied shard
    is wrong in every item, and which one is read first depends on the read plan)."""
    try:
        load()
    except Exception as err:  # noqa: BLE001
        error = err
    else:
        raise AssertionError(f"{what}: a corrupted checkpoint loaded")
    message = str(error)
    names = {tensor} if isinstance(tensor, str) else set(tensor)
    assert str(file) in message and any(repr(n) in message for n in names), (
        f"{what}: expected {file} and one of {sorted(names)[:5]} in: {message}"
    )
    types = [None] * WORLD
    torch.distributed.all_gather_object(types, type(error).__name__)
    assert len(set(types)) == 1, f"{what}: different error types on the ranks: {types}"
    return {"type": types[0], "message": message[-300:]}


def _middle_item(checkpoint: Path, shard: str) -> tuple[int, str]:
    """A byte in the middle of the largest tensor item of ``shard``, and that tensor's recorded name."""
    items = [i for i in json.loads((checkpoint / "checksums.json").read_text())["items"] if i[0] == shard]
    _, offset, length, _, name = max(items, key=lambda i: i[2])
    return offset + length // 2, name


@case
def corruption_raises_on_every_rank_naming_file_and_tensor():
    fabric = make_fabric(WORLD)
    full_fabric = make_fabric(WORLD, state_dict_type="full")
    model, opt = _setup(fabric)
    _train(fabric, model, opt)
    root = shared_tmpdir(fabric)
    good = full_params(model)
    sharded, full_path, later = root / "sharded", root / "full.pt", root / "later"
    fabric.save(sharded, {"model": model, "optimizer": opt})
    full_fabric.save(full_path, {"model": model, "optimizer": opt})
    _train(fabric, model, opt, step=1)
    fabric.save(later, {"model": model, "optimizer": opt})  # the same model, one step on
    report = {}

    def load_into_fresh(path):
        other, other_opt = _setup(fabric, seed=7)
        fabric.load(path, {"model": other, "optimizer": other_opt})
        return other

    # 1. A flipped byte in the middle of a shard file.
    shard = sharded / "__1_0.distcp"
    offset, tensor = _middle_item(sharded, shard.name)
    if fabric.global_rank == 0:
        _flip(shard, offset)
    fabric.barrier()
    report["flipped shard byte"] = _expect_corruption(fabric, "shard", lambda: load_into_fresh(sharded), shard,
                                                      tensor)
    if fabric.global_rank == 0:
        _flip(shard, offset)  # flipped back: the checkpoint is good again and loads exactly
    fabric.barrier()
    assert same_tensors(full_params(load_into_fresh(sharded)), good), "the repaired sharded checkpoint differs"

    # 2. A flipped byte in a full file's tensor record: a model tensor (checked as the load broadcasts it) and an
    # optimizer state tensor (checked after the optimizer's broadcasts).
    for part in ("model.", "optimizer."):
        if fabric.global_rank == 0:
            with zipfile.ZipFile(full_path) as archive:
                prefix = archive.namelist()[0].split("/")[0]
                names = {k: n for k, n in tensor_record_names(archive.read(f"{prefix}/data.pkl")).items()
                         if n.startswith(part)}
                key, tensor = max(names.items(), key=lambda kv: archive.getinfo(f"{prefix}/data/{kv[0]}").file_size)
                info = archive.getinfo(f"{prefix}/data/{key}")
            with open(full_path, "rb") as file:  # the record's data starts after its local header
                file.seek(info.header_offset + 26)
                skip = int.from_bytes(file.read(2), "little") + int.from_bytes(file.read(2), "little")
            offset = info.header_offset + 30 + skip + info.file_size // 2
            _flip(full_path, offset)
        else:
            tensor = offset = None
        tensor, offset = fabric.broadcast((tensor, offset))
        report[f"flipped full byte, {part}"] = _expect_corruption(fabric, "full", lambda: load_into_fresh(full_path),
                                                                  full_path, tensor)
        if fabric.global_rank == 0:
            _flip(full_path, offset)
        fabric.barrier()
        assert same_tensors(full_params(load_into_fresh(full_path)), good), "the repaired full checkpoint differs"

    # 3. A shard copied in from another checkpoint of the same model (same layout, other values).
    if fabric.global_rank == 0:
        shutil.copy(shard, root / "saved.distcp")
        shutil.copy(later / shard.name, shard)
    fabric.barrier()
    items_of_shard = {i[4] for i in json.loads((sharded / "checksums.json").read_text())["items"]
                      if i[0] == shard.name and "param_groups" not in i[4]}
    report["copied shard"] = _expect_corruption(fabric, "copied", lambda: load_into_fresh(sharded), shard,
                                                items_of_shard)
    if fabric.global_rank == 0:
        shutil.copy(root / "saved.distcp", shard)
    fabric.barrier()
    assert same_tensors(full_params(load_into_fresh(sharded)), good), "the restored sharded checkpoint differs"
    return report


@case
def old_checkpoints_without_checksums_load_with_a_note():
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    fabric = make_fabric(WORLD)
    model, opt = _setup(fabric)
    path = shared_tmpdir(fabric) / "old"
    # What a save wrote before checksums: DCP's default writer, plus meta.pt.
    dcp.save({"model": get_model_state_dict(model.module)}, checkpoint_id=path)
    if fabric.global_rank == 0:
        torch.save({"step": 3}, path / "meta.pt")
    fabric.barrier()
    expected = full_params(model)
    other, _ = _setup(fabric, seed=9)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state = {"model": other, "step": 0}
        fabric.load(path, state)
    notes = [str(w.message) for w in caught if "carries no checksums" in str(w.message)]
    assert state["step"] == 3 and same_tensors(full_params(other), expected)
    assert len(notes) == (1 if fabric.global_rank == 0 else 0), notes
    assert verify_checkpoint(path) is False
    return notes


@case
def async_saves_record_checksums():
    fabric = make_fabric(WORLD, async_save=True)
    model, opt = _setup(fabric)
    _train(fabric, model, opt)
    path = shared_tmpdir(fabric) / "async"
    fabric.save(path, {"model": model, "optimizer": opt})
    expected = full_params(model)
    other, other_opt = _setup(fabric, seed=3)
    fabric.load(path, {"model": other, "optimizer": other_opt})  # waits for the save
    assert same_tensors(full_params(other), expected)
    assert verify_checkpoint(path) is True
    fabric.barrier()  # every rank has verified the good checkpoint before rank 0 damages it
    shard = path / "__0_0.distcp"
    offset, tensor = _middle_item(path, shard.name)
    if fabric.global_rank == 0:
        _flip(shard, offset)
    fabric.barrier()
    return _expect_corruption(fabric, "async", lambda: fabric.load(path, {"model": other, "optimizer": other_opt}),
                              shard, tensor)


@case
def crc32_checkpoints_still_verify():
    """Checkpoints recorded with CRC-32 (everything saved before xxh3) load, verify, and still catch a flipped byte;
    new ones record xxh3, and their full files still load with plain ``torch.load``."""
    from lightning_fsdp.checkpoint.integrity import digests

    fabric = make_fabric(WORLD)
    full_fabric = make_fabric(WORLD, state_dict_type="full")
    model, opt = _setup(fabric)
    _train(fabric, model, opt)
    root = shared_tmpdir(fabric)
    good = full_params(model)
    paths = {"sharded": root / "sharded", "full": root / "full.pt"}
    digests.ALGORITHM = "crc32"  # what the writers recorded before
    try:
        fabric.save(paths["sharded"], {"model": model, "optimizer": opt})
        full_fabric.save(paths["full"], {"model": model, "optimizer": opt})
    finally:
        digests.ALGORITHM = "xxh3_64"
    new = root / "new.pt"
    full_fabric.save(new, {"model": model, "optimizer": opt})
    assert json.loads((paths["sharded"] / "checksums.json").read_text())["algorithm"] == "crc32"
    with zipfile.ZipFile(paths["full"]) as old_zip, zipfile.ZipFile(new) as new_zip:
        assert not any(n.endswith("/checksums.json") for n in old_zip.namelist())  # the zip CRC-32s alone
        table = json.loads(new_zip.read(next(n for n in new_zip.namelist() if n.endswith("/checksums.json"))))
        assert table["algorithm"] == "xxh3_64" and table["records"], table
    plain = torch.load(new, weights_only=True)  # the extra record does not stop torch's own loader
    assert same_tensors(plain["model"], good)
    report = {}
    for kind, path in paths.items():
        assert verify_checkpoint(path) is True
        other, other_opt = _setup(fabric, seed=5)
        fabric.load(path, {"model": other, "optimizer": other_opt})
        assert same_tensors(full_params(other), good), kind
    fabric.barrier()
    shard = paths["sharded"] / "__0_0.distcp"
    offset, tensor = _middle_item(paths["sharded"], shard.name)
    if fabric.global_rank == 0:
        _flip(shard, offset)
    fabric.barrier()
    report["sharded"] = _expect_corruption(fabric, "crc32 shard",
                                           lambda: fabric.load(paths["sharded"], {"model": other}), shard, tensor)
    if fabric.global_rank == 0:
        with zipfile.ZipFile(paths["full"]) as archive:
            prefix = archive.namelist()[0].split("/")[0]
            key, tensor = max(tensor_record_names(archive.read(f"{prefix}/data.pkl")).items(),
                              key=lambda kv: archive.getinfo(f"{prefix}/data/{kv[0]}").file_size)
            info = archive.getinfo(f"{prefix}/data/{key}")
        with open(paths["full"], "rb") as file:
            file.seek(info.header_offset + 26)
            skip = int.from_bytes(file.read(2), "little") + int.from_bytes(file.read(2), "little")
        _flip(paths["full"], info.header_offset + 30 + skip + info.file_size // 3)
    else:
        tensor = None
    tensor = fabric.broadcast(tensor)
    report["full"] = _expect_corruption(fabric, "crc32 full", lambda: fabric.load(paths["full"], {"model": other}),
                                        paths["full"], tensor)
    return report


def _cli(*argv: str) -> tuple[int, str, str]:
    from lightning_fsdp.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        status = main(list(argv))
    return status, out.getvalue(), err.getvalue()


@case
def cli_verifies_and_refuses_crafted_files():
    fabric = make_fabric(WORLD)
    full_fabric = make_fabric(WORLD, state_dict_type="full")
    model, opt = _setup(fabric)
    root = shared_tmpdir(fabric)
    sharded, full_path, old = root / "sharded", root / "full.pt", root / "old"
    fabric.save(sharded, {"model": model, "optimizer": opt})
    full_fabric.save(full_path, {"model": model, "optimizer": opt})
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    dcp.save({"model": get_model_state_dict(model.module)}, checkpoint_id=old)
    fabric.barrier()
    report = {}
    if fabric.global_rank == 0:
        for label, path in (("sharded", sharded), ("full", full_path)):
            status, out, _ = _cli("inspect", "--verify", str(path))
            assert status == 0 and "checksums    verified" in out, (label, status, out)
        status, out, _ = _cli("inspect", "--verify", str(old))
        assert status == 0 and "carries no checksums" in out, out
        report["old"] = out.splitlines()[-1]
        # A flipped byte: one line naming the file and the tensor, exit status 1.
        shard = sharded / "__1_0.distcp"
        offset, tensor = _middle_item(sharded, shard.name)
        _flip(shard, offset)
        status, out, err = _cli("inspect", "--verify", str(sharded))
        assert status == 1 and str(shard) in err and repr(tensor) in err and len(err.strip().splitlines()) == 1, err
        report["bad sharded"] = err.strip()
        status, _, err = _cli("convert", str(sharded), str(root / "converted.pt"), "--to", "full")
        assert status == 2 and str(shard) in err and not (root / "converted.pt").exists(), err
        _flip(shard, offset)
        # A crafted .metadata: inspect and convert refuse it, and nothing runs.
        marker = root / "MARKER"
        dcp_meta = sharded / ".metadata"
        metadata = load_dcp_metadata(dcp_meta)
        metadata.planner_data = {"payload": Payload(marker)}
        dcp_meta.write_bytes(pickle.dumps(metadata))
        pickle.loads(dcp_meta.read_bytes())
        assert marker.exists(), "the payload did not run under plain unpickling"
        marker.unlink()
        for argv in (("inspect", str(sharded)), ("inspect", "--verify", str(sharded)),
                     ("convert", str(sharded), str(root / "c.pt"), "--to", "full")):
            status, _, err = _cli(*argv)
            assert status == 2 and str(dcp_meta) in err and not marker.exists(), (argv, status, err)
            report[" ".join(argv[:2])] = err.strip()[:200]
        # A crafted full file.
        contents = torch.load(full_path, weights_only=True)
        contents["payload"] = Payload(marker)
        torch.save(contents, full_path)
        for argv in (("inspect", str(full_path)), ("convert", str(full_path), str(root / "c"), "--to", "sharded")):
            status, _, err = _cli(*argv)
            assert status == 2 and str(full_path) in err and not marker.exists(), (argv, status, err)
    fabric.barrier()
    return report


if __name__ == "__main__":
    run_cases()
