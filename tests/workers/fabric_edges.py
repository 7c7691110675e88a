"""Two-rank edge cases: setup orders, nesting, odd shapes, optimizers with habits, and checkpoint paths that hold
something already. Most of these were bugs once; each case pins the fix."""

from __future__ import annotations

import tempfile
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from common import (
    accumulate_three_micro_batches,
    full,
    full_params,
    global_batch,
    loss_fn,
    make_fabric,
    max_param_diff,
    model_and_reference,
    sgd,
)
from harness import case, run_cases
from models import TinyTransformer, make_batch

WORLD = 2


def _tmpdir(fabric) -> Path:
    return Path(fabric.broadcast(tempfile.mkdtemp()))


def _trained(fabric, make_optimizer=sgd):
    torch.manual_seed(0)
    plain = TinyTransformer()
    model, opt = fabric.setup(plain, make_optimizer(plain))
    fabric.backward(loss_fn(model, make_batch(0, fabric.global_rank)))
    opt.step()
    opt.zero_grad()
    return model, opt


@case
def separate_setup_remaps_an_optimizer_built_before_setup_module():
    fabric = make_fabric(WORLD)
    torch.manual_seed(0)
    plain = TinyTransformer()
    opt = sgd(plain)  # built from the unsharded parameters
    model = fabric.setup_module(plain)
    opt = fabric.setup_optimizers(opt)
    torch.manual_seed(0)
    reference = TinyTransformer()
    ref_opt = sgd(reference)
    fabric.backward(loss_fn(model, make_batch(0, fabric.global_rank)))
    loss_fn(reference, global_batch(0, WORLD)).backward()
    opt.step()
    ref_opt.step()
    return {"diff": max_param_diff(model, reference, 1e-5)}


@case
def optimizer_with_parameters_of_no_model_is_refused():
    fabric = make_fabric(WORLD)
    model = TinyTransformer()
    stray = nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([{"params": model.parameters()}, {"params": [stray]}], lr=0.1)
    try:
        fabric.setup(model, opt)
    except ValueError as err:
        assert "belong to no model" in str(err) and "(3,)" in str(err) and "HINT" in str(err), str(err)
        return str(err)
    raise AssertionError("an optimizer with a stray parameter was accepted")


class Narrow(nn.Module):
    """A head with one output row: on 2 ranks, rank 1's shard of it is empty."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(8, 16)
        self.head = nn.Linear(16, 1)

    def forward(self, x):
        return self.head(torch.relu(self.body(x)))


@case
def clip_norms_with_empty_shards_match_reference():
    report = {}
    for norm_type in (2.0, float("inf"), 1.0):
        fabric = make_fabric(WORLD)
        torch.manual_seed(0)
        plain = Narrow()
        model, opt = fabric.setup(plain, torch.optim.SGD(plain.parameters(), lr=0.1))
        torch.manual_seed(0)
        reference = Narrow()
        x = torch.randn(4 * WORLD, 8, generator=torch.Generator().manual_seed(3))
        mine = x[4 * fabric.global_rank: 4 * (fabric.global_rank + 1)]
        fabric.backward(model(mine).pow(2).mean())
        reference(x).pow(2).mean().backward()
        got = fabric.clip_gradients(model, opt, max_norm=1e-3, norm_type=norm_type).item()
        expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), 1e-3, norm_type=norm_type).item()
        assert abs(got - expected) <= 1e-5 * max(1.0, expected), (norm_type, got, expected)
        for name, param in model.named_parameters():
            ref_grad = dict(reference.named_parameters())[name.replace("_forward_module.", "")].grad
            assert torch.allclose(full(param.grad), ref_grad, atol=1e-7), name
        report[str(norm_type)] = got
    return report


@case
def replicas_agree_although_ranks_seeded_differently():
    report = {}
    for meta in (False, True):
        fabric = make_fabric(WORLD, sharding_strategy="NO_SHARD")
        torch.manual_seed(100 + fabric.global_rank)
        with fabric.init_module(empty_init=meta):
            model = TinyTransformer()
        model = fabric.setup_module(model)
        sums = [None] * WORLD
        dist.all_gather_object(sums, {k: full(v).double().sum().item() for k, v in model.state_dict().items()})
        assert sums[0] == sums[1], f"replicas differ (meta={meta})"
        report[f"meta={meta}"] = "equal"
    return report


@case
def no_shard_refuses_a_1d_mesh():
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_fsdp.fabric import FSDPStrategy

    mesh = init_device_mesh("cpu", (WORLD,))
    try:
        FSDPStrategy(sharding_strategy="NO_SHARD", device_mesh=mesh)
    except ValueError as err:
        assert "NO_SHARD" in str(err) and "(world_size, 1)" in str(err), str(err)
        return str(err)
    raise AssertionError("NO_SHARD accepted a 1-D mesh, which would shard")


@case
def nested_no_backward_sync_keeps_sync_off_until_the_outer_block_ends():
    fabric = make_fabric(WORLD)
    model, opt, reference, ref_opt = model_and_reference(fabric)
    with fabric.no_backward_sync(model):
        with fabric.no_backward_sync(model):
            fabric.backward(loss_fn(model, make_batch(0, fabric.global_rank)) / 3)
        # Sync must still be off here: this micro-batch accumulates locally. Results alone cannot show it (an early
        # reduce-scatter sums to the same gradients); the sharded gradients can: they appear only once FSDP
        # reduce-scatters.
        fabric.backward(loss_fn(model, make_batch(1, fabric.global_rank)) / 3)
        reduced = [n for n, p in model.named_parameters() if p.grad is not None]
        assert not reduced, f"gradients were communicated inside the outer block: {reduced[:3]}"
    fabric.backward(loss_fn(model, make_batch(2, fabric.global_rank)) / 3)
    for micro in range(3):
        (loss_fn(reference, global_batch(micro, WORLD)) / 3).backward()
    opt.step()
    ref_opt.step()
    return {"diff": max_param_diff(model, reference, 1e-5), "plain": accumulate_three_micro_batches(fabric, 1e-5)}


@case
def lbfgs_trains_after_joint_setup():
    fabric = make_fabric(WORLD)
    torch.manual_seed(0)
    plain = TinyTransformer()
    model, opt = fabric.setup(plain, torch.optim.LBFGS(plain.parameters(), lr=0.1, max_iter=2))
    before = full_params(model)
    batch = make_batch(0, fabric.global_rank)

    def closure():
        opt.zero_grad()
        loss = loss_fn(model, batch)
        fabric.backward(loss)
        return loss

    opt.step(closure)
    after = full_params(model)
    moved = max((after[k] - before[k]).abs().max().item() for k in before)
    assert moved > 1e-4, f"LBFGS changed nothing ({moved})"
    return {"moved": moved}


@case
def saving_before_the_first_step_leaves_the_optimizer_alone():
    fabric = make_fabric(WORLD)
    torch.manual_seed(0)
    plain = TinyTransformer()
    model, opt = fabric.setup(plain, torch.optim.Adam(plain.parameters(), lr=1e-2, weight_decay=0.1))
    fabric.save(_tmpdir(fabric) / "step0", {"model": model, "optimizer": opt})
    assert len(opt.state) == 0, f"saving created optimizer state for {len(opt.state)} parameters"
    return "ok"


@case
def saving_never_overwrites_user_files():
    fabric = make_fabric(WORLD)
    model, opt = _trained(fabric)
    root = _tmpdir(fabric)
    user_file = root / "train.py"
    user_dir = root / "data"
    if fabric.global_rank == 0:
        user_file.write_text("print('mine')\n")
        user_dir.mkdir()
        (user_dir / "x.txt").write_text("keep")
    fabric.barrier()
    outcomes = {}
    for target, expected in ((user_file, FileExistsError), (user_dir, IsADirectoryError)):
        try:
            fabric.save(target, {"model": model})
            outcomes[target.name] = "saved"
        except expected as err:
            assert str(target) in str(err), str(err)
            outcomes[target.name] = type(err).__name__
    # A checkpoint directory that also holds a user's note is not replaced either.
    ckpt = root / "ckpt"
    fabric.save(ckpt, {"model": model})
    if fabric.global_rank == 0:
        (ckpt / "notes.txt").write_text("keep")
    fabric.barrier()
    try:
        fabric.save(ckpt, {"model": model})
        outcomes["ckpt"] = "saved"
    except IsADirectoryError as err:
        assert "notes.txt" in str(err), str(err)
        outcomes["ckpt"] = "IsADirectoryError"
    assert outcomes == {"train.py": "FileExistsError", "data": "IsADirectoryError", "ckpt": "IsADirectoryError"}
    assert user_file.read_text() == "print('mine')\n" and (user_dir / "x.txt").read_text() == "keep"
    assert (ckpt / "notes.txt").read_text() == "keep"
    return outcomes


@case
def load_recovers_a_checkpoint_left_aside_by_a_crashed_save():
    from lightning_fsdp.checkpoint.io.atomic import backup_path

    fabric = make_fabric(WORLD)
    model, opt = _trained(fabric)
    path = _tmpdir(fabric) / "ckpt"
    fabric.save(path, {"model": model, "optimizer": opt, "step": 1})
    if fabric.global_rank == 0:
        path.rename(backup_path(path))  # the state a save leaves when killed between its two renames
    fabric.barrier()
    saved = full_params(model)
    saved_opt = {(i, k): full(v).clone() for i, s in opt.state_dict()["state"].items() for k, v in s.items()}
    # Into a fresh model and optimizer (other weights, no state): what loads must be the checkpoint itself.
    torch.manual_seed(9)
    plain = TinyTransformer()
    fresh, fresh_opt = fabric.setup(plain, sgd(plain))
    state = {"model": fresh, "optimizer": fresh_opt, "step": 0}
    fabric.load(path, state)
    assert state["step"] == 1 and path.is_dir() and not backup_path(path).exists()
    got = full_params(fresh)
    assert all(torch.equal(got[k], saved[k]) for k in saved), "parameters differ from the recovered checkpoint"
    got_opt = {(i, k): full(v) for i, s in fresh_opt.state_dict()["state"].items() for k, v in s.items()}
    assert saved_opt and got_opt.keys() == saved_opt.keys(), (sorted(got_opt), sorted(saved_opt))
    assert all(torch.equal(got_opt[k], saved_opt[k]) for k in saved_opt), "optimizer state differs"
    return "recovered"


@case
def load_raw_finds_the_model_under_any_key():
    fabric = make_fabric(WORLD)
    model, _ = _trained(fabric)
    path = _tmpdir(fabric) / "raw"
    fabric.save(path, {"module": model})
    torch.manual_seed(5)
    other = fabric.setup_module(TinyTransformer())
    fabric.load_raw(path, other)
    a, b = full_params(model), full_params(other)
    assert all(torch.equal(a[k], b[k]) for k in a)
    return "ok"


@case
def fsdp1_keyword_arguments_are_accepted_with_a_warning():
    from lightning_fsdp.fabric import FSDPStrategy

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        FSDPStrategy(use_orig_params=True, limit_all_gathers=True)
    messages = [str(w.message) for w in caught]
    assert any("use_orig_params" in m and "ignored" in m for m in messages), messages
    return messages


@case
def all_reduce_mean_stays_in_the_tensor_passed():
    fabric = make_fabric(WORLD)
    value = torch.tensor(float(fabric.global_rank + 2))  # 2 and 3
    out = fabric.all_reduce(value, reduce_op="mean")
    assert value.item() == 2.5 and out.item() == 2.5, (value, out)
    return value.item()


@case
def teardown_works_without_checkpoint_io():
    fabric = make_fabric(WORLD)
    fabric.strategy.teardown()
    return "ok"


@case
def preemption_agreement_is_one_all_reduce_of_one_integer_per_step():
    """docs/guides/preemption.md: the ranks agree through one all-reduce of one integer per step. Counted by
    patching torch.distributed.all_reduce around each step's `requested()`; after a signal, one more all-reduce
    agrees on it, and once agreed nothing more is sent."""
    import os
    import signal

    from lightning_fsdp.preemption import Preemption

    fabric = make_fabric(WORLD)
    model, opt, _, _ = model_and_reference(fabric)
    preemption = Preemption(action="stop").install()
    original = dist.all_reduce
    per_step = []
    try:
        for step in range(4):
            fabric.backward(loss_fn(model, make_batch(step, fabric.global_rank)))
            opt.step()
            opt.zero_grad()
            if step == 2 and fabric.global_rank == 1:
                os.kill(os.getpid(), signal.SIGTERM)  # only rank 1 gets the signal
            calls = []

            def counted(tensor, *args, calls=calls, **kwargs):
                calls.append((tensor.numel(), str(tensor.dtype)))
                return original(tensor, *args, **kwargs)

            dist.all_reduce = counted
            try:
                agreed = preemption.requested()
            finally:
                dist.all_reduce = original
            per_step.append((agreed, calls))
    finally:
        preemption.uninstall()
    one_integer = [(1, "torch.int64")]
    assert per_step == [(False, one_integer), (False, one_integer), (True, one_integer), (True, [])], per_step
    return {"per_step": per_step}


def _process_groups() -> int:
    return len(dist.distributed_c10d._world.pg_map)


@case
def strategies_set_up_one_after_another_share_each_mesh_and_add_no_groups():
    """A sweep sets up strategy after strategy in one process: a mesh of two axes (NO_SHARD's, HYBRID_SHARD's) makes a
    process group per axis, with its threads and sockets, the first time only; later setups get the same mesh."""
    report = {}
    for name, kwargs in (("no_shard", dict(sharding_strategy="NO_SHARD")),
                         ("hybrid", dict(sharding_strategy="HYBRID_SHARD", device_mesh=(1, WORLD))),
                         ("full_shard", {})):
        meshes, groups = [], []
        for _ in range(3):
            fabric = make_fabric(WORLD, **kwargs)
            model, opt = _trained(fabric)  # a step on the mesh, which must still work when shared
            assert all(torch.isfinite(p.full_tensor()).all() for p in model.parameters()), name
            meshes.append(fabric.strategy.device_mesh)
            groups.append(_process_groups())
        assert meshes[1] is meshes[0] and meshes[2] is meshes[0], f"{name}: a new mesh per setup"
        assert groups[2] == groups[1] == groups[0], f"{name}: process groups after each setup: {groups}"
        report[name] = {"mesh": tuple(meshes[0].shape), "groups": groups}
    return report


@case
def models_set_up_one_after_another_are_freed_once_deleted():
    """Issue 37 item 7: a notebook or a sweep sets up model after model with one Fabric and drops each. The engine
    kept a table per setup that held every module of the model, so all of them stayed in memory; now each model,
    its optimizer and its parameters are gone once the user's references are (joint and separate setup)."""
    import gc
    import weakref

    fabric = make_fabric(WORLD)
    refs = []
    for trial in range(3):
        torch.manual_seed(trial)
        plain = TinyTransformer()
        if trial == 1:  # separate setup: the optimizer built before its model was set up, then remapped
            opt = torch.optim.SGD(plain.parameters(), lr=0.1)
            model = fabric.setup_module(plain)
            opt = fabric.setup_optimizers(opt)
        else:
            model, opt = fabric.setup(plain, torch.optim.SGD(plain.parameters(), lr=0.1))
        fabric.backward(loss_fn(model, make_batch(trial, fabric.global_rank)))
        opt.step()
        opt.zero_grad()
        refs.append({"model": weakref.ref(plain), "optimizer": weakref.ref(opt.optimizer),
                     "parameter": weakref.ref(next(plain.parameters()))})
        del plain, model, opt
    gc.collect()
    alive = [(trial, what) for trial, trial_refs in enumerate(refs) for what, ref in trial_refs.items()
             if ref() is not None]
    assert not alive, f"still alive after `del` and gc.collect(): {alive}"
    return "freed"


if __name__ == "__main__":
    run_cases()
