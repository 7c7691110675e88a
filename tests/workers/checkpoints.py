"""Two-rank checkpoint cases: round trips, filters, several models, formats, safety, async saves.

Each case compares exactly (atol=0): checkpoints move bits, they do not compute.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from common import full, full_params, loss_fn, make_fabric, same_tensors, shared_tmpdir, tensor_opt_state, train_steps
from harness import TIMEOUT, case, run_cases
from lightning_fsdp import fabric_load
from models import TinyTransformer, UnevenModel, make_batch

WORLD = 2
# How long a held background write waits for its release before it goes on anyway: a bound on a hang (the cases
# release it within a second), half the process group's timeout, so a hold that runs out times no collective out.
HOLD_S = TIMEOUT.total_seconds() / 2




def _setup(fabric, seed=0, lr=1e-2):
    torch.manual_seed(seed)
    plain = TinyTransformer()
    return fabric.setup(plain, torch.optim.AdamW(plain.parameters(), lr=lr))








class Counter:
    """A Stateful object: saved through state_dict(), restored through load_state_dict()."""

    def __init__(self, n=0):
        self.n = n

    def state_dict(self):
        return {"n": self.n}

    def load_state_dict(self, sd):
        self.n = sd["n"]


@case
def round_trip_is_exact_and_training_continues_identically():
    report = {}
    for kind in ("sharded", "full"):
        fabric = make_fabric(WORLD, state_dict_type=kind)
        model, opt = _setup(fabric)
        train_steps(fabric, model, opt, steps=2)
        path = shared_tmpdir(fabric) / kind
        fabric.save(path, {"model": model, "optimizer": opt, "step": 2, "counter": Counter(5), "extra": [1, 2]})
        saved_params, saved_opt = full_params(model), tensor_opt_state(opt)

        model2, opt2 = _setup(fabric, seed=9)
        counter = Counter()
        state = {"model": model2, "optimizer": opt2, "step": 0, "counter": counter}
        rest = fabric.load(path, state)
        assert state["step"] == 2 and counter.n == 5, (state["step"], counter.n)
        assert rest == {"extra": [1, 2]}, rest
        assert same_tensors(saved_params, full_params(model2)), f"{kind}: parameters differ"
        assert same_tensors(saved_opt, tensor_opt_state(opt2)), f"{kind}: optimizer state differs"
        assert opt2.param_groups[0]["lr"] == 1e-2
        train_steps(fabric, model, opt, steps=2, start=5)
        train_steps(fabric, model2, opt2, steps=2, start=5)
        assert same_tensors(full_params(model), full_params(model2)), f"{kind}: training diverged after resume"
        report[kind] = "exact"
    return report


@case
def missing_key_is_a_key_error_and_strict_false_tolerates_it():
    fabric = make_fabric(WORLD)
    model, opt = _setup(fabric)
    path = shared_tmpdir(fabric) / "ck"
    fabric.save(path, {"model": model})
    try:
        fabric.load(path, {"model": model, "optimizer": opt})
        raise AssertionError("a missing optimizer key was accepted")
    except KeyError as err:
        assert "'optimizer'" in str(err) and "strict=False" in str(err), str(err)
    # strict=False loads what is there into another model (a load into the model that saved would pass doing
    # nothing), and leaves the optimizer, which the checkpoint lacks, as it was.
    saved = full_params(model)
    fresh, fresh_opt = _setup(fabric, seed=3)
    train_steps(fabric, fresh, fresh_opt, steps=1)
    before, opt_before = full_params(fresh), tensor_opt_state(fresh_opt)
    assert not same_tensors(saved, before), "the fresh model already holds the saved weights"
    fabric.load(path, {"model": fresh, "optimizer": fresh_opt}, strict=False)
    assert same_tensors(saved, full_params(fresh)), "strict=False did not load the model that is in the checkpoint"
    assert same_tensors(opt_before, tensor_opt_state(fresh_opt)), "strict=False changed the optimizer it lacks"
    return "ok"


@case
def filters_work_for_sharded_and_full_and_load_with_strict_false():
    report = {}
    only_blocks = {"model": lambda k, v: k.startswith("blocks.")}
    for kind in ("sharded", "full"):
        fabric = make_fabric(WORLD, state_dict_type=kind)
        model, opt = _setup(fabric)
        train_steps(fabric, model, opt, steps=1)
        path = shared_tmpdir(fabric) / kind
        fabric.save(path, {"model": model, "step": 1}, filter=only_blocks)
        saved = full_params(model)
        if kind == "full":
            keys = sorted(torch.load(path, weights_only=True)["model"])
            assert keys and all(k.startswith("blocks.") for k in keys), keys
        fresh, _ = _setup(fabric, seed=3)
        before = full_params(fresh)
        fabric.load(path, {"model": fresh}, strict=False)
        after = full_params(fresh)
        for k in after:
            expected = saved[k] if k.startswith("blocks.") else before[k]
            assert torch.equal(after[k], expected), f"{kind}: {k}"
        report[kind] = "filtered"
    return report


@case
def several_models_and_optimizers_in_one_checkpoint():
    fabric = make_fabric(WORLD)
    gen, gen_opt = _setup(fabric, seed=1)
    disc, disc_opt = _setup(fabric, seed=2)
    train_steps(fabric, gen, gen_opt, steps=1)
    train_steps(fabric, disc, disc_opt, steps=1, start=3)
    path = shared_tmpdir(fabric) / "gan"
    fabric.save(path, {"generator": gen, "discriminator": disc, "opt_d": disc_opt, "opt_g": gen_opt})
    expected = {k: full_params(m) for k, m in (("g", gen), ("d", disc))}
    opts = {k: tensor_opt_state(o) for k, o in (("g", gen_opt), ("d", disc_opt))}
    g2, g2_opt = _setup(fabric, seed=7)
    d2, d2_opt = _setup(fabric, seed=8)
    fabric.load(path, {"generator": g2, "discriminator": d2, "opt_d": d2_opt, "opt_g": g2_opt})
    assert same_tensors(expected["g"], full_params(g2)) and same_tensors(expected["d"], full_params(d2))
    assert same_tensors(opts["g"], tensor_opt_state(g2_opt)) and same_tensors(opts["d"], tensor_opt_state(d2_opt))
    # An optimizer whose model is not in the state is a clear error.
    try:
        fabric.save(path, {"generator": gen, "opt_d": disc_opt})
        raise AssertionError("an optimizer without its model was accepted")
    except ValueError as err:
        assert "'opt_d'" in str(err) and "belong to no model" in str(err), str(err)
    return "ok"


@case
def full_and_sharded_replace_each_other_at_the_same_path():
    report = []
    path = None
    for kind in ("sharded", "full", "sharded"):
        fabric = make_fabric(WORLD, state_dict_type=kind)
        model, opt = _setup(fabric, seed=len(report))
        path = path or shared_tmpdir(fabric) / "ck"
        fabric.save(path, {"model": model, "optimizer": opt})
        assert path.is_dir() == (kind == "sharded"), (kind, path.is_dir())
        other, other_opt = _setup(fabric, seed=99)
        fabric.load(path, {"model": other, "optimizer": other_opt})
        assert same_tensors(full_params(model), full_params(other)), kind
        report.append(kind)
    leftovers = [p.name for p in path.parent.iterdir() if p.name != path.name]
    assert not leftovers, f"staging or backup copies left behind: {leftovers}"
    return report


@case
def bad_save_arguments_are_clear_errors():
    fabric = make_fabric(WORLD)
    model, opt = _setup(fabric)
    path = shared_tmpdir(fabric) / "ck"
    outcomes = {}
    for label, call, exc, needle in (
        ("storage_options", lambda: fabric.strategy.save_checkpoint(path, {"model": model}, storage_options="x"),
         TypeError, "storage_options"),
        ("no_model", lambda: fabric.save(path, {"step": 1}), ValueError, "holds no model"),
        ("not_set_up", lambda: fabric.save(path, {"model": TinyTransformer()}), ValueError, "not set up"),
    ):
        try:
            call()
            outcomes[label] = "accepted"
        except exc as err:
            assert needle in str(err) and "HINT" in str(err), str(err)
            outcomes[label] = type(err).__name__
    assert set(outcomes.values()) <= {"TypeError", "ValueError"}, outcomes
    return outcomes


def _same_error_everywhere(fabric, what: str, load, must_name: Path) -> dict:
    """``load`` fails on every rank with the same error type and a message naming ``must_name``."""
    start = time.monotonic()
    try:
        load()
    except Exception as err:  # noqa: BLE001 - its type is compared across ranks below
        error = err
    else:
        error = None
    seen = [None] * WORLD
    outcome = None if error is None else (type(error).__name__, str(error))
    torch.distributed.all_gather_object(seen, outcome)
    assert all(o is not None for o in seen), f"{what}: the load succeeded on ranks {[r for r, o in enumerate(seen) if o is None]}"
    types = {t for t, _ in seen}
    assert len(types) == 1, f"{what}: different errors on the ranks: {seen}"
    unnamed = [r for r, (_, m) in enumerate(seen) if str(must_name) not in m]
    assert not unnamed, f"{what}: the error on ranks {unnamed} does not name {must_name}: {seen}"
    return {"type": types.pop(), "seconds": round(time.monotonic() - start, 2), "message": seen[0][1][-200:]}


@case
def corrupted_checkpoints_fail_on_every_rank_naming_the_file():
    """Truncated files (each a different reader: a DCP shard, meta.pt, a full file) and a missing shard. Flipped bytes
    and copied shards are in ``integrity.py``."""
    report = {}
    fabric = make_fabric(WORLD)
    model, opt = _setup(fabric)
    root = shared_tmpdir(fabric)
    sharded = root / "sharded"
    fabric.save(sharded, {"model": model, "optimizer": opt})
    full_fabric = make_fabric(WORLD, state_dict_type="full")
    full_path = root / "full.pt"
    full_fabric.save(full_path, {"model": model, "optimizer": opt})
    fabric.barrier()
    # Each victim, and what the error must name: the file itself, except for meta.pt, whose reader names the
    # checkpoint directory.
    victims = {
        "truncated shard": (sharded / "__1_0.distcp", sharded / "__1_0.distcp"),
        "truncated meta": (sharded / "meta.pt", sharded),
        "truncated full": (full_path, full_path),
        "missing shard": (sharded / "__0_0.distcp", sharded / "__0_0.distcp"),
    }
    for label, (victim, named) in victims.items():
        if fabric.global_rank == 0:
            data = victim.read_bytes()
            if label.startswith("missing"):
                victim.unlink()
            else:
                victim.write_bytes(data[: len(data) // 2])
        fabric.barrier()
        target = full_path if label == "truncated full" else sharded
        report[label] = _same_error_everywhere(
            fabric, label, lambda: fabric.load(target, {"model": model, "optimizer": opt}), named)
        if fabric.global_rank == 0:
            victim.write_bytes(data)
        fabric.barrier()
    return report


@case
def unpickling_needs_an_explicit_opt_in():
    fabric = make_fabric(WORLD, state_dict_type="full")
    model, opt = _setup(fabric)
    path = shared_tmpdir(fabric) / "ck.pt"
    fabric.save(path, {"model": model})
    # Add an arbitrary object to the file, as another tool might have written it: only full unpickling restores it.
    if fabric.global_rank == 0:
        contents = torch.load(path, weights_only=True)
        contents["config"] = Counter(3)
        torch.save(contents, path)
    fabric.barrier()
    try:
        fabric.load(path, {"model": model})
        raise AssertionError("arbitrary unpickling happened without opt-in")
    except Exception as err:  # noqa: BLE001
        assert "weights_only=False" in str(err), str(err)
    # `fabric_load` is `fabric.load` on Lightning 2.6 and reaches `weights_only` on 2.5, whose `fabric.load` lacks it.
    rest = fabric_load(fabric, path, {"model": model}, weights_only=False)
    assert isinstance(rest["config"], Counter) and rest["config"].n == 3
    return "ok"


@case
def sharded_entries_that_need_unpickling_need_the_opt_in_too():
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    fabric = make_fabric(WORLD)
    model, opt = _setup(fabric)
    train_steps(fabric, model, opt, steps=1)
    path = shared_tmpdir(fabric) / "pickled"
    inner = model.module  # Fabric's wrapper would prefix every name with `_forward_module.`
    optimizer_state = get_optimizer_state_dict(inner, opt.optimizer)
    # An arbitrary object where the optimizer expects a plain value, as a tampered or foreign file might hold.
    optimizer_state["param_groups"][0]["lr"] = Counter(3)
    dcp.save({"model": get_model_state_dict(inner), "optimizer": optimizer_state}, checkpoint_id=path)
    try:
        fabric.load(path, {"model": model, "optimizer": opt})
        raise AssertionError("a DCP entry was unpickled without the opt-in")
    except Exception as err:  # noqa: BLE001
        assert "weights_only=False" in str(err) and ".lr'" in str(err), str(err)
    fabric_load(fabric, path, {"model": model, "optimizer": opt}, weights_only=False)
    assert isinstance(opt.param_groups[0]["lr"], Counter), "the opted-in load did not restore the entry"
    return "ok"


@case
def plain_single_device_checkpoint_loads_into_the_sharded_model():
    fabric = make_fabric(WORLD)
    torch.manual_seed(4)
    plain = TinyTransformer()
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    loss_fn(plain, make_batch(0, 0)).backward()
    plain_opt.step()
    path = shared_tmpdir(fabric) / "plain.pt"
    if fabric.global_rank == 0:
        torch.save({"model": plain.state_dict(), "optimizer": plain_opt.state_dict()}, path)
    fabric.barrier()
    model, opt = _setup(fabric, seed=11)
    fabric.load(path, {"model": model, "optimizer": opt})
    assert same_tensors({k: v for k, v in plain.state_dict().items()}, full_params(model))
    names = [n for n, _ in plain.named_parameters()]
    expected = {(names[i], k): v for i, s in plain_opt.state_dict()["state"].items() for k, v in s.items()}
    got_sd = opt.state_dict()
    got = {}
    order = [n.removeprefix("_forward_module.") for n, _ in model.named_parameters()]
    for i, s in got_sd["state"].items():
        for k, v in s.items():
            got[(order[i], k)] = full(v)
    assert expected.keys() == got.keys() and all(torch.equal(expected[k], got[k]) for k in expected)
    return "ok"


@case
def async_save_returns_early_and_the_checkpoint_is_complete():
    import threading

    import torch.distributed.checkpoint.filesystem as fs

    fabric = make_fabric(WORLD, async_save=True)
    model, opt = _setup(fabric)
    train_steps(fabric, model, opt, steps=2)
    root = shared_tmpdir(fabric)
    # The write blocks until released, so a save that returns before the release has returned mid-write. (A
    # synchronous save would sit in it until HOLD_S and return with the checkpoint in place.) The hold is a bound on
    # a hang, not a timing: the test releases it as soon as it has looked, a fraction of a second later.
    release, writing = threading.Event(), threading.Event()
    original = fs.FileSystemWriter.write_data

    def slow_write(self, plan, planner):
        writing.set()
        release.wait(timeout=HOLD_S)
        return original(self, plan, planner)

    fs.FileSystemWriter.write_data = slow_write
    try:
        fabric.save(root / "first", {"model": model, "optimizer": opt, "step": 2})
        returned_mid_write = not release.is_set() and not (root / "first").exists()
        in_flight = fabric.strategy._background_saves.in_flight
        assert returned_mid_write and in_flight, (
            f"the async save returned only after its write (in flight: {in_flight})")
        assert writing.wait(timeout=HOLD_S), "the background write never started"
        first_params, first_opt = full_params(model), tensor_opt_state(opt)
        train_steps(fabric, model, opt, steps=2, start=2)  # training goes on while the write is held
        assert not (root / "first").exists(), "the checkpoint appeared before its write was released"
    finally:
        release.set()
        fs.FileSystemWriter.write_data = original
    fabric.save(root / "second", {"model": model, "optimizer": opt, "step": 4})  # waits for the first first
    assert (root / "first").is_dir(), "the next save did not wait for the first one to be moved into place"
    second_params = full_params(model)
    assert not same_tensors(first_params, second_params), "training did not change the parameters"
    for name, params, step in (("first", first_params, 2), ("second", second_params, 4)):
        other, other_opt = _setup(fabric, seed=5)
        state = {"model": other, "optimizer": other_opt, "step": 0}
        fabric.load(root / name, state)  # waits for the second save
        assert state["step"] == step and same_tensors(params, full_params(other)), name
        if name == "first":
            assert same_tensors(first_opt, tensor_opt_state(other_opt)), "optimizer state of the first save differs"
    return {"returned_mid_write": returned_mid_write, "in_flight": in_flight}


@case
def consecutive_async_saves_with_training_between_each_load_their_own_state():
    """Background saves stage into host copies reused from save to save (`checkpoint/staging.py`). The second save
    must not overwrite them while the first save's write still reads them: the first write is held while training
    goes on and the second save is called, and each checkpoint must load back exactly the state at its own save."""
    import threading

    import torch.distributed.checkpoint.filesystem as fs

    fabric = make_fabric(WORLD, async_save=True)
    model, opt = _setup(fabric)
    train_steps(fabric, model, opt, steps=2)
    root = shared_tmpdir(fabric)
    saves = fabric.strategy._background_saves
    release = threading.Event()
    original = fs.FileSystemWriter.write_data

    def held_write(self, plan, planner):
        release.wait(timeout=HOLD_S)
        return original(self, plan, planner)

    def host_copies() -> dict:
        return {where: host.data_ptr() for where, (_, host, _) in saves._stager._kept.items()}

    expected = {}
    fs.FileSystemWriter.write_data = held_write
    try:
        expected["first"] = (full_params(model), tensor_opt_state(opt), 2)
        fabric.save(root / "first", {"model": model, "optimizer": opt, "step": 2})
        first_copies = host_copies()
        train_steps(fabric, model, opt, steps=2, start=2)  # the first write is still held
        expected["second"] = (full_params(model), tensor_opt_state(opt), 4)
        timer = threading.Timer(1.0, release.set)  # released while the second save waits for the first
        timer.start()
        fabric.save(root / "second", {"model": model, "optimizer": opt, "step": 4})
        timer.join()
        reused = host_copies() == first_copies and len(first_copies) > 0
        train_steps(fabric, model, opt, steps=2, start=4)  # changes the live state while the second write runs
    finally:
        release.set()
        fs.FileSystemWriter.write_data = original
    assert reused, "the second background save did not stage into the first save's host copies"
    assert not same_tensors(expected["first"][0], expected["second"][0]), "training did not change the parameters"
    for name, (params, opt_state, step) in expected.items():
        other, other_opt = _setup(fabric, seed=5)
        state = {"model": other, "optimizer": other_opt, "step": 0}
        fabric.load(root / name, state)
        assert state["step"] == step, (name, state["step"])
        assert same_tensors(params, full_params(other)), f"the {name} checkpoint's parameters are not those at its save"
        assert same_tensors(opt_state, tensor_opt_state(other_opt)), f"the {name} checkpoint's optimizer state differs"
    return {"host_copies_reused": len(first_copies)}


@case
def async_staging_keeps_each_dtensor_on_its_host_copy():
    """A background save stages every DTensor shard into a host copy and writes that copy. On a CUDA mesh,
    ``DTensor.from_local`` moves a host tensor to the GPU, so wrapping the host copy with it gave DCP a separate GPU
    tensor, copied before the host copy was filled: checkpoints of uninitialized memory, found on an H100. Here
    ``from_local`` is made to copy as it does there, and the save must still load back exactly."""
    from torch.distributed.tensor import DTensor

    fabric = make_fabric(WORLD, async_save=True)
    model, opt = _setup(fabric)
    train_steps(fabric, model, opt, steps=2)
    root = shared_tmpdir(fabric)
    original = DTensor.from_local

    def as_on_another_device(local, *args, **kwargs):
        return original(torch.full_like(local, float("nan")), *args, **kwargs)  # a different tensor, not filled

    expected = (full_params(model), tensor_opt_state(opt))
    DTensor.from_local = staticmethod(as_on_another_device)
    try:
        fabric.save(root / "ckpt", {"model": model, "optimizer": opt})  # returns once staged
    finally:
        DTensor.from_local = original
    kept = fabric.strategy._background_saves._stager._kept.values()
    shared = [staged.to_local().data_ptr() == host.data_ptr() for _, host, staged in kept if isinstance(staged, DTensor)]
    assert shared and all(shared), f"{shared.count(False)} of {len(shared)} staged DTensors do not hold their host copy"
    other, other_opt = _setup(fabric, seed=5)
    fabric.load(root / "ckpt", {"model": other, "optimizer": other_opt})
    assert same_tensors(expected[0], full_params(other)), "the parameters loaded are not those saved"
    assert same_tensors(expected[1], tensor_opt_state(other_opt)), "the optimizer state loaded is not that saved"
    return {"staged_dtensors": len(shared)}


@case
def async_save_errors_surface_at_the_next_call():
    fabric = make_fabric(WORLD, async_save=True)
    model, opt = _setup(fabric)
    path = shared_tmpdir(fabric) / "async"
    import torch.distributed.checkpoint.filesystem as fs

    original = fs.FileSystemWriter.write_data

    def broken(self, plan, planner):
        raise OSError("disk full (injected)")

    fs.FileSystemWriter.write_data = broken
    try:
        fabric.save(path, {"model": model})
        try:
            fabric.save(path, {"model": model})
            raise AssertionError("the background error was swallowed")
        except Exception as err:  # noqa: BLE001
            assert "disk full (injected)" in str(err) or "disk full" in repr(err.__cause__), repr(err)
            message = str(err)
    finally:
        fs.FileSystemWriter.write_data = original
    assert not path.exists(), "a failed background save left a checkpoint behind"
    fabric.save(path, {"model": model})
    fabric.strategy._background_saves.wait(fabric.strategy._engine)
    assert path.is_dir()
    return message[:300]


def _exact(got: dict, expected: dict, what: str) -> None:
    """Same keys, and per key the same dtype, shape and values: a full file moves bits, it does not compute."""
    assert sorted(got, key=str) == sorted(expected, key=str), f"{what}: keys {sorted(set(got) ^ set(expected))}"
    for k, e in expected.items():
        g = got[k]
        assert g.dtype == e.dtype and g.shape == e.shape and torch.equal(g, e), f"{what}: {k} differs: {g} != {e}"


def _named_opt_state(model, opt) -> dict:
    """The optimizer's state as full tensors keyed (parameter name, state key), the way a full file keys it."""
    names = [n.removeprefix("_forward_module.") for n, _ in model.named_parameters()]
    return {(names[i], k): v for (i, k), v in tensor_opt_state(opt).items()}


def _on_rank_0(fabric, check) -> None:
    """Run ``check`` on rank 0 and fail on every rank if it fails, so the next case starts in step on all ranks."""
    error = None
    if fabric.global_rank == 0:
        try:
            check()
        except Exception as err:  # noqa: BLE001 - re-raised below, with its traceback on rank 0
            error = err
    message = fabric.broadcast(None if error is None else f"{type(error).__name__}: {error}")
    if error is not None:
        raise error
    if message is not None:
        raise AssertionError(f"failed on rank 0: {message}")


def _uneven_setup(fabric, seed: int):
    torch.manual_seed(seed)
    plain = UnevenModel()
    return fabric.setup(plain, torch.optim.AdamW(plain.parameters(), lr=1e-2))


@case
def uneven_shapes_and_views_in_a_full_checkpoint_read_back_exactly():
    """Parameters whose dim 0 does not divide by the world size, and views among the other entries: the file must
    hold exactly their elements, readable by plain torch.load (which checks every record's size) and with mmap."""
    report = {}
    for sharding in ("FULL_SHARD", "SHARD_GRAD_OP"):
        fabric = make_fabric(WORLD, state_dict_type="full", sharding_strategy=sharding)
        model, opt = _uneven_setup(fabric, seed=0)
        for step in range(2):
            fabric.backward(model(make_batch(step, fabric.global_rank)))
            opt.step()
            opt.zero_grad()
        uneven = sorted(k for k, v in full_params(model).items() if v.shape[0] % WORLD)
        assert {"lm.embed.weight", "lm.head.weight", "cls.weight", "row"} <= set(uneven), uneven
        history = torch.arange(12.0)
        extras = {"recent": history[8:], "window": history.view(3, 4).t()[1:], "last": history[11],
                  "none_yet": history[12:]}  # an offset view, a transposed slice, a 0-d view, an empty view
        path = shared_tmpdir(fabric) / f"{sharding}.pt"
        fabric.save(path, {"model": model, "optimizer": opt, **extras})
        saved_params, saved_opt = full_params(model), _named_opt_state(model, opt)
        expected_extras = {k: v.contiguous() for k, v in extras.items()}

        def read_back() -> None:
            for mmap in (False, True):
                contents = torch.load(path, weights_only=True, mmap=mmap)
                _exact(contents["model"], saved_params, f"{sharding} mmap={mmap} model")
                state = contents["optimizer"]["state"]
                _exact({(p, k): v for p, s in state.items() for k, v in s.items()}, saved_opt,
                       f"{sharding} mmap={mmap} optimizer")
                _exact({k: contents[k] for k in extras}, expected_extras, f"{sharding} mmap={mmap} extras")

        _on_rank_0(fabric, read_back)
        # The project's loader, into a fresh model and optimizer that hold other values (no state at all yet).
        fresh, fresh_opt = _uneven_setup(fabric, seed=9)
        assert not same_tensors(saved_params, full_params(fresh)) and not tensor_opt_state(fresh_opt)
        rest = fabric.load(path, {"model": fresh, "optimizer": fresh_opt})
        _exact(full_params(fresh), saved_params, f"{sharding} fabric.load model")
        _exact(_named_opt_state(fresh, fresh_opt), saved_opt, f"{sharding} fabric.load optimizer")
        _exact(rest, expected_extras, f"{sharding} fabric.load extras")
        report[sharding] = {"uneven": uneven}
    return report


@case
def uneven_shapes_convert_exactly_from_a_sharded_checkpoint():
    """A sharded checkpoint of the uneven model, converted offline to one full file, holds what a full save does."""
    from lightning_fsdp.checkpoint.convert import convert

    fabric = make_fabric(WORLD, state_dict_type="sharded")
    model, opt = _uneven_setup(fabric, seed=1)
    fabric.backward(model(make_batch(0, fabric.global_rank)))
    opt.step()
    root = shared_tmpdir(fabric)
    history = torch.arange(12.0)
    fabric.save(root / "sharded", {"model": model, "optimizer": opt, "recent": history[8:]})
    saved_params, saved_opt = full_params(model), _named_opt_state(model, opt)

    def convert_and_read_back() -> None:
        convert(root / "sharded", root / "converted.pt", to="full")
        for mmap in (False, True):
            contents = torch.load(root / "converted.pt", weights_only=True, mmap=mmap)
            _exact(contents["model"], saved_params, f"mmap={mmap} model")
            state = contents["optimizer"]["state"]
            _exact({(p, k): v for p, s in state.items() for k, v in s.items()}, saved_opt, f"mmap={mmap} optimizer")
            _exact({"recent": contents["recent"]}, {"recent": torch.tensor([8.0, 9, 10, 11])}, f"mmap={mmap} recent")

    _on_rank_0(fabric, convert_and_read_back)
    fresh, fresh_opt = _uneven_setup(fabric, seed=9)
    rest = fabric.load(root / "converted.pt", {"model": fresh, "optimizer": fresh_opt})
    _exact(full_params(fresh), saved_params, "fabric.load model")
    _exact(_named_opt_state(fresh, fresh_opt), saved_opt, "fabric.load optimizer")
    _exact(rest, {"recent": torch.tensor([8.0, 9, 10, 11])}, "fabric.load extras")
    return "exact"


class WithPooler(TinyTransformer):
    """A head that only some steps use (a pooler, a validation-only head): until then it has no gradient, and its
    optimizer has no state for it."""

    def __init__(self) -> None:
        super().__init__()
        self.pooler = torch.nn.Linear(16, 16)


def _pooler_steps(fabric, model, opt, start: int, steps: int, use_pooler: bool) -> None:
    for step in range(start, start + steps):
        batch = make_batch(step, fabric.global_rank)
        loss = loss_fn(model, batch)
        if use_pooler:
            loss = loss + model.pooler(model.embed(batch)).square().mean()
        fabric.backward(loss)
        opt.step()
        opt.zero_grad()


@case
def never_stepped_parameters_load_as_no_state_and_training_matches():
    """Issue 37 item 4: a checkpoint whose optimizer never stepped the pooler loads strictly (it was refused:
    "missing from the checkpoint: 2 ('pooler.bias', 'pooler.weight')"), the pooler gets no optimizer state (not the
    zero state and step count 1 that made later steps differ), and the steps after the load, which train the pooler,
    match the unbroken run exactly; strict and not, sharded and full. A parameter the checkpoint's optimizer never
    had at all is still missing under `strict`."""
    report = {}
    for kind in ("sharded", "full"):
        fabric = make_fabric(WORLD, state_dict_type=kind)

        def setup(seed, only=None):
            torch.manual_seed(seed)
            plain = WithPooler()
            params = [p for n, p in plain.named_parameters() if only is None or only(n)]
            model, opt = fabric.setup(plain, torch.optim.AdamW(params, lr=1e-2))
            return model, opt

        model, opt = setup(0)
        _pooler_steps(fabric, model, opt, 0, 2, use_pooler=False)
        path = shared_tmpdir(fabric) / kind
        fabric.save(path, {"model": model, "optimizer": opt})
        _pooler_steps(fabric, model, opt, 2, 2, use_pooler=True)
        expected, expected_opt = full_params(model), tensor_opt_state(opt)
        for strict in (True, False):
            resumed, resumed_opt = setup(9)
            fabric.load(path, {"model": resumed, "optimizer": resumed_opt}, strict=strict)
            pooler_state = [dict(resumed_opt.state.get(p, {})) for p in resumed.pooler.parameters()]
            assert pooler_state == [{}, {}], (kind, strict, pooler_state)
            _pooler_steps(fabric, resumed, resumed_opt, 2, 2, use_pooler=True)
            _exact(full_params(resumed), expected, f"{kind} strict={strict}: weights after the load and 2 steps")
            _exact(tensor_opt_state(resumed_opt), expected_opt, f"{kind} strict={strict}: optimizer state")
        # Saved before the first step: every parameter never stepped. The load gives no state at all (it gave the
        # zero state the save's state-dict call makes, with a step count of 1), and the first step matches.
        first, first_opt = setup(0)
        first_path = shared_tmpdir(fabric) / f"{kind}-step0"
        fabric.save(first_path, {"model": first, "optimizer": first_opt})
        _pooler_steps(fabric, first, first_opt, 0, 1, use_pooler=True)
        resumed, resumed_opt = setup(9)
        fabric.load(first_path, {"model": resumed, "optimizer": resumed_opt})
        assert not resumed_opt.state, f"{kind}: state for {len(resumed_opt.state)} parameters after the load"
        _pooler_steps(fabric, resumed, resumed_opt, 0, 1, use_pooler=True)
        _exact(full_params(resumed), full_params(first), f"{kind}: the first step after loading a step-0 checkpoint")
        # Really missing: the optimizer that saved this did not have the pooler at all.
        partial, partial_opt = setup(0, only=lambda name: not name.startswith("pooler"))
        partial_path = shared_tmpdir(fabric) / f"{kind}-partial"
        fabric.save(partial_path, {"model": partial, "optimizer": partial_opt})
        resumed, resumed_opt = setup(9)
        try:
            fabric.load(partial_path, {"model": resumed, "optimizer": resumed_opt})
        except KeyError as err:
            assert "missing from the checkpoint: 2 ('pooler.bias', 'pooler.weight')" in str(err), str(err)
        else:
            raise AssertionError(f"{kind}: a parameter the checkpoint's optimizer never had was accepted")
        report[kind] = "ok"
    return report


if __name__ == "__main__":
    run_cases()
