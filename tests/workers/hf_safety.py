"""Hugging Face safetensors loads that cannot be exact are refused, on two ranks, from both fronts.

A small model with odd shapes (an [8, 8] weight split 4/4 across the ranks, a [7, 5] weight and a [7] bias split
4/3, an int64 buffer) is sharded, and files written here by rank 0 are loaded into it through ``fabric.load_raw``
and ``lightning_fsdp.load_pretrained`` (what a Trainer's ``on_fit_start`` calls; one case runs it in a real
``Trainer.fit``). Each case pairs refusals with the nearby files that must still load exactly:

- chunks (placed by ``DCP_SHARDING_INFO``) that leave part of a weight uncovered, overlap, reach outside the
  weight or have another number of dims;
- index entries outside the checkpoint directory: ``..``, absolute paths, symlinks, files that are not safetensors;
- a stored dtype of another kind than the parameter's (integer, bool, complex against float, float against int).

Every refusal must raise on every rank, name the tensor or the entry, and leave the model's values untouched.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Callable

import lightning as L
import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn

import lightning_fsdp
from common import full_params, make_fabric
from harness import TIMEOUT, case, rank, run_cases
from lightning_fsdp.trainer import FSDPStrategy as TrainerFSDPStrategy

OUT = Path(os.environ["LFSDP_TEST_OUT"])
INFO = "DCP_SHARDING_INFO"


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.square = nn.Linear(8, 8, bias=False)  # [8, 8]: rows 0-3 on rank 0, 4-7 on rank 1
        self.odd = nn.Linear(5, 7)  # [7, 5] and [7]: 4 rows on rank 0, 3 on rank 1
        self.register_buffer("steps", torch.zeros(3, dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.odd(self.square(x)[:, :5])


# The weights the files hold: distinct values everywhere, unlike the model's random initial ones.
EXPECTED = {
    "square.weight": torch.arange(64.0).reshape(8, 8),
    "odd.weight": 100 + torch.arange(35.0).reshape(7, 5),
    "odd.bias": 200 + torch.arange(7.0),
    "steps": torch.tensor([3, 4, 5]),
}

FABRIC = make_fabric(2, timeout=TIMEOUT)


def sharded() -> nn.Module:
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = FABRIC.setup_module(Net())
    assert isinstance(model.module.square.weight, torch.distributed.tensor.DTensor)
    return model


def via_fabric(path: Path, model, strict: bool = True) -> None:
    FABRIC.load_raw(path, model, strict=strict)


def via_helper(path: Path, model, strict: bool = True) -> None:
    lightning_fsdp.load_pretrained(model.module, path, strict=strict)


FRONTS = {"fabric.load_raw": via_fabric, "load_pretrained": via_helper}


def write(directory: Path, files: dict[str, dict[str, tuple[torch.Tensor, list[int] | None]]], *,
          index: dict[str, str] | None = None, place_all: bool = True) -> Path:
    """Rank 0 writes ``files`` (file name -> tensor name -> (chunk, offsets or None)) and, if given, an index with
    ``index`` as its weight map; every rank gets the directory once it is complete. In a file where some chunks
    are placed, the whole tensors are placed at offset 0, as DCP's writer does (unless ``place_all=False``)."""
    if rank() == 0:
        directory.mkdir(parents=True)
        for name, tensors in files.items():
            metadata = {"format": "pt"}
            placed = {key: {"saved_offsets": offsets} for key, (_, offsets) in tensors.items() if offsets is not None}
            if placed and place_all:
                placed = {key: {"saved_offsets": [0] * chunk.dim() if offsets is None else offsets}
                          for key, (chunk, offsets) in tensors.items()}
            if placed:
                metadata[INFO] = json.dumps(placed)
            (directory / name).parent.mkdir(parents=True, exist_ok=True)
            save_file({key: chunk.contiguous() for key, (chunk, _) in tensors.items()}, str(directory / name),
                      metadata=metadata)
        if index is not None:
            (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": index}))
    dist.barrier()
    return directory


def whole(**changed: torch.Tensor) -> dict[str, tuple[torch.Tensor, None]]:
    """Every expected tensor, whole (as `save_pretrained` writes them), with ``changed`` ones replaced."""
    return {key: (changed.get(key.replace(".", "_"), value), None) for key, value in EXPECTED.items()}


def assert_loaded(model) -> int:
    got = full_params(model)
    assert sorted(got) == sorted(EXPECTED), list(got)
    for name, tensor in EXPECTED.items():
        assert got[name].dtype == state_dtype(name), (name, got[name].dtype)
        assert torch.equal(got[name], tensor.to(got[name].dtype)), f"{name} was not loaded exactly: {got[name]}"
    return len(got)


def state_dtype(name: str) -> torch.dtype:
    return torch.int64 if name == "steps" else torch.float32


def refused(load: Callable[[], None], model, error: type, *needles: str) -> str:
    """``load`` must raise ``error`` naming every needle (and a HINT), with the model's values untouched."""
    before = full_params(model)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            load()
    except error as err:
        message = str(err)
    else:
        raise AssertionError(f"the load was not refused (warnings: {[str(w.message)[:200] for w in caught]})")
    for needle in (*needles, "HINT"):
        assert needle in message, f"{needle!r} not in: {message}"
    after = full_params(model)
    for name, tensor in before.items():
        assert torch.equal(after[name], tensor), f"the refused load changed {name}"
    return message


@case
def a_weight_that_chunks_cover_only_in_part_is_refused():
    # The example: rows 4-7 of square.weight, placed at [4, 0]; rows 0-3 are in no file.
    rows = EXPECTED["square.weight"]
    partial = write(OUT / "partial", {"model.safetensors": {**whole(), "square.weight": (rows[4:], [4, 0])}})
    messages = []
    for front, load in FRONTS.items():
        for strict in (True, False):
            model = sharded()
            messages.append(refused(lambda: load(partial, model, strict), model, ValueError, "square.weight",
                                    "cover 32 of its 64 elements", "consolidate"))
    # Indexed: the index names only the file with rows 0-3 (the file with rows 4-7 is not part of the set).
    top = write(OUT / "partial-indexed", {
        "model-1.safetensors": {**whole(), "square.weight": (rows[:4], [0, 0])},
        "model-2.safetensors": {"square.weight": (rows[4:], [4, 0])},
    }, index={key: "model-1.safetensors" for key in EXPECTED})
    model = sharded()
    refused(lambda: via_fabric(top, model), model, ValueError, "square.weight", "cover 32 of its 64")
    # With the second file in the index, the chunks tile the weight and it loads exactly on both fronts.
    complete = write(OUT / "complete-indexed", {
        "model-1.safetensors": {**whole(), "square.weight": (rows[:4], [0, 0])},
        "model-2.safetensors": {"square.weight": (rows[4:], [4, 0])},
    }, index={**{key: "model-1.safetensors" for key in EXPECTED}, "square.weight": "model-2.safetensors"})
    loaded = []
    for load in FRONTS.values():
        model = sharded()
        load(complete, model)
        loaded.append(assert_loaded(model))
    return {"refusals": len(messages) + 1, "loaded": loaded, "message": messages[0][:160]}


@case
def overlapping_chunks_are_refused():
    rows = EXPECTED["square.weight"]
    overlapping = write(OUT / "overlap", {
        "model-1.safetensors": {**whole(), "square.weight": (rows[:5], [0, 0])},
        "model-2.safetensors": {"square.weight": (rows[3:], [3, 0])},
    }, index={**{key: "model-1.safetensors" for key in EXPECTED}, "square.weight": "model-2.safetensors"})
    model = sharded()
    first = refused(lambda: via_helper(overlapping, model), model, ValueError, "square.weight", "[0, 0] (shape [5, 8])",
                    "[3, 0] (shape [5, 8]) overlap")
    # The same whole tensor in two files of one set (no sharding info): both copies would be read into it.
    twice = write(OUT / "twice", {
        "model-1.safetensors": whole(),
        "model-2.safetensors": {"odd.bias": (EXPECTED["odd.bias"], None)},
    }, index={**{key: "model-1.safetensors" for key in EXPECTED}, "odd.bias": "model-2.safetensors"})
    model = sharded()
    second = refused(lambda: via_fabric(twice, model), model, ValueError, "odd.bias", "model-1.safetensors, model-2"
                     ".safetensors): the chunk of shape [7] at offset [0] is stored twice")
    return [first[:160], second[:160]]


@case
def chunks_outside_the_weight_or_of_another_rank_are_refused():
    rows = EXPECTED["square.weight"]
    results = {}
    # A chunk reaching past the last row: rows 0-5 and a 4-row chunk at row 6 make a (10, 8) tensor.
    beyond = write(OUT / "beyond-indexed", {
        "model-1.safetensors": {**whole(), "square.weight": (rows[:6], [0, 0])},
        "model-2.safetensors": {"square.weight": (torch.cat([rows[6:], rows[6:]]), [6, 0])},
    }, index={**{key: "model-1.safetensors" for key in EXPECTED}, "square.weight": "model-2.safetensors"})
    model = sharded()
    results["beyond"] = refused(lambda: via_fabric(beyond, model), model, ValueError, "square.weight",
                                "shape [4, 8] at offset [6, 0] reaches outside")[:160]
    # Offsets the header cannot mean: negative, one per dim too few, or no entry for a tensor of the file.
    for label, info in {"negative": [-4, 0], "short": [4], "absent": None}.items():
        tensors = {**whole(), "square.weight": (rows[4:], info)}
        if info is None:  # sharding info for the other tensors only
            tensors = {key: (value, [0] * value.dim()) for key, (value, _) in whole().items()}
            tensors["square.weight"] = (rows, None)
        path = write(OUT / f"offsets-{label}", {"model.safetensors": tensors}, place_all=False)
        needle = "'square.weight': no entry" if info is None else f"saved_offsets={info} for a chunk of shape [4, 8]"
        model = sharded()
        results[label] = refused(lambda: via_helper(path, model), model, ValueError, "model.safetensors", INFO,
                                 needle)[:160]
    # Odd shapes tiled across files (rows split 3/5 against the ranks' 4/4, columns of the [7, 5] weight, the
    # [7] bias split 3/4) load exactly; the same set with a bias chunk of two dims does not.
    odd, bias = EXPECTED["odd.weight"], EXPECTED["odd.bias"]
    first = {"square.weight": (rows[:3], [0, 0]), "odd.weight": (odd[:, :2], [0, 0]), "odd.bias": (bias[:3], [0]),
             "steps": (EXPECTED["steps"], [0])}
    second = {"square.weight": (rows[3:], [3, 0]), "odd.weight": (odd[:, 2:], [0, 2]), "odd.bias": (bias[3:], [3])}
    index = {**{key: "a.safetensors" for key in EXPECTED}, "square.weight": "b.safetensors"}
    tiled = write(OUT / "tiled", {"a.safetensors": first, "b.safetensors": second}, index=index)
    loaded = []
    for load in FRONTS.values():
        model = sharded()
        load(tiled, model)
        loaded.append(assert_loaded(model))
    flat = {**second, "odd.bias": (bias[3:].reshape(1, 4), [0, 3])}
    ranks = write(OUT / "two-dim-bias", {"a.safetensors": first, "b.safetensors": flat}, index=index)
    model = sharded()
    results["dims"] = refused(lambda: via_fabric(ranks, model), model, ValueError, "odd.bias",
                              "a chunk of shape [1, 4] at offset [0, 3] has 2 dims, the weight 1")[:160]
    return {"loaded": loaded, **results}


@case
def index_entries_must_stay_inside_the_directory():
    messages = {}
    outside = write(OUT / "entries" / "elsewhere", {"model.safetensors": whole()})
    if rank() == 0:
        (OUT / "entries" / "secret.txt").write_text("not weights")
    dist.barrier()

    def indexed(name: str, entry: str, link: Path | None = None) -> Path:
        directory = OUT / "entries" / name
        write(directory, {"inside.safetensors": whole()},
              index={**{key: "inside.safetensors" for key in EXPECTED}, "odd.bias": entry})
        if rank() == 0 and link is not None:
            (directory / entry).symlink_to(link)
        dist.barrier()
        return directory

    cases = {
        "parent": ("../elsewhere/model.safetensors", None, "leads out of the directory"),
        "passwd": ("../secret.txt", None, "leads out of the directory"),  # the "../../etc/passwd"
        "absolute": (str((outside / "model.safetensors").resolve()), None, "an absolute path"),
        "symlink": ("link.safetensors", (outside / "model.safetensors").resolve(), "a symlink to"),
        "not-safetensors": ("notes.txt", None, "not a '.safetensors' file"),
    }
    for i, (label, (entry, link, reason)) in enumerate(cases.items()):
        directory = indexed(label, entry, link)
        if rank() == 0 and label == "not-safetensors":
            (directory / entry).write_text("not weights")
        dist.barrier()
        load = list(FRONTS.values())[i % 2]
        model = sharded()
        messages[label] = refused(lambda: load(directory, model), model, ValueError, f"'odd.bias' -> {entry!r}",
                                  reason)[:200]
    without_bias = {key: value for key, value in whole().items() if key != "odd.bias"}
    # Inside the directory, a subfolder is fine; so is a Hugging Face hub snapshot, whose files are symlinks into
    # the repository's blobs/ folder.
    nested = write(OUT / "entries" / "nested", {"inside.safetensors": without_bias, "part/bias.safetensors": {
        "odd.bias": (EXPECTED["odd.bias"], None)}},
        index={**{key: "inside.safetensors" for key in EXPECTED if key != "odd.bias"},
               "odd.bias": "part/bias.safetensors"})
    repo = OUT / "entries" / "hub" / "models--org--net"
    blobs = write(repo / "blobs", {"0a1b": without_bias,
                                   "2c3d": {"odd.bias": (EXPECTED["odd.bias"], None)}})
    snapshot = repo / "snapshots" / "abc123"
    if rank() == 0:
        snapshot.mkdir(parents=True)
        (snapshot / "model-00001-of-00002.safetensors").symlink_to("../../blobs/0a1b")
        (snapshot / "model-00002-of-00002.safetensors").symlink_to("../../blobs/2c3d")
        weight_map = {key: "model-00001-of-00002.safetensors" for key in EXPECTED}
        weight_map["odd.bias"] = "model-00002-of-00002.safetensors"
        (blobs / "index").write_text(json.dumps({"weight_map": weight_map}))
        (snapshot / "model.safetensors.index.json").symlink_to("../../blobs/index")
    dist.barrier()
    loaded = []
    for directory in (nested, snapshot):
        for load in FRONTS.values():
            model = sharded()
            load(directory, model)
            loaded.append(assert_loaded(model))
    return {"loaded": loaded, **messages}


@case
def a_dtype_of_another_kind_is_refused_and_precision_changes_load():
    square = EXPECTED["square.weight"]
    messages = {}
    wrong = {
        "int32": (whole(square_weight=square.to(torch.int32)), "square.weight", "int32 (integer)", "float32"),
        "bool": (whole(odd_bias=EXPECTED["odd.bias"] > 203), "odd.bias", "bool (bool)", "float32 (floating point)"),
        "complex": (whole(odd_weight=EXPECTED["odd.weight"].to(torch.complex64)), "odd.weight", "complex64 (complex)",
                    "float32"),
        "float-into-int": (whole(steps=EXPECTED["steps"].float()), "steps", "float32 (floating point)",
                           "int64 (integer)"),
    }
    for i, (label, (tensors, name, stored, model_dtype)) in enumerate(wrong.items()):
        path = write(OUT / f"kind-{label}", {"model.safetensors": tensors})
        load = list(FRONTS.values())[i % 2]
        model = sharded()
        messages[label] = refused(lambda: load(path, model, False), model, TypeError, name, stored, model_dtype,
                                  "model.safetensors")[:200]
    # A sharded set whose second chunk alone has another kind.
    mixed = write(OUT / "kind-chunk", {
        "model-1.safetensors": {**whole(), "square.weight": (square[:4], [0, 0])},
        "model-2.safetensors": {"square.weight": (square[4:].to(torch.int32), [4, 0])},
    }, index={**{key: "model-1.safetensors" for key in EXPECTED}, "square.weight": "model-2.safetensors"})
    model = sharded()
    messages["chunk"] = refused(lambda: via_helper(mixed, model), model, TypeError, "square.weight",
                                "model-2.safetensors holds int32")[:200]
    # Precision changes within a kind load, converted: fp16 weights and an int32 buffer.
    changed = write(OUT / "kind-precision", {"model.safetensors": whole(
        square_weight=square.half(), odd_weight=EXPECTED["odd.weight"].bfloat16(),
        steps=EXPECTED["steps"].to(torch.int32))})
    loaded = []
    for load in FRONTS.values():
        model = sharded()
        load(changed, model)
        loaded.append(assert_loaded(model))
    return {"loaded": loaded, **messages}


class Pretrained(L.LightningModule):
    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = path
        self.fit_steps = 0

    def configure_model(self) -> None:
        torch.manual_seed(0)
        self.net = Net()

    def on_fit_start(self) -> None:
        self.initial = full_params(self.net)
        lightning_fsdp.load_pretrained(self.net, self.path)

    def training_step(self, batch, batch_idx):
        self.fit_steps += 1
        return self.net(batch).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@case
def trainer_fit_refuses_a_partial_weight_on_every_rank():
    rows = EXPECTED["square.weight"]
    path = write(OUT / "trainer-partial", {"model.safetensors": {**whole(), "square.weight": (rows[4:], [4, 0])}})
    module = Pretrained(path)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=TrainerFSDPStrategy(timeout=TIMEOUT), max_steps=1,
                        enable_progress_bar=False, logger=False, enable_checkpointing=False,
                        enable_model_summary=False)
    data = torch.utils.data.DataLoader(torch.ones(4, 8), batch_size=2)
    try:
        trainer.fit(module, data)
    except ValueError as err:
        message = str(err)
    else:
        raise AssertionError("Trainer.fit loaded a weight that the files cover only in part")
    assert "square.weight" in message and "cover 32 of its 64 elements" in message and "HINT" in message, message
    assert module.fit_steps == 0
    after = full_params(module.net)
    assert all(torch.equal(after[k], v) for k, v in module.initial.items()), "the refused load changed the model"
    return message[:160]


if __name__ == "__main__":
    run_cases()
