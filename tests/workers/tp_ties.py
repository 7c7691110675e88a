"""Tied weights under tensor parallelism, 4 ranks as (shard=2, tp=2) (issue 37, item 1). A parameter that two
modules share (input embedding and output head) stays one parameter through TP and FSDP: the same object in both
modules after setup, after training, after a checkpoint round trip and in the export, and the training matches one
process. A plan that splits the two sides differently is refused before any weight moves, naming the tie; a plan
that splits one side only gets the matching style on the other (Hugging Face's own plan for a tied Llama splits only
``lm_head``)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

from common import full, make_fabric, shared_tmpdir
from harness import case, run_cases
from tp_models import PLAN, Block, TiedGPT, llama_block, tied_llama
from tp_training import (
    ATOL,
    TP,
    WORLD,
    adamw,
    check_peers_saw_the_same_batches,
    compare,
    fabric_train,
    reference,
    reference_on,
    trainer_fit,
)

LLAMA_PLAN = {  # Hugging Face's plan for the Llama, written out, with both sides of the tie split by vocabulary rows
    "model.layers.*.self_attn.q_proj": "colwise", "model.layers.*.self_attn.k_proj": "colwise",
    "model.layers.*.self_attn.v_proj": "colwise", "model.layers.*.self_attn.o_proj": "rowwise",
    "model.layers.*.mlp.gate_proj": "colwise", "model.layers.*.mlp.up_proj": "colwise",
    "model.layers.*.mlp.down_proj": "rowwise",
    "model.embed_tokens": "embedding_rowwise", "lm_head": "colwise_rep",
}


def _sides(model):
    module = getattr(model, "module", model)
    if hasattr(module, "lm_head"):
        return module.model.embed_tokens, module.lm_head
    return module.wte, module.head


def _one_parameter(model, what: str, split_dim: int = 0) -> tuple:
    embedding, head = _sides(model)
    assert head.weight is embedding.weight, f"{what}: the tied weight is two parameters"
    assert isinstance(head.weight, DTensor), f"{what}: the tied weight is not a DTensor"
    names = [n for n, p in getattr(model, "module", model).named_parameters() if p is head.weight]
    assert len(names) == 1, f"{what}: named_parameters lists the tied weight {len(names)} times: {names}"
    placements = tuple(head.weight.placements)
    assert placements[-1] == Shard(split_dim), f"{what}: the tied weight is not split on dim {split_dim}: {placements}"
    return placements


def _train_and_compare(build, policy, plan, label: str, split_dim: int = 0, steps: int = 3) -> dict:
    _, model, opt, losses, _ = fabric_train(build, policy, plan, steps=steps)
    placements = _one_parameter(model, label, split_dim)
    assert sum(1 for group in opt.param_groups for p in group["params"] if p is _sides(model)[1].weight) == 1
    ref, ref_losses, _ = reference(build, steps)
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= ATOL, (label, losses, ref_losses)
    return {**compare(model, ref, label), "placements": str(placements)}


@case
def tied_hugging_face_llama_with_its_own_plan_keeps_one_parameter_and_matches_one_process():
    """``"auto"``: Hugging Face's plan splits ``lm_head`` (``colwise_gather_output``) and leaves ``embed_tokens``
    alone; the embedding gets ``embedding_rowwise``, which splits the shared weight the same way."""
    return _train_and_compare(tied_llama, {llama_block()}, "auto", "tied llama auto")


@case
def tied_hugging_face_llama_with_an_explicit_plan_keeps_one_parameter_and_matches_one_process():
    return _train_and_compare(tied_llama, {llama_block()}, LLAMA_PLAN, "tied llama explicit")


@case
def tied_gpt_head_with_explicit_plans_keeps_one_parameter_and_matches_one_process():
    """The head alone (``colwise_rep``), the embedding alone (``embedding_rowwise``), and both, with the blocks;
    and the head alone split by its input columns (``rowwise_rep``: the embedding gets ``embedding_colwise``)."""
    out = {}
    for label, extra, dim in (("head", {"head": "colwise_rep"}, 0), ("embedding", {"wte": "embedding_rowwise"}, 0),
                              ("both", {"wte": "embedding_rowwise", "head": "colwise_rep"}, 0),
                              ("head by columns", {"head": "rowwise_rep"}, 1)):
        out[label] = _train_and_compare(TiedGPT, {Block}, {**PLAN, **extra}, f"tied gpt {label}", dim, steps=2)
    return out


@case
def a_plan_that_splits_a_tie_two_ways_is_refused_before_any_weight_moves():
    """Embedding split by columns, head by vocabulary rows: two placements of one parameter. A head style that
    leaves the weight whole next to a split embedding. A third holder of the weight that no style can split."""
    from torch.distributed.tensor.parallel import PrepareModuleInput
    from torch.distributed.tensor import Replicate

    out = {}
    for label, extra, needles in (
        ("two ways", {"wte": "embedding_colwise", "head": "colwise"},
         ("wte.weight and head.weight are", "Shard(dim=1)", "Shard(dim=0)", "'wte': 'embedding_colwise'")),
        ("one side left whole",
         {"wte": "embedding_rowwise", "head": PrepareModuleInput(input_layouts=Replicate(),
                                                                 desired_input_layouts=Replicate())},
         ("wte.weight and head.weight are", "the style of 'head' leaves 'weight' whole")),
        ("no style for a side", {"head": "colwise_rep"},
         ("plan={'head': 'colwise_rep'}", "wte.weight, head.weight and extra.weight are",
          "no style splits extra.weight of the Module 'extra'")),
    ):
        fabric = make_fabric(WORLD, auto_wrap_policy={Block}, tensor_parallel_size=TP,
                             tensor_parallel_plan={**PLAN, **extra})
        torch.manual_seed(0)
        module = TiedGPT()
        if label == "no style for a side":  # a third holder of the weight, of a module type no style splits
            module.extra = torch.nn.Module()
            module.extra.weight = module.wte.weight
        before = {k: v.clone() for k, v in module.state_dict().items()}
        try:
            fabric.setup_module(module)
        except ValueError as err:
            message = str(err)
            for needle in ("are one tied parameter", "HINT:", *needles):
                assert needle in message, f"{label}: {needle!r} not in {message}"
            assert module.head.weight is module.wte.weight and not isinstance(module.wte.weight, DTensor), label
            assert all(torch.equal(module.state_dict()[k], v) for k, v in before.items()), f"{label}: weights moved"
            out[label] = message[:160]
        else:
            raise AssertionError(f"{label}: the plan {extra} was accepted")
    return out


@case
def a_callable_plan_that_unties_weights_is_refused():
    def head_only(module, tp_mesh):
        parallelize_module(module.head, tp_mesh, ColwiseParallel())

    fabric = make_fabric(WORLD, auto_wrap_policy={Block}, tensor_parallel_size=TP, tensor_parallel_plan=head_only)
    try:
        fabric.setup_module(TiedGPT())
    except ValueError as err:
        assert "wte.weight and head.weight are one tied parameter" in str(err) and "HINT:" in str(err), err
        assert "wte.weight as whole" in str(err), err
        return str(err)[:160]
    raise AssertionError("a callable plan that split one side of a tie was accepted")


@case
def tied_weights_stay_one_parameter_through_checkpoints():
    """The tied Llama with ``"auto"``, 2 steps, saved sharded and full; each loads into a fresh model on the same
    layout with the tie intact and every value equal. The sharded checkpoint and the saved weights are kept for the
    pytest side's export checks."""
    fabric, model, opt, _, _ = fabric_train(tied_llama, {llama_block()}, "auto", steps=2)
    root = shared_tmpdir(fabric)
    saved = {k: full(v).detach().clone() for k, v in model.state_dict().items()}
    assert torch.equal(saved["lm_head.weight"], saved["model.embed_tokens.weight"])
    fabric.save(root / "sharded", {"model": model, "optimizer": opt})
    make_fabric(WORLD, auto_wrap_policy={llama_block()}, tensor_parallel_size=TP, tensor_parallel_plan="auto",
                state_dict_type="full").save(root / "full.pt", {"model": model, "optimizer": opt})
    out = {}
    for label, path in (("sharded", root / "sharded"), ("full", root / "full.pt")):
        torch.manual_seed(1)
        module = tied_llama()
        fresh, fresh_opt = fabric.setup(module, adamw(module.parameters()))
        fabric.load(path, {"model": fresh, "optimizer": fresh_opt})
        _one_parameter(fresh, f"after loading the {label} checkpoint")
        got = {k: full(v).detach() for k, v in fresh.state_dict().items()}
        assert sorted(got) == sorted(saved)
        out[label] = max((got[k] - v).abs().max().item() for k, v in saved.items())
        assert out[label] == 0.0, (label, out[label])
    if dist.get_rank() == 0:
        plain = torch.load(root / "full.pt", weights_only=True)["model"]
        assert torch.equal(plain["lm_head.weight"], plain["model.embed_tokens.weight"]), "the full file unties them"
        keep = Path(os.environ["LFSDP_TEST_OUT"]) / "tied_saved"
        shutil.copytree(root / "sharded", keep / "checkpoint")
        torch.save(saved, keep / "weights.pt")
    fabric.barrier()
    return out


@case
def tied_hugging_face_llama_built_on_the_meta_device_keeps_one_parameter():
    """``init_module(empty_init=True)`` then setup with ``"auto"``: one materialized parameter, before and after a
    step."""
    fabric = make_fabric(WORLD, auto_wrap_policy={llama_block()}, tensor_parallel_size=TP, tensor_parallel_plan="auto")
    with fabric.init_module(empty_init=True):
        module = tied_llama()
    model, opt = fabric.setup(module, adamw(module.parameters()))
    placements = _one_parameter(model, "meta init")
    weight = _sides(model)[1].weight
    assert not weight.is_meta and torch.isfinite(weight.to_local()).all()
    loss = model(input_ids=torch.zeros(2, 4, dtype=torch.long), labels=torch.zeros(2, 4, dtype=torch.long)).loss
    fabric.backward(loss)
    opt.step()
    _one_parameter(model, "meta init, after a step")
    return {"placements": str(placements), "loss": loss.item()}


@case
def trainer_tied_hugging_face_llama_with_its_own_plan_keeps_one_parameter_and_matches_one_process():
    lit = trainer_fit(tied_llama, {llama_block()}, "auto")
    _one_parameter(lit.model, "trainer tied llama")
    gathered = check_peers_saw_the_same_batches(lit)
    return compare(lit.model, reference_on(tied_llama, gathered), "trainer tied llama")


@case
def trainer_tied_gpt_with_an_explicit_plan_keeps_one_parameter_and_matches_one_process():
    lit = trainer_fit(TiedGPT, {Block}, {**PLAN, "wte": "embedding_rowwise", "head": "colwise_rep"})
    _one_parameter(lit.model, "trainer tied gpt")
    gathered = check_peers_saw_the_same_batches(lit)
    return compare(lit.model, reference_on(TiedGPT, gathered), "trainer tied gpt")


if __name__ == "__main__":
    run_cases()
