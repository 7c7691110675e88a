"""Two-rank cases for issue 21, part A: a verified checkpoint must be the checkpoint that was saved.

1. Any file of a sharded checkpoint swapped in from another save of the same model (``meta.pt``, ``.metadata``,
   ``checksums.json``, a shard file, an extra shard file) is refused on every rank with the same error, naming the
   file, and ``inspect --verify`` fails; before, a swapped ``meta.pt`` loaded A's weights with B's step.
2. A changed chunk offset in ``.metadata`` is refused (before: half a weight stayed at the fresh model's values).
3. A full checkpoint holding a 2 kB list DAG (``L = [L, L]`` sixty times) loads at once, and ``inspect``
   reads one with the DAG in the optimizer's param groups (before: a walk of 2**60 nodes, forever); data nested
   too deep is refused on every rank.
4. A ``.metadata`` that applies BUILD to ``pathlib.PosixPath`` is refused and changes nothing; the next save works.

Every case then loads the good checkpoint and checks it is exactly what was saved.
"""

from __future__ import annotations

import contextlib
import io
import pathlib
import pickle
import shutil
import signal
import warnings
from pathlib import Path

import torch

from common import full_params, loss_fn, make_fabric, same_tensors, shared_tmpdir
from harness import case, run_cases
from lightning_fsdp.checkpoint.integrity.safe_pickle import load_dcp_metadata
from models import TinyTransformer, make_batch

WORLD = 2


def _setup(fabric, seed=0):
    torch.manual_seed(seed)
    plain = TinyTransformer()
    return fabric.setup(plain, torch.optim.AdamW(plain.parameters(), lr=1e-2))


def _train(fabric, model, opt, step=0):
    fabric.backward(loss_fn(model, make_batch(step, fabric.global_rank)))
    opt.step()
    opt.zero_grad()


def _cli(*argv: str) -> tuple[int, str, str]:
    from lightning_fsdp.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        status = main(list(argv))
    return status, out.getvalue(), err.getvalue()


def _refused_everywhere(fabric, what: str, load, names: list) -> str:
    """``load`` raises on every rank, with the same error type and message on all of them, naming ``names``."""
    try:
        load()
    except Exception as err:  # noqa: BLE001 - the point is that it raises
        found = (type(err).__name__, str(err))
    else:
        found = ("loaded", "")
    everyone = [None] * WORLD
    torch.distributed.all_gather_object(everyone, found)
    assert found[0] != "loaded", f"{what}: the load succeeded on rank {fabric.global_rank}"
    assert all(e == everyone[0] for e in everyone), f"{what}: the ranks disagree: {everyone}"
    for name in names:
        assert str(name) in found[1], f"{what}: the error does not name {name}: {found[1]}"
    return f"{found[0]}: {found[1][:160]}"


def _verify_fails(fabric, what: str, path: Path, names: list) -> None:
    if fabric.global_rank == 0:
        status, out, err = _cli("inspect", "--verify", str(path))
        assert status == 1, f"{what}: `inspect --verify` exited {status}, not 1 (a failed verification):\n{out}"
        assert all(str(n) in err for n in names), f"{what}: `inspect --verify` does not name {names}: {err}"
    fabric.barrier()


def _load_fresh(fabric, path, extra=None):
    model, opt = _setup(fabric, seed=7)
    state = {"model": model, "optimizer": opt, **(extra or {})}
    fabric.load(path, state)
    return model, state


@case
def swapped_files_are_refused_on_every_rank():
    fabric = make_fabric(WORLD)
    model, opt = _setup(fabric)
    _train(fabric, model, opt)
    root = shared_tmpdir(fabric)
    a, b = root / "a", root / "b"
    fabric.save(a, {"model": model, "optimizer": opt, "step": 1})
    good = full_params(model)
    _train(fabric, model, opt, step=1)
    fabric.save(b, {"model": model, "optimizer": opt, "step": 2})  # the same model, one step on
    report = {}
    swaps = {  # file of `a` replaced by (or added from) `b`'s -> the files the error must name
        "meta.pt": ["meta.pt"],
        ".metadata": [".metadata", "checksums.json"],
        "checksums.json": [".metadata", "checksums.json"],
        "__0_0.distcp": ["__0_0.distcp"],
        "__1_0.distcp": ["__1_0.distcp"],
    }
    for name, named in swaps.items():
        mixed = root / f"mixed-{name}"
        if fabric.global_rank == 0:
            shutil.copytree(a, mixed)
            shutil.copy(b / name, mixed / name)
        fabric.barrier()
        report[name] = _refused_everywhere(fabric, f"{name} from another save",
                                           lambda: _load_fresh(fabric, mixed, {"step": 0}),
                                           [mixed / n for n in named])
        _verify_fails(fabric, f"{name} from another save", mixed, [mixed / n for n in named])

    # A shard file that no item of the save lives in (from a save on more ranks), and a lost meta.pt.
    extra = root / "extra-shard"
    lost = root / "lost-meta"
    if fabric.global_rank == 0:
        shutil.copytree(a, extra)
        shutil.copy(b / "__1_0.distcp", extra / "__2_0.distcp")
        shutil.copytree(a, lost)
        (lost / "meta.pt").unlink()
    fabric.barrier()
    report["extra shard"] = _refused_everywhere(fabric, "extra shard", lambda: _load_fresh(fabric, extra),
                                                [extra / "__2_0.distcp"])
    _verify_fails(fabric, "extra shard", extra, [extra / "__2_0.distcp"])
    report["lost meta.pt"] = _refused_everywhere(fabric, "lost meta.pt", lambda: _load_fresh(fabric, lost),
                                                 [lost / "meta.pt"])

    # The good checkpoint still loads exactly, with its own step.
    loaded, state = _load_fresh(fabric, a, {"step": 0})
    assert state["step"] == 1, state["step"]
    assert same_tensors(full_params(loaded), good), "the good checkpoint does not load exactly"
    if fabric.global_rank == 0:
        status, out, _ = _cli("inspect", "--verify", str(a))
        assert status == 0 and "verified" in out, out
    fabric.barrier()
    return report


@case
def changed_chunk_offset_in_metadata_is_refused():
    fabric = make_fabric(WORLD)
    model, opt = _setup(fabric)
    _train(fabric, model, opt)
    root = shared_tmpdir(fabric)
    a = root / "a"
    fabric.save(a, {"model": model, "optimizer": opt})
    good = full_params(model)
    changed = root / "changed"
    if fabric.global_rank == 0:
        shutil.copytree(a, changed)
        metadata = load_dcp_metadata(changed / ".metadata")
        # The second chunk of a weight sharded on dim 0: claim it starts one row earlier, as one changed byte would.
        name = next(n for n, m in metadata.state_dict_metadata.items()
                    if n.startswith("model.") and hasattr(m, "chunks") and len(m.chunks) == 2 and m.size[0] > 2)
        chunk = metadata.state_dict_metadata[name].chunks[1]
        chunk.offsets = torch.Size([chunk.offsets[0] - 1, *chunk.offsets[1:]])
        (changed / ".metadata").write_bytes(pickle.dumps(metadata))
    fabric.barrier()
    message = _refused_everywhere(fabric, "changed chunk offset", lambda: _load_fresh(fabric, changed),
                                  [changed / ".metadata"])
    _verify_fails(fabric, "changed chunk offset", changed, [changed / ".metadata"])
    loaded, _ = _load_fresh(fabric, a)
    assert same_tensors(full_params(loaded), good), "the good checkpoint does not load exactly"
    return message


def _dag(levels: int) -> list:
    shared: list = [0]
    for _ in range(levels):
        shared = [shared, shared]
    return shared


class _Hang(Exception):
    pass


@contextlib.contextmanager
def _no_hang(seconds: int):
    """Turn a hang (the old code walks 2**60 nodes) into this case's failure instead of the launch's timeout. Not a
    timing assertion: the bound is minutes above what the work takes."""

    def fire(*_):
        raise _Hang(f"still running after {seconds} s: the walk did not finish")

    previous = signal.signal(signal.SIGALRM, fire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@case
def shared_and_deep_data_load_at_once_or_are_refused():
    fabric = make_fabric(WORLD)
    full_fabric = make_fabric(WORLD, state_dict_type="full")
    model, opt = _setup(fabric)
    _train(fabric, model, opt)
    root = shared_tmpdir(fabric)
    good = full_params(model)
    dag = _dag(60)
    report = {}
    with _no_hang(90):
        # A full checkpoint written by torch.save (2.6 kB of DAG), loaded: it must load at once, sharing kept.
        saved = root / "good.pt"
        full_fabric.save(saved, {"model": model, "optimizer": opt})
        crafted = root / "dag.pt"
        if fabric.global_rank == 0:
            contents = torch.load(saved, weights_only=True)
            contents["history"] = dag
            torch.save(contents, crafted)
        fabric.barrier()
        loaded, state = _load_fresh(fabric, crafted, {"history": None})
        history = state["history"]
        assert history[0] is history[1] and history[0][0] is history[0][1], "the shared list was not kept shared"
        assert same_tensors(full_params(loaded), good), "the DAG checkpoint did not load its weights exactly"

        # (`fabric.save` of such state never reaches this package: Lightning's own `_unwrap_objects` walks the
        # state first, every path of it. The full writer's walk is checked in `test_tamper.py`.)
        report["dag kB"] = crafted.stat().st_size / 1000

        # The inspector, with the DAG inside the optimizer's param groups.
        in_groups = root / "dag-groups.pt"
        if fabric.global_rank == 0:
            contents = torch.load(saved, weights_only=True)
            contents["optimizer"]["param_groups"][0]["history"] = dag
            torch.save(contents, in_groups)
            status, out, err = _cli("inspect", "--verify", str(in_groups))
            assert status == 0 and "optimizer" in out, (status, out, err)
        fabric.barrier()

    # Nested deeper than any checkpoint: a clear error on every rank, not a RecursionError on rank 0 alone.
    deep: list = []
    for _ in range(150):
        deep = [deep]
    too_deep = root / "deep.pt"
    if fabric.global_rank == 0:
        contents = torch.load(saved, weights_only=True)
        contents["history"] = deep
        torch.save(contents, too_deep)
    fabric.barrier()
    report["too deep"] = _refused_everywhere(fabric, "too deep", lambda: _load_fresh(fabric, too_deep),
                                             [too_deep, "levels deep"])
    loaded, _ = _load_fresh(fabric, saved)
    assert same_tensors(full_params(loaded), good), "the good checkpoint does not load exactly"
    return report


MARKER = "_issue21_marker"


def _build_on_posixpath(metadata_bytes: bytes, attribute: str) -> bytes:
    """``.metadata`` bytes that first apply ``GLOBAL pathlib.PosixPath; (None, {attribute: OrderedDict}); BUILD``
    and then unpickle the real metadata as before (protocol 2, so there are no frames to keep intact)."""
    body = pickle.dumps(pickle.loads(metadata_bytes), protocol=2)
    name = attribute.encode()
    payload = (b"cpathlib\nPosixPath\n" + b"N}X" + len(name).to_bytes(4, "little") + name
               + b"ccollections\nOrderedDict\ns\x86b0")  # state, BUILD, then POP the class
    return body[:2] + payload + body[2:]


@case
def metadata_cannot_change_allowed_classes():
    fabric = make_fabric(WORLD)
    model, opt = _setup(fabric)
    _train(fabric, model, opt)
    root = shared_tmpdir(fabric)
    a = root / "a"
    fabric.save(a, {"model": model, "optimizer": opt})
    good = full_params(model)
    crafted = root / "crafted"
    if fabric.global_rank == 0:
        shutil.copytree(a, crafted)
        crafted_bytes = _build_on_posixpath((a / ".metadata").read_bytes(), MARKER)
        # The control: plain unpickling of these bytes does change the class, so the case can fail.
        pickle.loads(crafted_bytes)
        assert MARKER in vars(pathlib.PosixPath), "the crafted .metadata does not reach BUILD; it proves nothing"
        delattr(pathlib.PosixPath, MARKER)
        (crafted / ".metadata").write_bytes(crafted_bytes)
    fabric.barrier()
    report = {"load": _refused_everywhere(fabric, "BUILD on PosixPath", lambda: _load_fresh(fabric, crafted),
                                          [crafted / ".metadata", "PosixPath"])}
    report["load_raw"] = _refused_everywhere(fabric, "BUILD on PosixPath (load_raw)",
                                             lambda: fabric.load_raw(crafted, _setup(fabric, seed=3)[0]),
                                             [crafted / ".metadata"])
    if fabric.global_rank == 0:
        status, _, err = _cli("inspect", "--verify", str(crafted))
        assert status != 0 and str(crafted / ".metadata") in err, (status, err)
    fabric.barrier()
    changed = [None] * WORLD
    torch.distributed.all_gather_object(changed, MARKER in vars(pathlib.PosixPath))
    assert not any(changed), f"PosixPath was changed on ranks {[r for r, c in enumerate(changed) if c]}"
    # Paths work, and the next, unrelated save and the good checkpoint's load do too.
    assert str(Path("x") / "y") == "x/y"
    fabric.save(root / "after", {"model": model, "optimizer": opt})
    loaded, _ = _load_fresh(fabric, a)
    assert same_tensors(full_params(loaded), good), "the good checkpoint does not load exactly"
    loaded, _ = _load_fresh(fabric, root / "after")
    assert same_tensors(full_params(loaded), good), "the save after the refusal does not load exactly"
    return report


@case
def garbage_metadata_is_one_checkpoint_error_on_every_rank():
    """Issue 26: `.metadata` overwritten with garbage. Before, the allow-list unpickler's `KeyError: 0` reached every
    rank as `KeyError: "Reading the metadata of ... failed on rank 0: 0"`; now a `CheckpointError` naming the file."""
    fabric = make_fabric(WORLD)
    model, opt = _setup(fabric)
    root = shared_tmpdir(fabric)
    damaged = root / "damaged"
    fabric.save(damaged, {"model": model, "optimizer": opt})
    if fabric.global_rank == 0:
        (damaged / ".metadata").write_bytes(b"\x00garbage" * 10)
    fabric.barrier()
    kinds = [_refused_everywhere(fabric, "garbage .metadata", load, [damaged / ".metadata"])
             for load in (lambda: _load_fresh(fabric, damaged),
                          lambda: fabric.load_raw(damaged, _setup(fabric, seed=3)[0]))]
    # The same type on every rank (checked above), and a kind of CheckpointError: ChecksumError here, since the
    # checksums recorded at save are what tells the damage first.
    assert all(kind.split(":")[0] in ("CheckpointError", "ChecksumError") for kind in kinds), kinds
    if fabric.global_rank == 0:
        for argv in (["inspect", str(damaged)], ["convert", str(damaged), str(root / "out.pt"), "--to", "full"]):
            status, out, err = _cli(*argv)
            assert status == 2 and len(err.strip().splitlines()) == 1, (argv, status, err)
            assert str(damaged / ".metadata") in err and "HINT:" in err and not out, (argv, err)
    fabric.barrier()
    return kinds


if __name__ == "__main__":
    run_cases()
