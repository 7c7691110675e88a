"""Tensor parallelism inside FSDP on 4 CPU ranks, a (shard=2, tp=2) mesh: training matches one process, on both
fronts, with an explicit plan and with a Hugging Face model's own plan; the ranks of one tensor-parallel group see
the same batch; a bad plan is one clear error before any weight moves; clipping sees the norm over both axes;
sharded checkpoints load across (dp, tp) layouts."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from common import full, make_fabric, shared_tmpdir
from harness import assert_close, case, run_cases
from tp_models import GPT, PLAN, Block, llama, llama_block
from tp_training import (
    ATOL,
    DP,
    TP,
    WORLD,
    adamw,
    check_peers_saw_the_same_batches,
    compare,
    dp_rank,
    fabric_train,
    global_tokens,
    loss_of,
    reference,
    reference_on,
    tokens,
    trainer_fit,
    two_d_params,
)


@case
def fabric_gpt_with_an_explicit_plan_matches_one_process():
    _, model, _, losses, _ = fabric_train(GPT, {Block}, PLAN)
    ref, ref_losses, _ = reference(GPT, 3)
    # 6 planned Linear layers a block, weight and bias each, 2 blocks.
    assert two_d_params(model) == 24, f"expected 24 planned parameters on the 2-D mesh, got {two_d_params(model)}"
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= ATOL, (losses, ref_losses)
    return compare(model, ref, "fabric gpt")


@case
def fabric_hugging_face_llama_with_its_own_plan_matches_one_process():
    _, model, _, losses, _ = fabric_train(llama, {llama_block()}, "auto")
    ref, ref_losses, _ = reference(llama, 3)
    assert two_d_params(model) > 0, "the auto plan split nothing"
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= ATOL, (losses, ref_losses)
    return compare(model, ref, "fabric llama")


@case
def hybrid_sharding_with_tensor_parallel_matches_one_process():
    """``HYBRID_SHARD`` with ``device_mesh=(2, 1)`` and ``tensor_parallel_size=2``: a (replicate=2, shard=1, tp=2) mesh.
    The two replicas are the data-parallel ranks, gradients are all-reduced across them, and training matches one
    process."""
    fabric, model, _, losses, _ = fabric_train(GPT, {Block}, PLAN, sharding_strategy="HYBRID_SHARD", device_mesh=(2, 1))
    mesh = fabric.strategy.device_mesh
    assert mesh.mesh_dim_names == ("replicate", "shard", "tp") and tuple(mesh.shape) == (2, 1, 2), mesh
    ref, ref_losses, _ = reference(GPT, 3)
    assert two_d_params(model) == 24, two_d_params(model)
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= ATOL, (losses, ref_losses)
    return compare(model, ref, "hybrid gpt")


@case
def clipping_takes_the_norm_over_both_mesh_axes():
    _, model, _, _, norms = fabric_train(GPT, {Block}, PLAN, max_norm=0.05)
    ref, _, ref_norms = reference(GPT, 3, max_norm=0.05)
    for got, expected in zip(norms, ref_norms):
        assert abs(got - expected) <= 1e-5 * max(1.0, expected), (norms, ref_norms)
    return {**compare(model, ref, "clipped"), "norms": norms}


@case
def a_bad_plan_is_one_clear_error_before_any_weight_moves():
    out = {}
    for plan, needle in (
        ({"blocks.*.attn.q_prj": "colwise"}, "matches no module"),
        ({"blocks.*.ln1": "colwise"}, "LayerNorm, which a ColwiseParallel cannot split"),
        ({"head": "rowwise", "blocks.*.mlp.up": "colwise"}, None),  # fits: in_features 32 and out 128 divide by 2
        ({"blocks.*.mlp.*": "colwise", "blocks.0.mlp.up": "rowwise"}, "matched by both"),
    ):
        fabric = make_fabric(WORLD, auto_wrap_policy={Block}, tensor_parallel_size=TP, tensor_parallel_plan=plan)
        torch.manual_seed(0)
        module = GPT()
        before = {k: v.clone() for k, v in module.state_dict().items()}
        try:
            fabric.setup_module(module)
        except ValueError as err:
            assert needle and needle in str(err) and "HINT:" in str(err), f"{plan}: {err}"
            untouched = all(not isinstance(p, DTensor) for p in module.parameters()) and all(
                torch.equal(module.state_dict()[k], v) for k, v in before.items())
            assert untouched, f"{plan}: the model changed before the error"
            out[str(plan)] = str(err)[:80]
        else:
            assert needle is None, f"{plan}: no error, expected {needle!r}"
    odd = make_fabric(WORLD, auto_wrap_policy={Block}, tensor_parallel_size=TP,
                      tensor_parallel_plan={"blocks.*.mlp.up": "colwise"})
    module = nn.Sequential()
    module.add_module("blocks", nn.ModuleList([nn.Module()]))
    module.blocks[0].add_module("mlp", nn.Module())
    module.blocks[0].mlp.add_module("up", nn.Linear(4, 3))  # 3 outputs cannot split over 2 ranks
    try:
        odd.setup_module(module)
    except ValueError as err:
        assert "out_features=3" in str(err), err
        out["odd shape"] = str(err)[:80]
    else:
        raise AssertionError("an out_features of 3 split over 2 ranks was accepted")
    return out


@case
def a_tensor_parallel_size_that_does_not_divide_the_world_is_refused():
    try:
        make_fabric(WORLD, tensor_parallel_size=3, tensor_parallel_plan=PLAN).setup_module(GPT())
    except ValueError as err:
        assert "tensor_parallel_size=3" in str(err) and "[1, 2, 4]" in str(err), err
        return str(err)[:120]
    raise AssertionError("tensor_parallel_size=3 on 4 ranks was accepted")


@case
def sharded_checkpoints_load_across_dp_tp_layouts():
    """Saved on (shard=2, tp=2), loaded exactly on (shard=4) and on (shard=2, tp=2) again; the full file holds plain
    tensors equal to the gathered weights."""
    fabric, model, opt, _, _ = fabric_train(GPT, {Block}, PLAN, steps=2)
    root = shared_tmpdir(fabric)
    saved = {k: full(v).detach().clone() for k, v in model.state_dict().items()}
    fabric.save(root / "tp", {"model": model, "optimizer": opt})
    full_fabric = make_fabric(WORLD, auto_wrap_policy={Block}, tensor_parallel_size=TP, tensor_parallel_plan=PLAN,
                              state_dict_type="full")
    full_fabric.save(root / "full.pt", {"model": model})
    out = {}
    for label, kwargs in (("4x1", {}), ("2x2", {"tensor_parallel_size": TP, "tensor_parallel_plan": PLAN})):
        other = make_fabric(WORLD, auto_wrap_policy={Block}, **kwargs)
        torch.manual_seed(1)
        module = GPT()
        fresh, fresh_opt = other.setup(module, adamw(module.parameters()))
        other.load(root / "tp", {"model": fresh, "optimizer": fresh_opt})
        got = {k: full(v).detach() for k, v in fresh.state_dict().items()}
        out[label] = max(assert_close(got[k], saved[k], 0.0, f"{label} {k}") for k in saved)
        assert fresh_opt.state, f"{label}: the optimizer state was not loaded"
    if dist.get_rank() == 0:
        plain = torch.load(root / "full.pt", weights_only=True)["model"]
        assert all(not isinstance(v, DTensor) for v in plain.values())
        out["full file"] = max(assert_close(plain[k], saved[k], 0.0, f"full {k}") for k in saved)
    if dist.get_rank() == 0:  # kept for the other layouts: (shard=1, tp=2) and one process, in later launches
        keep = Path(os.environ["LFSDP_TEST_OUT"]) / "saved_2x2"
        shutil.copytree(root / "tp", keep / "checkpoint")
        torch.save(saved, keep / "weights.pt")
    fabric.barrier()
    return out


@case
def meta_device_init_splits_pieces_and_keeps_copies_equal():
    """``init_module(empty_init=True)`` under TP: each piece of a split weight gets its own values, and what TP
    replicates (norms, the unplanned embedding and head) is the same on both ranks of a group."""
    fabric = make_fabric(WORLD, auto_wrap_policy={Block}, tensor_parallel_size=TP, tensor_parallel_plan=PLAN)
    with fabric.init_module(empty_init=True):
        module = GPT()
    model = fabric.setup_module(module)
    tp_group = model.module.blocks[0].mlp.up.weight.device_mesh["tp"].get_group()
    pieces, copies = {}, {}
    for name, param in model.module.named_parameters():
        local = param.to_local().detach().clone()
        assert torch.isfinite(local).all(), name
        gathered = [torch.empty_like(local) for _ in range(TP)]
        dist.all_gather(gathered, local, group=tp_group)
        same = torch.equal(gathered[0], gathered[1])
        split = "tp" in (param.device_mesh.mesh_dim_names or ()) and not isinstance(
            param.placements[param.device_mesh.mesh_dim_names.index("tp")], torch.distributed.tensor.Replicate)
        (pieces if split else copies)[name] = same
    assert pieces and not any(pieces.values()), f"split weights with equal pieces on a tp group: {pieces}"
    assert copies and all(copies.values()), f"replicated parameters that differ within a tp group: {copies}"
    loss = loss_of(model, tokens(0, dp_rank()))
    fabric.backward(loss)
    assert torch.isfinite(loss)
    return {"split": len(pieces), "replicated": len(copies)}


@case
def activation_checkpointing_and_accumulation_without_sync_match_one_process():
    """fp32 with every block checkpointed, two micro-batches a step, the first under ``no_backward_sync``."""
    fabric = make_fabric(WORLD, auto_wrap_policy={Block}, tensor_parallel_size=TP, tensor_parallel_plan=PLAN,
                         activation_checkpointing_policy={Block})
    torch.manual_seed(0)
    module = GPT()
    model, opt = fabric.setup(module, adamw(module.parameters()))
    for step in range(2):
        batch = tokens(step, dp_rank())
        with fabric.no_backward_sync(model, enabled=True):
            fabric.backward(loss_of(model, batch[:1]) / 2)
        fabric.backward(loss_of(model, batch[1:]) / 2)
        opt.step()
        opt.zero_grad()
    torch.manual_seed(0)
    ref = GPT()
    ref_opt = adamw(ref.parameters())
    for step in range(2):
        # The same micro-batches: each data-parallel rank's first row, then its second.
        batches = [tokens(step, r) for r in range(DP)]
        for row in (0, 1):
            (loss_of(ref, torch.stack([b[row] for b in batches])) / 2).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    return compare(model, ref, "checkpointed, accumulated")


@case
def bf16_mixed_precision_trains():
    fabric = make_fabric(WORLD, precision="bf16-mixed", auto_wrap_policy={Block}, tensor_parallel_size=TP,
                         tensor_parallel_plan=PLAN)
    torch.manual_seed(0)
    module = GPT()
    model, opt = fabric.setup(module, adamw(module.parameters()))
    batch = tokens(0, dp_rank())
    losses = []
    for _ in range(5):  # the same batch: the loss must fall
        loss = loss_of(model, batch)
        fabric.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert all(map(lambda v: v == v, losses)) and losses[-1] < losses[0], losses
    return {"losses": losses}


@case
def bf16_true_precision_trains_like_one_process_in_bf16():
    """``bf16-true``: the split and the replicated parameters are bf16 DTensors, and three steps track one process
    trained in bf16 on the same global batches, within bf16's rounding (its 8-bit mantissa: about 4e-3 relative)."""
    fabric = make_fabric(WORLD, precision="bf16-true", auto_wrap_policy={Block}, tensor_parallel_size=TP,
                         tensor_parallel_plan=PLAN)
    torch.manual_seed(0)
    module = GPT()
    reference = GPT().to(torch.bfloat16)
    reference.load_state_dict(module.state_dict())
    model, opt = fabric.setup(module, adamw(module.parameters()))
    dtypes = {p.dtype for p in model.parameters()}
    assert dtypes == {torch.bfloat16} and two_d_params(model) == 24, (dtypes, two_d_params(model))
    ref_opt = adamw(reference.parameters())
    losses, ref_losses = [], []
    for step in range(3):
        loss = loss_of(model, tokens(step, dp_rank()))
        fabric.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(fabric.all_reduce(loss.detach().float(), reduce_op="mean").item())
        ref_loss = loss_of(reference, global_tokens(step))
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(ref_loss.item())
    assert all(abs(a - b) <= 2e-2 * abs(b) for a, b in zip(losses, ref_losses)), (losses, ref_losses)
    return {"losses": losses, "reference_losses": ref_losses}


@case
def hugging_face_safetensors_load_straight_into_the_2d_shards():
    """``save_pretrained`` output into a tiny Llama built on the meta device and split by its own plan: through
    ``lightning_fsdp.load_pretrained`` and ``fabric.load_raw``, every weight equals the saved one."""
    import lightning_fsdp

    fabric = make_fabric(WORLD, auto_wrap_policy={llama_block()}, tensor_parallel_size=TP, tensor_parallel_plan="auto")
    root = shared_tmpdir(fabric)
    torch.manual_seed(5)
    if fabric.global_rank == 0:
        llama().save_pretrained(root / "hf")
    fabric.barrier()
    expected = llama_state(root / "hf")
    out = {}
    for route in ("load_pretrained", "load_raw"):
        with fabric.init_module(empty_init=True):
            module = llama()
        model = fabric.setup_module(module)
        assert two_d_params(model.module) > 0
        if route == "load_pretrained":
            lightning_fsdp.load_pretrained(model.module, root / "hf")
        else:
            fabric.load_raw(root / "hf", model)
        got = {k: full(v).detach() for k, v in model.module.state_dict().items()}
        out[route] = max(assert_close(got[k], expected[k], 0.0, f"{route} {k}") for k in expected)
    return out


def llama_state(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


# --- The memory plan's measured side ------------------------------------------------------------------------------


@case
def tracker_peaks_of_the_planned_tensor_parallel_steps():
    """The steps ``test_tensor_parallel.py`` plans with ``plan_memory``, run for real and measured by torch's
    ``FSDPMemTracker``, in the steady state (one step first, as the planner plans): the GPT-style model with its plan
    and the Llama with ``"auto"``. Each rank's peak over two measured steps, and the floor over ranks and steps (gloo's
    late frees only ever add to a measured peak)."""
    from lightning_fsdp._base.compat import planner_tools
    from tp_models import gpt_batch, llama_batch

    tracker_class = planner_tools()[2]
    out = {}
    for label, build, policy, plan, batch in (("gpt", GPT, {Block}, PLAN, gpt_batch()),
                                              ("llama", llama, {llama_block()}, "auto", llama_batch())):
        fabric = make_fabric(WORLD, auto_wrap_policy=policy, tensor_parallel_size=TP, tensor_parallel_plan=plan)
        torch.manual_seed(0)
        module = build()
        model, opt = fabric.setup(module, torch.optim.AdamW(module.parameters()))
        args, kwargs = ((), batch) if isinstance(batch, dict) else ((batch,), {})

        def step() -> None:
            output = model(*args, **kwargs)  # the planner's step: the output's `.loss`, else the sum of the output
            fabric.backward(output.loss if hasattr(output, "loss") else output.float().sum())
            opt.step()
            opt.zero_grad(set_to_none=True)

        step()
        peaks = []
        for _ in range(2):
            tracker = tracker_class(model.module, opt.optimizer)
            tracker.track_inputs((args, kwargs))
            with tracker:
                step()
            peaks.append(sum(table["Total"] for table in tracker.get_tracker_snapshot("peak").values()))
        floor = torch.tensor(min(peaks))
        dist.all_reduce(floor, op=dist.ReduceOp.MIN)
        sharded = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
        out[label] = {"tracker_peak": int(floor), "peaks": peaks, "sharded_param_bytes": sharded}
    return out


@case
def trainer_gpt_with_an_explicit_plan_matches_one_process_and_tp_peers_share_batches():
    lit = trainer_fit(GPT, {Block}, PLAN)
    gathered = check_peers_saw_the_same_batches(lit)
    assert two_d_params(lit.model) == 24
    return compare(lit.model, reference_on(GPT, gathered), "trainer gpt")


@case
def trainer_hugging_face_llama_with_its_own_plan_matches_one_process():
    lit = trainer_fit(llama, {llama_block()}, "auto")
    gathered = check_peers_saw_the_same_batches(lit)
    return compare(lit.model, reference_on(llama, gathered), "trainer llama")


# --- (shard=1, tp=2): a 2-rank launch of this file with LFSDP_TP_LOAD set ---------------------------------------


def loads_on_one_by_two():
    """The (2, 2) checkpoint of ``sharded_checkpoints_load_across_dp_tp_layouts`` on 2 ranks as (shard=1, tp=2)."""
    saved_dir = Path(os.environ["LFSDP_TP_LOAD"])
    fabric = make_fabric(2, auto_wrap_policy={Block}, tensor_parallel_size=2, tensor_parallel_plan=PLAN)
    torch.manual_seed(1)
    module = GPT()
    model, opt = fabric.setup(module, adamw(module.parameters()))
    fabric.load(saved_dir / "checkpoint", {"model": model, "optimizer": opt})
    saved = torch.load(saved_dir / "weights.pt", weights_only=True)
    assert two_d_params(model) == 24
    got = {k: full(v).detach() for k, v in model.state_dict().items()}
    assert opt.state, "the optimizer state was not loaded"
    return {"max_diff": max(assert_close(got[k], saved[k], 0.0, f"1x2 {k}") for k in saved)}


if __name__ == "__main__":
    if "LFSDP_TP_LOAD" in os.environ:
        import harness

        harness.CASES[:] = [loads_on_one_by_two]
    run_cases()
