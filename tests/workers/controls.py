"""Cases for the speed and memory controls: prefetch depths, int and per-unit ``reshard_after_forward``, every-N and
op-level selective activation checkpointing.

Launched twice by ``tests/test_controls.py``: on 2 ranks (the cases in ``TWO_RANKS``) and on 4 ranks (``FOUR_RANKS``:
an int reshard needs a shard axis of 4 to have a smaller group to go to, and hybrid sharding needs 4 ranks). Every
numerical case trains a 4-block model with the strategy and a single-process reference on the concatenation of the
ranks' batches, and compares the parameters (fp32, 1e-5).
"""

from __future__ import annotations

import os
from collections import Counter

import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from common import full, global_batch, loss_fn, make_fabric, sgd, unit_states
from harness import CASES, assert_close, case, run_cases
from lightning_fsdp._base.compat import CheckpointWrapper
from models import Block, TinyTransformer, make_batch

WORLD = int(os.environ.get("WORLD_SIZE", "2"))
ATOL = 1e-5
STEPS = 3
LAYERS = 4
BLOCKS = [f"blocks.{i}" for i in range(LAYERS)]


def _model() -> TinyTransformer:
    torch.manual_seed(0)
    return TinyTransformer(layers=LAYERS)


def _setup(**strategy_kwargs):
    fabric = make_fabric(WORLD, **strategy_kwargs)
    plain = _model()
    model, opt = fabric.setup(plain, sgd(plain))
    return fabric, model, opt


def _units(model) -> dict[str, FSDPModule]:
    inner = getattr(model, "module", model)
    return {name: m for name, m in inner.named_modules() if isinstance(m, FSDPModule)}


def _train_and_compare(fabric, model, opt, steps: int = STEPS) -> dict:
    """``steps`` steps with the strategy and with the reference; parameters must agree to ATOL."""
    reference = _model()
    ref_opt = sgd(reference)
    for step in range(steps):
        fabric.backward(loss_fn(model, make_batch(step, fabric.global_rank)))
        opt.step()
        opt.zero_grad()
        loss_fn(reference, global_batch(step, WORLD)).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    expected = reference.state_dict()
    diff = max(assert_close(full(v), expected[k], ATOL, k) for k, v in model.state_dict().items())
    initial = _model().state_dict()
    moved = max((expected[k] - initial[k]).abs().max().item() for k in expected)
    assert moved > 1e-3, f"the reference did not train (max change {moved:.3e})"
    return {"param_diff": diff}


def _checkpointed(model) -> list[str]:
    inner = getattr(model, "module", model)
    return [n for n, m in inner.named_modules() if isinstance(m, CheckpointWrapper)]


# --- prefetch ---------------------------------------------------------------------------------------------------


def _registered(units: dict[str, FSDPModule]) -> tuple[dict, dict]:
    """Each unit's explicit forward and backward prefetch targets, by unit name (FSDP2 keeps them in its state)."""
    by_state = {id(u._get_fsdp_state()): name for name, u in units.items()}
    forward = {n: [by_state[id(s)] for s in u._get_fsdp_state()._states_to_forward_prefetch] for n, u in units.items()}
    backward = {n: [by_state[id(s)] for s in u._get_fsdp_state()._states_to_backward_prefetch] for n, u in units.items()}
    return forward, backward


def _prefetch_case(sharding: str) -> dict:
    fabric, model, opt = _setup(sharding_strategy=sharding, forward_prefetch=2, backward_prefetch=2)
    forward, backward = _registered(_units(model))
    # Forward: the root first (its forward starts first), each block the two after it, in module order.
    assert forward == {"": ["blocks.0", "blocks.1"], "blocks.0": ["blocks.1", "blocks.2"],
                       "blocks.1": ["blocks.2", "blocks.3"], "blocks.2": ["blocks.3"], "blocks.3": []}, forward
    # Backward runs the blocks in reverse: the root (its head's gradients come first), then blocks.3 down to 0.
    assert backward == {"": ["blocks.3", "blocks.2"], "blocks.3": ["blocks.2", "blocks.1"],
                        "blocks.2": ["blocks.1", "blocks.0"], "blocks.1": ["blocks.0"], "blocks.0": []}, backward
    return {**_train_and_compare(fabric, model, opt), "forward": forward, "backward": backward}


@case
def prefetch_depth_2_registers_and_trains_full_shard():
    return _prefetch_case("FULL_SHARD")


@case
def prefetch_depth_2_registers_and_trains_shard_grad_op():
    return _prefetch_case("SHARD_GRAD_OP")


@case
def prefetch_defaults_register_nothing_and_true_means_one():
    _, model, _ = _setup()
    forward, backward = _registered(_units(model))
    assert not any(forward.values()) and not any(backward.values()), (forward, backward)
    _, model, _ = _setup(forward_prefetch=True, backward_prefetch="BACKWARD_PRE")
    forward, backward = _registered(_units(model))
    assert forward["blocks.0"] == ["blocks.1"] and forward[""] == ["blocks.0"], forward
    assert not any(backward.values()), backward  # depth 1 in backward is FSDP2's own prefetching
    return forward


# --- per-unit and int resharding -----------------------------------------------------------------------------------


def _post_forward(units: dict[str, FSDPModule]) -> dict[str, str]:
    """What each unit does after forward, read from FSDP2's state: "keep", "reshard" or "group of k"."""
    out = {}
    for name, unit in units.items():
        (group,) = unit._get_fsdp_state()._fsdp_param_groups
        info = group.post_forward_mesh_info
        out[name] = ("keep" if info is None else "reshard" if info is group.mesh_info or info == group.mesh_info
                     else f"group of {info.shard_mesh_size}")
    return out


def _per_unit_case(sharding: str, reshard, expected: dict[str, str]) -> dict:
    fabric, model, opt = _setup(sharding_strategy=sharding, reshard_after_forward=reshard)
    loss = loss_fn(model, make_batch(0, fabric.global_rank))  # lazy init decides the root's auto value
    after_forward = unit_states(model)
    plan = _post_forward(_units(model))
    assert plan == expected, f"after-forward choices {plan}, expected {expected}"
    seen = {n: ("sharded" if c == "reshard" else "unsharded") for n, c in expected.items()}
    assert after_forward == seen, f"units after a training forward: {after_forward}, expected {seen}"
    fabric.backward(loss)
    opt.zero_grad()
    return {**_train_and_compare(fabric, model, opt), "plan": plan}


@case
def per_unit_reshard_reaches_the_right_units_full_shard():
    # A class name for all blocks, a module name that overrides it for one, and the root.
    return _per_unit_case("FULL_SHARD", {"root": True, "Block": False, "blocks.2": True},
                          {"": "reshard", "blocks.0": "keep", "blocks.1": "keep", "blocks.2": "reshard",
                           "blocks.3": "keep"})


@case
def per_unit_reshard_reaches_the_right_units_shard_grad_op():
    # Units no key names follow the strategy: SHARD_GRAD_OP keeps them. The module name wins over the class even
    # though it comes first: the most specific key decides, not the order.
    return _per_unit_case("SHARD_GRAD_OP", {"blocks.3": False, "root": True, "models.Block": True},
                          {"": "reshard", "blocks.0": "reshard", "blocks.1": "reshard", "blocks.2": "reshard",
                           "blocks.3": "keep"})


@case
def reshard_errors_at_setup_name_the_value_and_the_units():
    errors = {}
    for value, needle in ((3, "does not divide the 2 ranks"), ({"NoSuchBlock": False}, "matches no FSDP unit"),
                          ({"blocks.9": False}, "'blocks.0'")):
        fabric = make_fabric(WORLD, reshard_after_forward=value)
        try:
            fabric.setup_module(_model())
        except ValueError as err:
            message = str(err)
        else:
            raise AssertionError(f"reshard_after_forward={value!r} was accepted")
        assert "Invalid `reshard_after_forward=" in message and needle in message and "HINT:" in message, message
        errors[repr(value)] = message
    return errors


# --- activation checkpointing: every N-th block, op-level selective ------------------------------------------------


class OpCounter(TorchDispatchMode):
    """Counts the aten ops that really run (a cached op of selective checkpointing does not reach this mode)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[str(func.overloadpacket).split(".")[-1]] += 1
        return func(*args, **(kwargs or {}))


MATMULS = ("mm", "addmm", "bmm", "baddbmm")
ATTENTION = "_scaled_dot_product_flash_attention_for_cpu"
POINTWISE = ("gelu", "native_layer_norm")  # forward ops; in a backward they are recomputation


def _backward_ops(policy) -> tuple[Counter, dict[str, torch.Tensor], list[str]]:
    kwargs = {} if policy is None else {"activation_checkpointing_policy": policy}
    fabric, model, _ = _setup(**kwargs)
    loss = loss_fn(model, make_batch(0, fabric.global_rank))
    with OpCounter() as counter:
        fabric.backward(loss)
    # Under the parameters' clean names (the checkpoint wrapper adds a level to `named_parameters`).
    grads = {n.replace("._checkpoint_wrapped_module", ""): full(p.grad).clone() for n, p in model.named_parameters()}
    return counter.counts, grads, _checkpointed(model)


@case
def selective_checkpointing_recomputes_pointwise_ops_not_matmuls():
    none, none_grads, none_wrapped = _backward_ops(None)
    whole, whole_grads, _ = _backward_ops({Block})
    selective, selective_grads, wrapped = _backward_ops({"blocks": [Block], "save_ops": "default"})
    assert wrapped == BLOCKS and not none_wrapped, (wrapped, none_wrapped)
    matmuls = {name: sum(c[op] for op in MATMULS) for name, c in (("none", none), ("full", whole),
                                                                       ("selective", selective))}
    # Matmuls: selective runs only the gradient matmuls, exactly as without checkpointing; full recomputes forward's.
    assert matmuls["selective"] == matmuls["none"] < matmuls["full"], matmuls
    assert selective[ATTENTION] == none[ATTENTION] == 0 < whole[ATTENTION], (selective, whole)
    # Pointwise: recomputed in backward by both kinds of checkpointing, never without.
    for op in POINTWISE:
        assert none[op] == 0 < selective[op] and selective[op] == whole[op], (op, none[op], selective[op], whole[op])
    diff = max(assert_close(selective_grads[n], g, ATOL, f"grad {n}") for n, g in none_grads.items())
    diff = max(diff, max(assert_close(whole_grads[n], g, ATOL, f"grad {n}") for n, g in none_grads.items()))
    return {"matmuls": matmuls, "gelu": [none["gelu"], selective["gelu"], whole["gelu"]], "grad_diff": diff}


@case
def custom_save_ops_recompute_what_they_leave_out():
    # Save only the linear layers' matmuls: attention is now recomputed, the matmuls still are not.
    none, none_grads, _ = _backward_ops(None)
    custom, grads, _ = _backward_ops({"save_ops": ["torch.ops.aten.mm", "aten.addmm.default"]})
    assert custom[ATTENTION] > 0 == none[ATTENTION], (custom[ATTENTION], none[ATTENTION])
    assert custom["addmm"] == none["addmm"] and custom["mm"] == none["mm"], (custom, none)
    diff = max(assert_close(grads[n], g, ATOL, f"grad {n}") for n, g in none_grads.items())
    return {"attention_recomputed": custom[ATTENTION], "grad_diff": diff}


class ForwardCounter:
    """Counts the forwards each block's own module (inside any checkpoint wrapper) starts: a checkpointed block
    starts its forward twice per step, once more in backward. (Pre-hooks: a recomputation stops early, as soon as
    it has what backward needs, so a post-forward hook may never run.)"""

    def __init__(self, model) -> None:
        inner = getattr(model, "module", model)
        self.counts: Counter = Counter()
        for i, block in enumerate(inner.blocks):
            block = getattr(block, "_checkpoint_wrapped_module", block)
            block.register_forward_pre_hook(lambda *_, i=i: self.counts.update([f"blocks.{i}"]))


def _every_case(sharding: str, policy, expected: list[str]) -> dict:
    fabric, model, opt = _setup(sharding_strategy=sharding, activation_checkpointing_policy=policy)
    assert _checkpointed(model) == expected, _checkpointed(model)
    counter = ForwardCounter(model)
    fabric.backward(loss_fn(model, make_batch(0, fabric.global_rank)))
    opt.zero_grad()
    runs = {b: 2 if b in expected else 1 for b in BLOCKS}
    assert dict(counter.counts) == runs, f"block forwards in one step: {dict(counter.counts)}, expected {runs}"
    return {**_train_and_compare(fabric, model, opt), "checkpointed": expected}


@case
def every_2nd_block_checkpoints_exactly_blocks_1_and_3_full_shard():
    return _every_case("FULL_SHARD", {"blocks": [Block], "every": 2}, ["blocks.1", "blocks.3"])


@case
def every_3rd_auto_block_shard_grad_op():
    return _every_case("SHARD_GRAD_OP", {"every": 3}, ["blocks.2"])


@case
def selective_every_2nd_trains_like_the_reference_shard_grad_op():
    return _every_case("SHARD_GRAD_OP", {"blocks": ["models.Block"], "every": 2, "save_ops": "default"},
                       ["blocks.1", "blocks.3"])


@case
def selective_trains_like_the_reference_full_shard():
    return _every_case("FULL_SHARD", {"save_ops": "default"}, BLOCKS)


@case
def all_controls_together_full_shard():
    fabric, model, opt = _setup(forward_prefetch=1, backward_prefetch=2, reshard_after_forward={"root": True},
                                activation_checkpointing_policy={"every": 2, "save_ops": "default"})
    return _train_and_compare(fabric, model, opt)


TWO_RANKS = [fn.__name__ for fn in CASES]


# --- four ranks: int resharding, hybrid sharding ------------------------------------------------------------------


@case
def int_reshard_leaves_blocks_on_groups_of_2():
    fabric, model, opt = _setup(reshard_after_forward=2)
    units = _units(model)
    assert _post_forward(units) == {"": "group of 2", **{b: "group of 2" for b in BLOCKS}}, _post_forward(units)
    loss = loss_fn(model, make_batch(0, fabric.global_rank))
    # After forward each block holds a copy sharded over a group of 2 ranks: a DTensor on a (2, 2) mesh, with
    # half of each parameter's rows on this rank, where at rest it holds a quarter.
    weight = units["blocks.0"].mlp[0].weight
    assert isinstance(weight, DTensor) and tuple(weight.device_mesh.shape) == (2, 2), weight.device_mesh
    assert weight.to_local().shape[0] == weight.shape[0] // 2, (weight.to_local().shape, weight.shape)
    fabric.backward(loss)
    at_rest = units["blocks.0"].mlp[0].weight
    assert at_rest.device_mesh.ndim == 1 and at_rest.to_local().shape[0] == at_rest.shape[0] // 4
    opt.zero_grad()
    return _train_and_compare(fabric, model, opt)


@case
def int_reshard_per_unit_with_a_grad_free_forward_stays_at_rest():
    fabric, model, opt = _setup(reshard_after_forward={"Block": 2, "blocks.3": False})
    reference = _model()
    ref_opt = sgd(reference)
    for step in range(STEPS):
        fabric.backward(loss_fn(model, make_batch(step, fabric.global_rank)))
        with torch.no_grad():  # a logging forward: it must leave every unit on its full-world shards
            loss_fn(model, make_batch(50 + step, fabric.global_rank))
        plain = [n for n, p in model.named_parameters() if not isinstance(p, DTensor) or p.device_mesh.ndim != 1]
        assert not plain, f"not at rest after a grad-free forward: {plain[:3]}"
        opt.step()
        opt.zero_grad()
        loss_fn(reference, global_batch(step, WORLD)).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    # Read after the first forward: only then has FSDP2 decided that the root (not named, so automatic) keeps.
    assert _post_forward(_units(model)) == {"": "keep", "blocks.0": "group of 2", "blocks.1": "group of 2",
                                            "blocks.2": "group of 2", "blocks.3": "keep"}, _post_forward(_units(model))
    expected = reference.state_dict()
    return {"param_diff": max(assert_close(full(v), expected[k], ATOL, k) for k, v in model.state_dict().items())}


@case
def int_reshard_parity_shard_grad_op():
    fabric, model, opt = _setup(sharding_strategy="SHARD_GRAD_OP", reshard_after_forward={"models.Block": 2})
    assert _post_forward(_units(model)) == {"": "keep", **{b: "group of 2" for b in BLOCKS}}
    return _train_and_compare(fabric, model, opt)


@case
def hybrid_shard_with_every_control():
    fabric, model, opt = _setup(sharding_strategy="HYBRID_SHARD", device_mesh=(2, 2), forward_prefetch=1,
                                backward_prefetch=2, reshard_after_forward={"root": True, "blocks.3": False},
                                activation_checkpointing_policy={"every": 2, "save_ops": "default"})
    assert _checkpointed(model) == ["blocks.1", "blocks.3"]
    return _train_and_compare(fabric, model, opt)


FOUR_RANKS = [fn.__name__ for fn in CASES if fn.__name__ not in TWO_RANKS]

if __name__ == "__main__":
    mine = TWO_RANKS if WORLD == 2 else FOUR_RANKS
    CASES[:] = [fn for fn in CASES if fn.__name__ in mine]
    run_cases()
