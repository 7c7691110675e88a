"""Tied weights under tensor parallelism (issue 37, item 1; ``workers/tp_ties.py``, in the 4-rank pool) and
``"sequence_parallel"`` refused by name (item 8, in this process): a parameter two modules share stays one parameter
through TP and FSDP on both fronts, with Hugging Face's own plan and with explicit ones, matches one process, keeps
its tie through sharded and full checkpoints, and is one tensor in the exports."""

import sys

import pytest
import torch
from torch.distributed.tensor.parallel import SequenceParallel

from launch import WORKERS, case_tests
from lightning_fsdp.checkpoint.convert import convert
from lightning_fsdp.engine.tensor_parallel import parse_tensor_parallel, resolve_plan

sys.path.insert(0, str(WORKERS))
from tp_models import GPT, tied_llama  # noqa: E402

CASES = [
    "tied_hugging_face_llama_with_its_own_plan_keeps_one_parameter_and_matches_one_process",
    "tied_hugging_face_llama_with_an_explicit_plan_keeps_one_parameter_and_matches_one_process",
    "tied_gpt_head_with_explicit_plans_keeps_one_parameter_and_matches_one_process",
    "a_plan_that_splits_a_tie_two_ways_is_refused_before_any_weight_moves",
    "a_callable_plan_that_unties_weights_is_refused",
    "tied_weights_stay_one_parameter_through_checkpoints",
    "tied_hugging_face_llama_built_on_the_meta_device_keeps_one_parameter",
    "trainer_tied_hugging_face_llama_with_its_own_plan_keeps_one_parameter_and_matches_one_process",
    "trainer_tied_gpt_with_an_explicit_plan_keeps_one_parameter_and_matches_one_process",
]

results, test_case = case_tests("tp_ties.py", 4, CASES)


@pytest.mark.parametrize("to", ["full", "safetensors"])
def test_the_export_of_a_tied_checkpoint_saved_under_tp_is_one_tensor_and_loads_tied(results, tmp_path, to):
    """The sharded checkpoint of the tied Llama saved on (shard=2, tp=2), converted in one process: the head and
    the embedding hold the same values as the trained model's one parameter, and a fresh tied Llama loads them with
    its tie intact."""
    results.check("tied_weights_stay_one_parameter_through_checkpoints")
    saved = results.out / "tied_saved"
    path = convert(saved / "checkpoint", tmp_path / ("full.pt" if to == "full" else "model.safetensors"), to=to)
    if to == "full":
        exported = torch.load(path, weights_only=True)
        exported = exported.get("model", exported)
    else:
        from safetensors.torch import load_file

        exported = load_file(str(path))
    expected = torch.load(saved / "weights.pt", weights_only=True)
    embedding = exported["model.embed_tokens.weight"]
    assert torch.equal(embedding, expected["model.embed_tokens.weight"])
    assert torch.equal(exported.get("lm_head.weight", embedding), embedding)
    model = tied_llama()
    model.load_state_dict(exported, strict=False)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(model.lm_head.weight, expected["lm_head.weight"])


@pytest.mark.single_process
@pytest.mark.parametrize("front", ["fabric", "trainer"])
def test_sequence_parallel_from_a_string_plan_is_refused_naming_the_style_the_module_and_what_to_do(front):
    """torch's ``SequenceParallel`` needs sequence-split activations between the layers, which the column and row
    styles neither give nor take: refused at construction, on both fronts, before any model is seen."""
    if front == "fabric":
        from lightning_fsdp.fabric import FSDPStrategy
    else:
        from lightning_fsdp.trainer import FSDPStrategy
    plan = {"blocks.*.mlp.up": "colwise", "blocks.*.ln1": "sequence_parallel"}
    with pytest.raises(ValueError) as err:
        FSDPStrategy(tensor_parallel_size=2, tensor_parallel_plan=plan)
    message = str(err.value)
    for needle in ("'sequence_parallel'", "'blocks.*.ln1'", "shape error",
                   "HINT: Leave 'blocks.*.ln1' out of the plan"):
        assert needle in message, f"{needle!r} not in {message}"
    assert "'sequence_parallel'" not in message.split("Allowed:")[1].split("HINT:")[0], message


@pytest.mark.single_process
def test_a_sequence_parallel_object_on_a_module_with_children_is_refused_naming_the_norms():
    """torch's ``SequenceParallel`` re-registers a module's whole subtree of parameters under dotted names
    (``KeyError: 'parameter name can't contain "."'``): refused at setup, naming the module and its children."""
    tp = parse_tensor_parallel(2, {"blocks.*": SequenceParallel()})
    with pytest.raises(ValueError, match=r"'blocks\.0' is a Block with children.*HINT: Name the norm modules"
                                         r" themselves, e\.g\. `\{'blocks\.0\.ln1': SequenceParallel\(\)\}`"):
        resolve_plan(GPT(), tp)
    assert resolve_plan(GPT(), parse_tensor_parallel(2, {"blocks.*.ln1": SequenceParallel()}))
