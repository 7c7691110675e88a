"""Two-rank Fabric cases for the code real users write around the training step: forwards without backward (logging,
evaluation, generation), two forwards and one backward, EMA/teacher models updated in place, optimizers built after
an evaluation forward, and ranks that built their models from different seeds.

Every case compares with a single-process reference computed here, on the concatenation of the ranks' batches. The
extra forwards run in both, so the reference also checks the values they return (logged losses, generated tokens).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from common import (
    full,
    global_batch,
    grad_free_forwards,
    loss_fn,
    make_fabric,
    max_param_diff,
    model_and_reference,
    sgd,
    train_side_by_side,
)
from harness import assert_close, case, rank, run_cases
from models import Block, TinyTransformer, make_batch

WORLD = 2
ATOL = 1e-5
STEPS = 4

# (label, strategy arguments): every sharding strategy, with activation checkpointing, CPU offload and the
# `reshard_after_forward` override, since each leaves a different set of units unsharded after forward.
CONFIGS = {
    "full_shard": dict(sharding_strategy="FULL_SHARD"),
    "shard_grad_op": dict(sharding_strategy="SHARD_GRAD_OP"),
    "no_shard": dict(sharding_strategy="NO_SHARD"),
    "full_shard_ac": dict(sharding_strategy="FULL_SHARD", activation_checkpointing_policy={Block}),
    "shard_grad_op_ac": dict(sharding_strategy="SHARD_GRAD_OP", activation_checkpointing_policy={Block}),
    "cpu_offload": dict(cpu_offload=True),
    "keep_after_forward": dict(sharding_strategy="FULL_SHARD", reshard_after_forward=False),
    # Per-unit choices turn FSDP2's usual split around (the root resharded, the blocks kept), and explicit prefetch
    # gathers units ahead of their forward: both leave units gathered that the defaults would not.
    "per_unit_reshard": dict(sharding_strategy="FULL_SHARD", reshard_after_forward={"root": True, "Block": False},
                             forward_prefetch=1, backward_prefetch=2),
}

_FABRICS: dict[str, object] = {}


def fabric_for(label: str):
    # One Fabric per configuration, shared by the cases: they all run in the one process group of this launch.
    if label not in _FABRICS:
        _FABRICS[label] = make_fabric(WORLD, **CONFIGS[label])
    return _FABRICS[label]


def assert_at_rest(model: nn.Module, what: str) -> None:
    """Every parameter is the DTensor shard the optimizer holds, not a gathered plain tensor."""
    plain = [n for n, p in model.named_parameters() if not isinstance(p, DTensor)]
    assert not plain, f"{what}: {len(plain)} parameter(s) left unsharded, e.g. {plain[:3]}"


# --- 1. forwards without backward, before a step -------------------------------------------------------------


def _with_extra_forwards(label: str, extra: Callable[[nn.Module, torch.Tensor], torch.Tensor]) -> dict:
    """Train STEPS steps of two micro-batches (the first under `no_backward_sync`); after the backwards and before
    the step, run ``extra`` on the model (a grad-free logging loss, say). The reference runs the same."""
    fabric = fabric_for(label)
    model, opt, reference, ref_opt = model_and_reference(fabric)
    extras, ref_extras = [], []
    for step in range(STEPS):
        for micro in range(2):
            with fabric.no_backward_sync(model, enabled=micro == 0):
                fabric.backward(loss_fn(model, make_batch(10 * step + micro, fabric.global_rank)) / 2)
            (loss_fn(reference, global_batch(10 * step + micro, WORLD)) / 2).backward()
        probe = make_batch(100 + step, fabric.global_rank)
        extras.append(fabric.all_reduce(extra(model, probe).detach().float(), reduce_op="mean"))
        ref_extras.append(torch.stack(
            [extra(reference, make_batch(100 + step, r)).detach().float() for r in range(WORLD)]).mean(0))
        assert_at_rest(model, f"after the extra forward of step {step}")
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
    extra_diff = max(assert_close(a, b, ATOL, f"extra output at step {i}")
                     for i, (a, b) in enumerate(zip(extras, ref_extras)))
    return {"param_diff": max_param_diff(model, reference, ATOL), "extra_output_diff": extra_diff}


EXTRAS = grad_free_forwards(loss_fn)


def _register_extra_cases() -> None:
    # The full cross product would be 28 cases; every strategy gets the no_grad forward, and each other kind of
    # forward runs under the strategies whose units stay unsharded differently (root only, or every unit).
    chosen = [(label, "no_grad") for label in CONFIGS]
    chosen += [(label, kind) for label in ("full_shard", "shard_grad_op_ac", "cpu_offload")
               for kind in ("inference_mode", "eval_mode", "generation")]
    chosen += [("per_unit_reshard", "generation")]
    for label, kind in chosen:
        def run(label=label, kind=kind):
            return _with_extra_forwards(label, EXTRAS[kind])
        run.__name__ = f"{kind}_forward_before_step_{label}"
        case(run)


_register_extra_cases()


@case
def two_forwards_one_backward():
    # The first forward's output is dropped; only the second is backpropagated.
    fabric = fabric_for("shard_grad_op")
    model, opt, reference, ref_opt = model_and_reference(fabric)
    for step in range(STEPS):
        loss_fn(model, make_batch(50 + step, fabric.global_rank))
        fabric.backward(loss_fn(model, make_batch(step, fabric.global_rank)))
        opt.step()
        opt.zero_grad()
        loss_fn(reference, global_batch(step, WORLD)).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    return {"param_diff": max_param_diff(model, reference, ATOL)}


@case
def extra_forwards_change_nothing_under_bf16_mixed():
    # Low precision has no single-process twin to 1e-5, so compare with the same run without the extra forwards:
    # they must not change a single bit of training.
    results = []
    for extra in (False, True):
        fabric = make_fabric(WORLD, precision="bf16-mixed", sharding_strategy="SHARD_GRAD_OP")
        model, opt, _, _ = model_and_reference(fabric)
        for step in range(STEPS):
            fabric.backward(loss_fn(model, make_batch(step, fabric.global_rank)))
            if extra:
                EXTRAS["no_grad"](model, make_batch(100 + step, fabric.global_rank))
            opt.step()
            opt.zero_grad()
        results.append({k: full(v).detach().clone() for k, v in model.state_dict().items()})
    diff = max((results[0][k] - results[1][k]).abs().max().item() for k in results[0])
    assert diff == 0.0, f"a grad-free forward changed bf16-mixed training by {diff:.3e}"
    return {"diff": diff}


# --- 2. EMA / teacher models updated in place ---------------------------------------------------------------


def _ema_run(fabric, momentum: float = 0.9) -> dict:
    """BYOL/DINO-style: a teacher (EMA of the student) set up as a second sharded model, evaluated under no_grad,
    and updated in place with `lerp_` after each step."""
    torch.manual_seed(0)
    student_plain = TinyTransformer()
    teacher_plain = TinyTransformer()
    teacher_plain.load_state_dict(student_plain.state_dict())
    teacher_plain.requires_grad_(False)
    ref_student, ref_teacher = TinyTransformer(), TinyTransformer()
    ref_student.load_state_dict(student_plain.state_dict())
    ref_teacher.load_state_dict(student_plain.state_dict())
    ref_teacher.requires_grad_(False)
    student, opt = fabric.setup(student_plain, sgd(student_plain))
    teacher = fabric.setup_module(teacher_plain)
    ref_opt = sgd(ref_student)

    def distill(s, t, batch):
        with torch.no_grad():
            target = t(batch[:, :-1]).softmax(-1)
        logits = s(batch[:, :-1])
        return -(target * logits.log_softmax(-1)).sum(-1).mean() + loss_fn(s, batch)

    for step in range(STEPS):
        fabric.backward(distill(student, teacher, make_batch(step, fabric.global_rank)))
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for p_t, p_s in zip(teacher.parameters(), student.parameters()):
                p_t.lerp_(p_s, 1 - momentum)
        distill(ref_student, ref_teacher, global_batch(step, WORLD)).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        with torch.no_grad():
            for p_t, p_s in zip(ref_teacher.parameters(), ref_student.parameters()):
                p_t.lerp_(p_s, 1 - momentum)
    assert_at_rest(teacher, "teacher after its update")
    return {
        "student_diff": max_param_diff(student, ref_student, ATOL, "student."),
        "teacher_diff": max_param_diff(teacher, ref_teacher, ATOL, "teacher."),
    }


@case
def ema_teacher_updated_in_place_full_shard():
    return _ema_run(fabric_for("full_shard"))


@case
def ema_teacher_updated_in_place_shard_grad_op_ac():
    return _ema_run(fabric_for("shard_grad_op_ac"))


@case
def ema_teacher_updated_in_place_no_shard():
    return _ema_run(fabric_for("no_shard"))


# --- 3. optimizers built after an evaluation forward (separate setup) ------------------------------------------


def _optimizer_after_forward(label: str, grad_enabled: bool) -> dict:
    fabric = fabric_for(label)
    torch.manual_seed(0)
    model = fabric.setup_module(TinyTransformer())
    torch.manual_seed(0)
    reference = TinyTransformer()
    with torch.set_grad_enabled(grad_enabled):
        loss_fn(model, make_batch(99, fabric.global_rank))  # evaluation before training; output dropped
    opt = fabric.setup_optimizers(sgd(model))
    held = [p for group in opt.param_groups for p in group["params"]]
    assert all(isinstance(p, DTensor) for p in held), "the optimizer was given gathered tensors, not the shards"
    train_side_by_side(fabric, model, opt, reference, sgd(reference), STEPS)
    return {"param_diff": max_param_diff(model, reference, ATOL)}


@case
def optimizer_built_after_a_no_grad_forward_trains_the_root_full_shard():
    return _optimizer_after_forward("full_shard", grad_enabled=False)


@case
def optimizer_built_after_a_dropped_forward_trains_the_root_full_shard():
    return _optimizer_after_forward("full_shard", grad_enabled=True)


@case
def optimizer_built_after_a_dropped_forward_trains_every_unit_shard_grad_op():
    return _optimizer_after_forward("shard_grad_op", grad_enabled=True)


@case
def state_dict_after_a_dropped_forward_holds_shards():
    fabric = fabric_for("shard_grad_op")
    torch.manual_seed(0)
    model = fabric.setup_module(TinyTransformer())
    loss_fn(model, make_batch(0, fabric.global_rank))  # grad enabled, never backpropagated
    state = model.state_dict()
    plain = [k for k, v in state.items() if not isinstance(v, DTensor)]
    assert not plain, f"state_dict() returned gathered tensors for {plain[:3]}"
    assert_at_rest(model, "after state_dict()")
    return {"keys": len(state)}


@case
def several_models_each_stay_at_rest():
    # A generator and a discriminator; the discriminator judges generated samples under no_grad for logging.
    fabric = fabric_for("full_shard")
    gen, opt_g, ref_gen, ref_opt_g = model_and_reference(fabric)
    torch.manual_seed(1)
    disc_plain = TinyTransformer()
    torch.manual_seed(1)
    ref_disc = TinyTransformer()
    disc, opt_d = fabric.setup(disc_plain, sgd(disc_plain))
    ref_opt_d = sgd(ref_disc)
    for step in range(STEPS):
        for model, opt, ref, ref_opt in ((gen, opt_g, ref_gen, ref_opt_g), (disc, opt_d, ref_disc, ref_opt_d)):
            fabric.backward(loss_fn(model, make_batch(step, fabric.global_rank)))
            loss_fn(ref, global_batch(step, WORLD)).backward()
            with torch.no_grad():
                loss_fn(gen, make_batch(60 + step, fabric.global_rank))
                loss_fn(disc, make_batch(70 + step, fabric.global_rank))
            opt.step()
            opt.zero_grad()
            ref_opt.step()
            ref_opt.zero_grad()
    return {"gen_diff": max_param_diff(gen, ref_gen, ATOL, "gen."),
            "disc_diff": max_param_diff(disc, ref_disc, ATOL, "disc.")}


# --- 4. ranks that built their models from different seeds ------------------------------------------------------


class WithBuffers(TinyTransformer):
    """TinyTransformer with two buffers that take part in forward: one persistent, one not."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", 1 + 0.1 * torch.rand(16))
        self.register_buffer("shift", 0.1 * torch.randn(16), persistent=False)
        self.embed.register_forward_hook(lambda m, a, out: out * self.scale + self.shift)

    def reset_parameters(self) -> None:
        super().reset_parameters()
        # Random on purpose: each rank's generator would give its own values.
        self.scale.copy_(1 + 0.1 * torch.rand(16))
        self.shift.copy_(0.1 * torch.randn(16))


def _rank0_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    state = {**{n: p.detach().clone() for n, p in model.named_parameters()},
             **{n: b.clone() for n, b in model.named_buffers()}}
    box = [state]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _seeded_by_rank(label: str) -> dict:
    fabric = fabric_for(label)
    torch.manual_seed(1234 + 17 * rank())  # every rank builds a different model
    plain = WithBuffers()
    expected = _rank0_tensors(plain)
    model, opt = fabric.setup(plain, sgd(plain))
    diff = 0.0
    for name, param in model.module.named_parameters():
        diff = max(diff, assert_close(full(param), expected[name], 0.0, f"parameter {name}"))
    for name, buf in model.module.named_buffers():
        diff = max(diff, assert_close(buf, expected[name], 0.0, f"buffer {name}"))
    # And training from there matches a reference that starts from rank 0's model.
    reference = WithBuffers()
    with torch.no_grad():
        for name, t in [*reference.named_parameters(), *reference.named_buffers()]:
            t.copy_(expected[name])
    train_side_by_side(fabric, model, opt, reference, sgd(reference), STEPS)
    return {"init_diff": diff, "param_diff": max_param_diff(model, reference, ATOL)}


@case
def ranks_seeded_differently_start_from_rank0_full_shard():
    return _seeded_by_rank("full_shard")


@case
def ranks_seeded_differently_start_from_rank0_shard_grad_op():
    return _seeded_by_rank("shard_grad_op")


@case
def ranks_seeded_differently_start_from_rank0_no_shard():
    return _seeded_by_rank("no_shard")


@case
def ranks_seeded_differently_start_from_rank0_cpu_offload():
    return _seeded_by_rank("cpu_offload")


@case
def meta_init_buffers_agree_across_ranks():
    fabric = fabric_for("full_shard")
    torch.manual_seed(1234 + 17 * rank())
    with fabric.init_module(empty_init=True):
        plain = WithBuffers()
    model = fabric.setup_module(plain)
    bufs = {n: b.clone() for n, b in model.module.named_buffers()}
    box = [bufs]
    dist.broadcast_object_list(box, src=0)
    diff = max(assert_close(bufs[n], box[0][n], 0.0, f"buffer {n}") for n in bufs)
    # The parameters are sharded: each shard has its own values, and the two halves of a weight differ.
    weight = full(model.module.head.weight)
    assert not torch.equal(weight[: weight.shape[0] // 2], weight[weight.shape[0] // 2:])
    return {"buffer_diff": diff}


@case
def sync_module_states_false_keeps_each_ranks_values():
    fabric = make_fabric(WORLD, sync_module_states=False)
    torch.manual_seed(1234 + 17 * rank())
    plain = WithBuffers()
    own_scale = plain.scale.clone()
    model = fabric.setup_module(plain)
    assert torch.equal(model.module.scale, own_scale), "sync_module_states=False still broadcast the buffers"
    others = [None] * WORLD
    dist.all_gather_object(others, own_scale)
    assert not torch.equal(others[0], others[1]), "the ranks' seeds did not give different buffers"
    return {}


@case
def registry_strings_train_on_cpu():
    # `import lightning_fsdp` makes the names work on CPU (Lightning alone refuses them there).
    from lightning.fabric import Fabric

    diffs = {}
    for name in ("fsdp", "fsdp_cpu_offload", "hsdp"):
        fabric = Fabric(accelerator="cpu", devices=WORLD, strategy=name)
        fabric.launch()
        assert type(fabric.strategy).__module__ == "lightning_fsdp.fabric", type(fabric.strategy)
        model, opt, reference, ref_opt = model_and_reference(fabric)
        train_side_by_side(fabric, model, opt, reference, ref_opt, STEPS)
        diffs[name] = max_param_diff(model, reference, ATOL, f"{name}: ")
    return diffs


if __name__ == "__main__":
    run_cases()
