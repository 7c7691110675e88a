"""Two-rank cases for the Fabric front: parity, real sharding, setup paths, accumulation, clipping, collectives.

Every numerical case computes its single-process reference in the same process, on the concatenation of all
ranks' batches, and compares.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from common import (
    accumulate_three_micro_batches,
    compare,
    fsdp_run,
    full,
    full_params,
    global_batch,
    loss_fn,
    make_fabric,
    max_param_diff,
    model_and_reference,
    offload_policies,
    reference_run,
    RecordingReduceScatter,
    sgd,
    unit_states,
)
from harness import case, run_cases
from lightning_fsdp.engine.precision import DTensorGradScaler, FSDPPrecision
from models import Block, TinyTransformer, make_batch

STEPS = 5
WORLD = 2
ATOL = 1e-5


TINY_BLOCKS = ("blocks.0", "blocks.1")


def _states_after_a_training_forward(fabric) -> dict:
    """Unit states after a forward with autograd on, in training mode (backward pending), and after the backward.
    Parity cannot tell whether `reshard_after_forward` was applied; this can."""
    torch.manual_seed(0)
    plain = TinyTransformer()
    model, opt = fabric.setup(plain, sgd(plain))
    loss = loss_fn(model, make_batch(0, fabric.global_rank))
    after_forward = unit_states(model)
    fabric.backward(loss)
    after_backward = unit_states(model)
    assert set(after_backward.values()) == {"sharded"}, f"not every unit resharded after backward: {after_backward}"
    return after_forward, offload_policies(model)


def _parity(blocks_after_forward="sharded", **strategy_kwargs):
    from lightning_fsdp._base.compat import CheckpointWrapper

    fabric = make_fabric(WORLD, **strategy_kwargs)
    states, offload = _states_after_a_training_forward(fabric)
    # The root keeps its parameters gathered after forward (FSDP2 does not reshard it: backward starts there),
    # unless `reshard_after_forward=True` is given explicitly, which FSDP2 applies to the root too.
    root = "sharded" if strategy_kwargs.get("reshard_after_forward") is True else "unsharded"
    expected = {"": root, **{b: blocks_after_forward for b in TINY_BLOCKS}}
    if strategy_kwargs.get("sharding_strategy") != "NO_SHARD":  # replicated: nothing to reshard
        assert states == expected, f"units after a training forward: {states}, expected {expected}"
    expected_offload = {"CPUOffloadPolicy" if strategy_kwargs.get("cpu_offload") else "OffloadPolicy"}
    assert offload == expected_offload, f"offload policies of the units: {offload}, expected {expected_offload}"
    model, losses, _ = fsdp_run(fabric, STEPS)
    reference, ref_losses, _ = reference_run(STEPS, WORLD, sgd)
    result = compare(model, reference, losses, ref_losses, ATOL)
    checkpointed = [n for n, m in model.named_modules() if isinstance(m, CheckpointWrapper)]
    if "activation_checkpointing_policy" in strategy_kwargs:
        assert len(checkpointed) == 2, f"expected both blocks checkpointed, got {checkpointed}"
    else:
        assert not checkpointed, checkpointed
    return {**result, "checkpointed": len(checkpointed), "after_forward": states}


@case
def parity_full_shard():
    return _parity(sharding_strategy="FULL_SHARD")


@case
def parity_full_shard_activation_checkpointing():
    return _parity(sharding_strategy="FULL_SHARD", activation_checkpointing_policy={Block})


@case
def parity_shard_grad_op():
    return _parity("unsharded", sharding_strategy="SHARD_GRAD_OP")


@case
def parity_shard_grad_op_activation_checkpointing():
    return _parity("unsharded", sharding_strategy="SHARD_GRAD_OP", activation_checkpointing_policy="auto")


@case
def parity_no_shard():
    return _parity(sharding_strategy="NO_SHARD")


@case
def parity_no_shard_activation_checkpointing():
    return _parity(sharding_strategy="NO_SHARD", activation_checkpointing_policy=["models.Block"])


@case
def parity_cpu_offload():
    return _parity(cpu_offload=True)


@case
def parity_reshard_after_forward_override():
    # SHARD_GRAD_OP alone keeps the blocks gathered (see parity_shard_grad_op); the override reshards them.
    return _parity("sharded", sharding_strategy="SHARD_GRAD_OP", reshard_after_forward=True)


@case
def reshard_after_forward_false_keeps_full_shard_blocks_gathered():
    fabric = make_fabric(WORLD, reshard_after_forward=False)
    states, _ = _states_after_a_training_forward(fabric)
    assert states == {"": "unsharded", **{b: "unsharded" for b in TINY_BLOCKS}}, states
    return states


@case
def grad_reduce_dtype_follows_the_precision_table():
    """The README's precision table: mixed settings reduce gradients in fp32, true half settings in their dtype."""
    table = {"32-true": torch.float32, "bf16-mixed": torch.float32, "16-mixed": torch.float32,
             "bf16-true": torch.bfloat16, "16-true": torch.float16}
    report = {}
    for precision, expected in table.items():
        fabric = make_fabric(WORLD, plugins=[FSDPPrecision(precision)])
        torch.manual_seed(0)
        with fabric.init_module():
            plain = TinyTransformer()
        model = fabric.setup_module(plain)
        seen: list = []
        for unit in model.module.modules():
            if isinstance(unit, FSDPModule):
                unit.set_custom_reduce_scatter(RecordingReduceScatter(seen))
        fabric.backward(loss_fn(model, make_batch(0, fabric.global_rank)))
        assert len(seen) == 3 and set(seen) == {expected}, f"{precision}: reduce-scatter inputs {seen}, expected {expected}"
        report[precision] = str(expected)
    return report


@case
def mixed_precision_policy_overrides_the_precision_setting():
    from torch.distributed.fsdp import MixedPrecisionPolicy

    fabric = make_fabric(WORLD, mixed_precision=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    assert fabric.strategy.precision.precision == "32-true"
    torch.manual_seed(0)
    model = fabric.setup_module(TinyTransformer())
    seen = []
    model.module.head.register_forward_pre_hook(lambda mod, args: seen.append(mod.weight.dtype))
    model(make_batch(0, fabric.global_rank)[:, :-1])
    assert seen == [torch.bfloat16], seen  # gathered for compute in bf16 ...
    model.module.reshard()  # the root unit keeps its gathered parameters after forward
    sharded = model.module.head.weight
    assert isinstance(sharded, DTensor) and sharded.dtype == torch.float32  # ... while the shards stay fp32
    return [str(d) for d in seen]


@case
def parity_bf16_mixed():
    # bf16 keeps 8 bits of mantissa (0.4% per rounding), and FSDP casts every parameter while autocast casts only
    # the matmul inputs, so the run matches the bf16-autocast reference only loosely (observed here: 8e-4 to 1.5e-3
    # on the loss, 3e-4 to 4e-4 on the parameters; 5e-3 leaves headroom). That bound alone also passes a run that
    # computes in fp32 (no cast, no autocast: 2e-4 from the same reference), so the case checks the compute dtype
    # directly, and that the run is at least FP32_FLOOR from the fp32 reference: bf16 compute was 3.4e-4
    # (parameters) and 1.1e-3 (loss) away from it, fp32 compute 1.2e-7 and 2.4e-7.
    fabric = make_fabric(WORLD, precision="bf16-mixed")
    model, losses, _ = fsdp_run(fabric, STEPS, make_optimizer=plain_sgd)
    reference, ref_losses, _ = reference_run(STEPS, WORLD, plain_sgd, autocast_dtype=torch.bfloat16)
    result = compare(model, reference, losses, ref_losses, atol=5e-3)
    fp32_reference, fp32_losses, _ = reference_run(STEPS, WORLD, plain_sgd)
    got, fp32 = full_params(model), fp32_reference.state_dict()
    from_fp32 = max((got[k] - fp32[k]).abs().max().item() for k in fp32)
    loss_from_fp32 = max(abs(a - b) for a, b in zip(losses, fp32_losses))
    assert from_fp32 >= FP32_FLOOR and loss_from_fp32 >= FP32_FLOOR, (
        f"bf16-mixed is within {from_fp32:.1e} (parameters) and {loss_from_fp32:.1e} (loss) of fp32 compute: it did"
        f" not compute in bf16 (floor {FP32_FLOOR:.0e})")
    seen: list = []
    linear = model.module.blocks[0].mlp[0]
    hook = linear.register_forward_hook(lambda mod, args, out: seen.append((mod.weight.dtype, out.dtype)))
    try:
        model(make_batch(0, fabric.global_rank)[:, :-1])
    finally:
        hook.remove()
        model.module.reshard()
    assert seen == [(torch.bfloat16, torch.bfloat16)], f"a Linear computed with (weight, output) dtypes {seen}"
    return {**result, "param_diff_from_fp32": from_fp32, "loss_diff_from_fp32": loss_from_fp32,
            "compute": [str(d) for d in seen[0]]}


# 40x below what bf16 compute moves, 80x above fp32 compute's summation-order difference (see parity_bf16_mixed).
FP32_FLOOR = 1e-5


def plain_sgd(model: nn.Module) -> torch.optim.Optimizer:
    # Without momentum the low-precision runs do not amplify rounding differences from step to step, so the
    # tolerance below measures precision, not the chaos of the trajectory.
    return torch.optim.SGD(model.parameters(), lr=0.2)


def _fp16_run(fabric, steps: int, max_norm=None) -> tuple:
    """``fsdp_run`` for 16-mixed that also records what parity cannot see: the (weight, output) dtypes of a Linear in
    each forward, and the global norm of the gradients right after ``fabric.backward``, before anything unscales
    them (the scaled gradients: ``scale`` times the true ones)."""
    torch.manual_seed(0)
    plain = TinyTransformer()
    model, opt = fabric.setup(plain, plain_sgd(plain))
    dtypes: list = []
    hook = model.module.blocks[0].mlp[0].register_forward_hook(
        lambda mod, args, out: dtypes.append((mod.weight.dtype, out.dtype)))
    losses, norms, scaled_norms = [], [], []
    try:
        for step in range(steps):
            loss = loss_fn(model, make_batch(step, fabric.global_rank))
            fabric.backward(loss)
            scaled_norms.append(torch.stack([full(p.grad).float().norm() for p in model.parameters()]).norm().item())
            if max_norm is not None:
                norms.append(fabric.clip_gradients(model, opt, max_norm=max_norm).item())
            opt.step()
            opt.zero_grad()
            losses.append(fabric.all_reduce(loss.detach(), reduce_op="mean").item())
    finally:
        hook.remove()
    return model, losses, norms, scaled_norms, dtypes


def _check_fp16_scaled(scaler, steps: int, scaled_norms, ref_norms, dtypes) -> dict:
    """16-mixed computed in fp16, and scaled the loss by the scaler's scale: what a run in fp32, or with the loss
    never scaled, would pass parity with (at 2**8 no fp16 gradient overflows here, so an unscaled run matches)."""
    assert dtypes and set(dtypes) == {(torch.float16, torch.float16)}, (
        f"a Linear computed with (weight, output) dtypes {dtypes}")
    scale = scaler.get_scale()
    # fp16 rounding moves the ratio by well under 1% (seen here: below 1e-3); an unscaled loss gives 1/256 of it.
    ratios = [got / (scale * ref) for got, ref in zip(scaled_norms, ref_norms)]
    assert all(abs(r - 1) <= 1e-2 for r in ratios), (
        f"the gradients before unscaling are {ratios} times scale ({scale}) x the reference's: the loss was not scaled")
    # Every step went through the scaler (`step` and `update`): its count of good steps since the last growth.
    tracker = scaler.state_dict()["_growth_tracker"]
    assert tracker == steps, f"the scaler counted {tracker} steps of {steps}: the optimizer step bypassed it"
    return {"scale": scale, "scaled_over_reference": ratios, "growth_tracker": tracker}


@case
def parity_16_mixed_with_loss_scaler():
    # A modest initial scale keeps fp16 gradients finite, so no step is skipped and the run is comparable with an
    # unscaled fp16-autocast reference.
    scaler = DTensorGradScaler("cpu", init_scale=2.0**8)
    fabric = make_fabric(WORLD, plugins=[FSDPPrecision("16-mixed", scaler=scaler)])
    model, losses, _, scaled_norms, dtypes = _fp16_run(fabric, STEPS)
    assert scaler.get_scale() >= 2.0**8, f"a step was skipped (scale fell to {scaler.get_scale()})"
    # max_norm=inf: clip_grad_norm_ then only measures the reference's gradient norm, and changes nothing.
    reference, ref_losses, ref_norms = reference_run(STEPS, WORLD, plain_sgd, autocast_dtype=torch.float16,
                                                     max_norm=float("inf"))
    scaled = _check_fp16_scaled(scaler, STEPS, scaled_norms, ref_norms, dtypes)
    # fp16 keeps 11 bits of mantissa. Observed here: 1.7e-4 on the loss, 5e-5 on the parameters.
    return {**compare(model, reference, losses, ref_losses, atol=1e-3), **scaled}


@case
def clip_gradients_norm_unscales_first_under_16_mixed():
    scaler = DTensorGradScaler("cpu", init_scale=2.0**8)
    fabric = make_fabric(WORLD, plugins=[FSDPPrecision("16-mixed", scaler=scaler)])
    model, losses, norms, scaled_norms, dtypes = _fp16_run(fabric, 2, max_norm=0.5)
    reference, ref_losses, ref_norms = reference_run(2, WORLD, plain_sgd, autocast_dtype=torch.float16, max_norm=0.5)
    scaled = _check_fp16_scaled(scaler, 2, scaled_norms, ref_norms, dtypes)
    # Without unscaling, the norm would be 256 times the reference (the check above shows the loss was scaled).
    for got, expected in zip(norms, ref_norms):
        assert abs(got - expected) <= 1e-2 * expected, (norms, ref_norms)
    assert all(n > 0.5 for n in ref_norms), f"clipping never triggered: {ref_norms}"
    return {"norms": norms, "reference": ref_norms, **scaled}


@case
def true_half_precisions_store_low_dtype_shards():
    report = {}
    for name, dtype in (("bf16-true", torch.bfloat16), ("16-true", torch.float16)):
        fabric = make_fabric(WORLD, plugins=[FSDPPrecision(name)])
        with fabric.init_module():
            plain = TinyTransformer()
        assert all(p.dtype == dtype for p in plain.parameters()), name
        model, opt = fabric.setup(plain, torch.optim.SGD(plain.parameters(), lr=0.1))
        assert all(p.to_local().dtype == dtype for p in model.parameters()), name
        before = full_params(model)
        fabric.backward(loss_fn(model, make_batch(0, fabric.global_rank)))
        opt.step()
        after = full_params(model)
        assert any(not torch.equal(before[k], after[k]) for k in before), f"{name}: nothing trained"
        report[name] = str(dtype)
    return report


@case
def loss_scaler_skips_step_on_every_rank_when_one_rank_overflows():
    # Given as a plugin; `Fabric(precision="16-mixed")` builds the same one (see test_dropin.py).
    fabric = make_fabric(WORLD, plugins=[FSDPPrecision("16-mixed")])
    torch.manual_seed(0)
    plain = TinyTransformer()
    model, opt = fabric.setup(plain, torch.optim.SGD(plain.parameters(), lr=0.1))
    before = full_params(model)
    loss = loss_fn(model, make_batch(0, fabric.global_rank))
    fabric.backward(loss)
    if fabric.global_rank == 1:  # an overflow only rank 1 can see, in its local shard
        next(iter(model.parameters())).grad.to_local().view(-1)[0] = float("inf")
    scale_before = fabric.strategy.precision.scaler.get_scale()
    opt.step()
    after = full_params(model)
    unchanged = all(torch.equal(before[k], after[k]) for k in before)
    assert unchanged, "a rank stepped although another rank saw an overflow"
    scale_after = fabric.strategy.precision.scaler.get_scale()
    assert scale_after < scale_before, (scale_before, scale_after)
    return {"scale_before": scale_before, "scale_after": scale_after}


@case
def sharding_is_real():
    fabric = make_fabric(WORLD)
    torch.manual_seed(0)
    plain = TinyTransformer()
    sizes = {k: v.numel() for k, v in plain.state_dict().items()}
    model = fabric.setup_module(plain)
    report = {}
    for name, param in model.module.state_dict().items():
        assert isinstance(param, DTensor), f"{name} is not sharded"
        local = param.to_local().numel()
        rows = param.shape[0]
        expected = -(-rows // WORLD) if fabric.global_rank == 0 else rows - -(-rows // WORLD)
        assert local == expected * (sizes[name] // rows), (name, local, sizes[name])
        report[name] = local / sizes[name]
    return report


def _units(model: nn.Module) -> list[str]:
    return sorted(name for name, m in model.named_modules() if isinstance(m, FSDPModule) and name)


def _check_units(policy, expected: list[str]):
    fabric = make_fabric(WORLD, auto_wrap_policy=policy)
    torch.manual_seed(0)
    model = fabric.setup_module(TinyTransformer(layers=3))
    got = _units(model.module)
    assert got == expected, f"policy {policy!r}: wrapped {got}, expected {expected}"
    assert isinstance(model.module, FSDPModule), "the root must be a unit"
    return got


BLOCKS = ["blocks.0", "blocks.1", "blocks.2"]


@case
def units_match_each_policy_form():
    from functools import partial

    from torch.distributed.fsdp.wrap import ModuleWrapPolicy, size_based_auto_wrap_policy

    forms = {
        "set": ({Block}, BLOCKS),
        "dotted": (["models.Block"], BLOCKS),
        "dotted_str": ("models.Block", BLOCKS),
        "callable": (lambda m: isinstance(m, nn.Linear) and m.out_features == 32, ["head"]),
        "legacy": (lambda module, recurse, nonwrapped_numel: recurse or isinstance(module, nn.Embedding), ["embed"]),
        "module_wrap_policy": (ModuleWrapPolicy({Block}), BLOCKS),
        # Each Block holds 3,280 parameters; the MLP inside it 2,128; the head 544. A 3,000 threshold takes the
        # blocks and nothing smaller.
        "size_based": (partial(size_based_auto_wrap_policy, min_num_params=3000), BLOCKS),
        "auto": ("auto", BLOCKS),
    }
    for label, (policy, expected) in forms.items():
        _check_units(policy, expected)
    return list(forms)


@case
def policy_matching_nothing_warns_with_candidates():
    fabric = make_fabric(WORLD, auto_wrap_policy={nn.Conv2d})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = fabric.setup_module(TinyTransformer())
    messages = [str(w.message) for w in caught if "selected no module" in str(w.message)]
    assert messages and "models.Block" in messages[0], [str(w.message) for w in caught]
    assert _units(model.module) == []
    return messages[0]


@case
def existing_fsdp_units_are_respected():
    from torch.distributed.fsdp import fully_shard

    fabric = make_fabric(WORLD, auto_wrap_policy={nn.Linear})
    torch.manual_seed(0)
    model = TinyTransformer()
    fully_shard(model.blocks[0], mesh=fabric.strategy.device_mesh)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        wrapped = fabric.setup_module(model)
    assert any("already contains FSDP2 units" in str(w.message) for w in caught)
    assert _units(wrapped.module) == ["blocks.0"], _units(wrapped.module)
    return _units(wrapped.module)


@case
def existing_checkpoint_wrappers_are_not_wrapped_twice():
    from lightning_fsdp._base.compat import CheckpointWrapper, checkpoint_wrapper

    fabric = make_fabric(WORLD, activation_checkpointing_policy={Block})
    torch.manual_seed(0)
    model = TinyTransformer()
    model.blocks[0] = checkpoint_wrapper(model.blocks[0])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        wrapped = fabric.setup_module(model)
    assert any("already contains activation-checkpoint wrappers" in str(w.message) for w in caught)
    wrappers = [n for n, m in wrapped.module.named_modules() if isinstance(m, CheckpointWrapper)]
    assert wrappers == ["blocks.0"], wrappers
    keys = list(wrapped.state_dict())
    assert not any("_checkpoint_wrapped_module" in k for k in keys), keys
    return wrappers


def _two_group_adamw(model: nn.Module) -> torch.optim.Optimizer:
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1, "lr": 1e-2}, {"params": no_decay, "weight_decay": 0.0, "lr": 5e-3}]
    )


def _assert_trains(model, opt, fabric) -> dict:
    hyper = [{k: v for k, v in g.items() if k in ("lr", "weight_decay")} for g in opt.param_groups]
    assert hyper == [{"lr": 1e-2, "weight_decay": 0.1}, {"lr": 5e-3, "weight_decay": 0.0}], hyper
    model_params = {id(p) for p in model.parameters()}
    opt_params = [p for g in opt.param_groups for p in g["params"]]
    assert all(id(p) in model_params for p in opt_params), "optimizer holds parameters the model no longer uses"
    assert all(isinstance(p, DTensor) for p in opt_params)
    assert len(opt_params) == len(model_params)
    before = {n: p.to_local().detach().clone() for n, p in model.named_parameters()}
    fabric.backward(loss_fn(model, make_batch(0, fabric.global_rank)))
    trained = {n for n, p in model.named_parameters() if p.grad is not None}
    opt.step()
    changed = [n for n, p in model.named_parameters() if not torch.equal(before[n], p.to_local())]
    # Uneven shards can leave a rank with an empty slice of a small parameter; all non-empty ones must move.
    nonempty = [n for n, p in before.items() if p.numel() and n in trained]
    assert len(nonempty) >= len(before) - 1, f"too few parameters got gradients: {sorted(set(before) - trained)}"
    assert sorted(changed) == sorted(nonempty), f"unchanged: {sorted(set(nonempty) - set(changed))}"
    return {"changed": len(changed)}


@case
def joint_setup_remaps_optimizer_and_trains():
    fabric = make_fabric(WORLD)
    torch.manual_seed(0)
    model = TinyTransformer()
    opt = _two_group_adamw(model)
    model, opt = fabric.setup(model, opt)
    return _assert_trains(model, opt, fabric)


@case
def separate_setup_trains():
    fabric = make_fabric(WORLD)
    torch.manual_seed(0)
    model = fabric.setup_module(TinyTransformer())
    opt = fabric.setup_optimizers(_two_group_adamw(model))
    return _assert_trains(model, opt, fabric)


@case
def meta_init_materializes_shards_and_trains():
    # A module without `reset_parameters()` is an error now: see `meta_init.py`'s `uninitialized_tensor_is_an_error`.
    fabric = make_fabric(WORLD)
    with fabric.init_module(empty_init=True):
        model = TinyTransformer()
    assert all(p.is_meta for p in model.parameters())
    opt = _two_group_adamw(model)  # built from meta parameters, before setup
    model, opt = fabric.setup(model, opt)
    tensors = list(model.parameters()) + list(model.buffers())
    assert not any(t.is_meta for t in tensors), "something stayed on meta"
    assert not any(p.to_local().is_meta for p in model.parameters())
    # reset_parameters really ran: LayerNorm weights are ones, Linear weights are not all zero.
    assert torch.equal(full(model.module.blocks[0].norm.weight), torch.ones(16))
    assert full(model.module.head.weight).abs().sum() > 0
    return _assert_trains(model, opt, fabric)


@case
def meta_init_gives_each_shard_its_own_values():
    fabric = make_fabric(WORLD)
    torch.manual_seed(0)
    with fabric.init_module(empty_init=True):
        model = TinyTransformer()
    model = fabric.setup_module(model)
    weight = full(model.module.blocks[0].mlp[0].weight)  # (64, 16): rank 0 holds rows 0-31, rank 1 rows 32-63
    top, bottom = weight[:32], weight[32:]
    assert not torch.equal(top, bottom), "both ranks initialized their shard with the same random numbers"
    return {"max_abs": weight.abs().max().item()}


@case
def save_and_load_after_a_forward_without_backward():
    import tempfile
    from pathlib import Path

    fabric = make_fabric(WORLD)
    torch.manual_seed(0)
    plain = TinyTransformer()
    model, opt = fabric.setup(plain, torch.optim.AdamW(plain.parameters(), lr=1e-2))
    fabric.backward(loss_fn(model, make_batch(0, fabric.global_rank)))
    opt.step()
    with torch.no_grad():  # evaluation leaves the root unit unsharded
        model(make_batch(1, fabric.global_rank)[:, :-1])
    path = Path(fabric.broadcast(tempfile.mkdtemp())) / "after-eval"
    fabric.save(path, {"model": model, "optimizer": opt})
    saved, saved_opt = full_params(model), _full_opt_state(opt)
    # Into a fresh model and optimizer holding other values: a load that restored nothing cannot pass.
    torch.manual_seed(7)
    plain = TinyTransformer()
    fresh, fresh_opt = fabric.setup(plain, torch.optim.AdamW(plain.parameters(), lr=1e-2))
    assert not all(torch.equal(saved[k], v) for k, v in full_params(fresh).items())
    fabric.load(path, {"model": fresh, "optimizer": fresh_opt})
    got, got_opt = full_params(fresh), _full_opt_state(fresh_opt)
    assert got.keys() == saved.keys() and all(torch.equal(got[k], saved[k]) for k in saved), "parameters differ"
    assert len(saved_opt) == 3 * len(saved), sorted(saved_opt)  # step, exp_avg, exp_avg_sq per parameter
    assert got_opt.keys() == saved_opt.keys() and all(torch.equal(got_opt[k], saved_opt[k]) for k in saved_opt), (
        "optimizer state differs")
    return str(path)


def _full_opt_state(opt) -> dict:
    return {(i, k): full(v).clone() for i, s in opt.state_dict()["state"].items() for k, v in s.items()}


@case
def joint_setup_refuses_optimizer_with_state():
    fabric = make_fabric(WORLD)
    torch.manual_seed(0)
    model = TinyTransformer()
    opt = torch.optim.AdamW(model.parameters())
    loss_fn(model, make_batch(0, 0)).backward()
    opt.step()
    try:
        fabric.setup(model, opt)
    except ValueError as err:
        assert "already has state" in str(err) and "HINT" in str(err)
        return str(err)
    raise AssertionError("setup accepted an optimizer that already stepped")


@case
def gradient_accumulation_with_no_backward_sync():
    return {"max_diff": accumulate_three_micro_batches(make_fabric(WORLD), ATOL)}


@case
def clip_gradients_norm_matches_reference():
    fabric = make_fabric(WORLD)
    model, losses, norms = fsdp_run(fabric, 3, max_norm=0.5)
    reference, ref_losses, ref_norms = reference_run(3, WORLD, sgd, max_norm=0.5)
    for got, expected in zip(norms, ref_norms):
        assert abs(got - expected) <= 1e-5 * max(1.0, expected), (norms, ref_norms)
    assert all(n > 0.5 for n in ref_norms), f"clipping never triggered: {ref_norms}"
    return {**compare(model, reference, losses, ref_losses, ATOL), "norms": norms}


@case
def clip_gradients_value_matches_reference():
    fabric = make_fabric(WORLD)
    model, opt, reference, ref_opt = model_and_reference(fabric)
    fabric.backward(loss_fn(model, make_batch(0, fabric.global_rank)))
    fabric.clip_gradients(model, opt, clip_val=0.01)
    loss_fn(reference, global_batch(0, WORLD)).backward()
    clipped = sum(int((p.grad.abs() > 0.01).sum()) for p in reference.parameters())
    torch.nn.utils.clip_grad_value_(reference.parameters(), 0.01)
    opt.step()
    ref_opt.step()
    assert clipped > 0, "no gradient element exceeded the clip value"
    return {"diff": max_param_diff(model, reference, ATOL), "clipped_elements": clipped}


@case
def collectives_work():
    fabric = make_fabric(WORLD)
    r = fabric.global_rank
    mean = fabric.all_reduce(torch.tensor(float(r + 1)), reduce_op="mean")
    total = fabric.all_reduce(torch.tensor(r + 1), reduce_op="sum")
    biggest = fabric.all_reduce(torch.tensor(float(r)), reduce_op="max")
    assert mean.item() == 1.5 and total.item() == 3 and biggest.item() == 1.0, (mean, total, biggest)
    obj = fabric.broadcast({"from": r}, src=1)
    assert obj == {"from": 1}, obj
    fabric.barrier()
    return {"mean": mean.item()}


def _targets(logits: torch.Tensor, tokens: torch.Tensor, rank: int) -> torch.Tensor:
    """The next tokens, except that on rank r the first 2(r+1) positions of each row are what the model predicts:
    so accuracy is far from 0 and differs between the ranks, and only a real sync can give the global value."""
    targets = tokens[:, 1:].clone()
    hits = 2 * (rank + 1)
    targets[:, :hits] = logits.detach().argmax(-1)[:, :hits]
    return targets


@case
def torchmetrics_follow_the_model():
    import torchmetrics
    from torchmetrics.functional.classification import multiclass_accuracy

    class WithMetric(TinyTransformer):
        def __init__(self):
            super().__init__()
            self.acc = torchmetrics.classification.MulticlassAccuracy(num_classes=32, average="micro")

    fabric = make_fabric(WORLD)
    torch.manual_seed(0)
    model = fabric.setup_module(WithMetric())
    rank = fabric.global_rank
    batch = make_batch(0, rank)
    logits = model(batch[:, :-1])
    targets = _targets(logits, batch, rank)
    model.module.acc.update(logits.reshape(-1, 32), targets.reshape(-1))
    value = model.module.acc.compute()  # syncs metric state across ranks
    assert model.module.acc.device == fabric.device
    local = multiclass_accuracy(logits.detach().reshape(-1, 32), targets.reshape(-1), num_classes=32, average="micro")
    # The reference: one process, the same initial model, every rank's batch (functional form: no syncing).
    torch.manual_seed(0)
    reference = TinyTransformer()
    with torch.no_grad():
        parts = [(reference(make_batch(0, r)[:, :-1]), make_batch(0, r)) for r in range(WORLD)]
    ref_logits = torch.cat([lg for lg, _ in parts])
    ref_targets = torch.cat([_targets(lg, b, r) for r, (lg, b) in enumerate(parts)])
    expected = multiclass_accuracy(ref_logits.reshape(-1, 32), ref_targets.reshape(-1), num_classes=32, average="micro")
    assert abs(value.item() - expected.item()) <= 1e-6, f"synced {value.item()} != reference {expected.item()}"
    assert abs(local.item() - expected.item()) > 0.05, "this rank alone gives the reference: the sync is unproven"
    return {"device": str(model.module.acc.device), "acc": value.item(), "this_rank_alone": local.item()}


@case
def checkpoint_round_trip_sharded_and_full():
    import tempfile
    from pathlib import Path

    report = {}
    for kind in ("sharded", "full"):
        fabric = make_fabric(WORLD, state_dict_type=kind)
        plain = TinyTransformer()
        model, opt = fabric.setup(plain, torch.optim.AdamW(plain.parameters(), lr=1e-2))
        for step in range(2):
            fabric.backward(loss_fn(model, make_batch(step, fabric.global_rank)))
            opt.step()
            opt.zero_grad()
        root = Path(fabric.broadcast(tempfile.mkdtemp()))
        path = root / f"ckpt-{kind}"
        fabric.save(path, {"model": model, "optimizer": opt, "step": 2})
        saved = full_params(model)
        saved_opt = {k: full(v).clone() for k, v in opt.state_dict()["state"][0].items() if torch.is_tensor(v)}

        torch.manual_seed(123)
        plain = TinyTransformer()
        model2, opt2 = fabric.setup(plain, torch.optim.AdamW(plain.parameters(), lr=1e-2))
        state = {"model": model2, "optimizer": opt2, "step": 0}
        rest = fabric.load(path, state)
        assert state["step"] == 2 and rest == {}, (state["step"], rest)
        loaded = full_params(model2)
        assert all(torch.equal(saved[k], loaded[k]) for k in saved), "parameters differ after load"
        loaded_opt = {k: full(v) for k, v in opt2.state_dict()["state"][0].items() if torch.is_tensor(v)}
        assert all(torch.equal(saved_opt[k], loaded_opt[k]) for k in saved_opt), "optimizer state differs"
        # Training continues identically from both.
        for m, o in ((model, opt), (model2, opt2)):
            fabric.backward(loss_fn(m, make_batch(5, fabric.global_rank)))
            o.step()
        a, b = full_params(model), full_params(model2)
        assert all(torch.equal(a[k], b[k]) for k in a), "training diverged after resume"
        report[kind] = str(path)
    return report


if __name__ == "__main__":
    run_cases()
