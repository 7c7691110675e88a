"""Tensor parallelism inside FSDP on 4 ranks, (shard=2, tp=2): parity with one process on both fronts, the plan's
checks, the batches of tensor-parallel peers, clipping, and checkpoints across layouts (see
``workers/tensor_parallel.py``)."""

import torch

from launch import case_tests, launch
from lightning_fsdp.checkpoint.convert import convert

CASES = [
    "fabric_gpt_with_an_explicit_plan_matches_one_process",
    "fabric_hugging_face_llama_with_its_own_plan_matches_one_process",
    "clipping_takes_the_norm_over_both_mesh_axes",
    "a_bad_plan_is_one_clear_error_before_any_weight_moves",
    "a_tensor_parallel_size_that_does_not_divide_the_world_is_refused",
    "sharded_checkpoints_load_across_dp_tp_layouts",
    "meta_device_init_splits_pieces_and_keeps_copies_equal",
    "activation_checkpointing_and_accumulation_without_sync_match_one_process",
    "bf16_mixed_precision_trains",
    "hugging_face_safetensors_load_straight_into_the_2d_shards",
    "trainer_gpt_with_an_explicit_plan_matches_one_process_and_tp_peers_share_batches",
    "trainer_hugging_face_llama_with_its_own_plan_matches_one_process",
]

results, test_case = case_tests("tensor_parallel.py", 4, CASES)


def _saved(results):
    results.check("sharded_checkpoints_load_across_dp_tp_layouts")  # the (2, 2) save exists and loaded there
    return results.out / "saved_2x2"


def test_the_2x2_checkpoint_loads_exactly_as_1x2(results, tmp_path):
    saved = _saved(results)
    two = launch("tensor_parallel.py", 2, tmp_path, LFSDP_TP_LOAD=str(saved))
    assert max(d["max_diff"] for d in two.check("loads_on_one_by_two")) == 0.0


def test_the_2x2_checkpoint_converts_to_one_full_file_in_one_process(results, tmp_path):
    """One process, no process group: the converter writes the plain tensors the 4 ranks held together."""
    saved = _saved(results)
    full = convert(saved / "checkpoint", tmp_path / "full.pt", to="full")
    weights = torch.load(full, weights_only=True)
    weights = weights.get("model", weights)
    expected = torch.load(saved / "weights.pt", weights_only=True)
    assert sorted(weights) == sorted(expected)
    for name, tensor in expected.items():
        assert type(weights[name]) is torch.Tensor and torch.equal(weights[name], tensor), name
