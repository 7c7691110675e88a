"""Tensor parallelism inside FSDP on 4 ranks, (shard=2, tp=2): parity with one process on both fronts, the plan's
checks, the batches of tensor-parallel peers, clipping, checkpoints across layouts, and the memory plan of a
tensor-parallel step against the same step measured for real (see ``workers/tensor_parallel.py``)."""

import json
import re
import sys

import pytest
import torch

from inprocess import run_cli
from launch import WORKERS, case_tests, launch
from lightning_fsdp.checkpoint.convert import convert
from lightning_fsdp.planner import plan_memory

sys.path.insert(0, str(WORKERS))
from tp_models import GPT, PLAN, Block, gpt_batch, llama, llama_batch, llama_block  # noqa: E402

CASES = [
    "fabric_gpt_with_an_explicit_plan_matches_one_process",
    "fabric_hugging_face_llama_with_its_own_plan_matches_one_process",
    "hybrid_sharding_with_tensor_parallel_matches_one_process",
    "clipping_takes_the_norm_over_both_mesh_axes",
    "a_bad_plan_is_one_clear_error_before_any_weight_moves",
    "a_tensor_parallel_size_that_does_not_divide_the_world_is_refused",
    "sharded_checkpoints_load_across_dp_tp_layouts",
    "meta_device_init_splits_pieces_and_keeps_copies_equal",
    "activation_checkpointing_and_accumulation_without_sync_match_one_process",
    "bf16_mixed_precision_trains",
    "bf16_true_precision_trains_like_one_process_in_bf16",
    "hugging_face_safetensors_load_straight_into_the_2d_shards",
    "trainer_gpt_with_an_explicit_plan_matches_one_process_and_tp_peers_share_batches",
    "trainer_hugging_face_llama_with_its_own_plan_matches_one_process",
    "tracker_peaks_of_the_planned_tensor_parallel_steps",
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


def test_the_2x2_checkpoint_exports_to_hugging_face_safetensors_in_one_process(results, tmp_path):
    """The Hugging Face export of a checkpoint saved under TP: the plain tensors, every one equal."""
    from safetensors.torch import load_file

    saved = _saved(results)
    exported = load_file(str(convert(saved / "checkpoint", tmp_path / "model.safetensors", to="safetensors")))
    expected = torch.load(saved / "weights.pt", weights_only=True)
    assert sorted(exported) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(exported[name], tensor), name


# --- The memory plan of a tensor-parallel step ----------------------------------------------------------------------

# name -> (model factory, auto_wrap_policy, tensor_parallel_plan, batch factory); the worker's measured steps by name.
PLANNED = {
    "gpt": (GPT, lambda: {Block}, PLAN, gpt_batch),
    "llama": (llama, lambda: {llama_block()}, "auto", llama_batch),
}


def _plan(name, **options):
    build, policy, plan, batch = PLANNED[name]
    return plan_memory(build, batch, world_size=4, tensor_parallel_size=2, tensor_parallel_plan=plan,
                       auto_wrap_policy=policy(), **options)


@pytest.mark.parametrize("name", PLANNED)
def test_plan_of_a_tensor_parallel_step_is_within_10_percent_of_the_tracker_on_4_real_ranks(results, name):
    """``plan_memory`` with ``tensor_parallel_size=2`` plans each rank of the (shard=2, tp=2) mesh; torch's
    ``FSDPMemTracker`` measures the same steady-state step on 4 real gloo ranks (the worker's
    ``tracker_peaks_of_the_planned_tensor_parallel_steps``): the GPT-style model with its explicit plan, and the
    Llama with ``"auto"``."""
    measured = results.check("tracker_peaks_of_the_planned_tensor_parallel_steps")[0][name]
    plan = _plan(name)
    assert plan.mesh == {"shard": 2, "tp": 2}
    for rank in (0, 1, 2, 3):
        predicted, real = plan.peak_of(rank), measured["tracker_peak"]
        assert abs(predicted - real) <= 0.10 * real, f"rank {rank}: predicted {predicted}, measured {real}"
    # Each rank's sharded parameters are the bytes the real rank holds (its local pieces of the 2-D DTensors).
    assert plan.breakdown()["sharded params"] == measured["sharded_param_bytes"]


@pytest.mark.single_process
def test_a_rank_plans_a_quarter_of_each_split_parameter_and_half_of_each_replicated_one():
    """On (shard=2, tp=2), a parameter the plan splits is held 1/(dp*tp) per rank; one it leaves whole (norms, the
    embedding, the head, a row-split Linear's bias) 1/dp, as FSDP alone shards it."""
    plan = _plan("gpt")
    expected = 0
    for name, param in GPT().named_parameters():
        module, _, kind = name.rpartition(".")
        style = next((s for pattern, s in PLAN.items()
                      if re.fullmatch(re.escape(pattern).replace(r"\*", r"[^.]+"), module)), None)
        split = style == "colwise" or (style == "rowwise" and kind == "weight")
        expected += param.numel() * param.element_size() // (4 if split else 2)
    for rank, stats in plan.ranks.items():
        assert stats.after_step["sharded_param"] == expected, rank
    without = plan_memory(GPT, gpt_batch, world_size=4, auto_wrap_policy={Block})
    assert without.breakdown()["sharded params"] == sum(p.numel() * p.element_size() for p in GPT().parameters()) // 4


@pytest.mark.single_process
def test_the_planner_s_tracker_plans_a_tensor_parallel_step_exactly_as_torch_s_tracker_does(monkeypatch):
    """The tensor-parallel step (DTensor ops inside FSDP units) under ``planner.tracker.StepMemTracker`` and under
    torch's ``FSDPMemTracker``: every number of the plan is the same (``test_planner.py`` checks 1-D layouts)."""
    from lightning_fsdp.planner import step, tracker

    plans = []
    for kind in (tracker.StepMemTracker, tracker.TorchMemTracker):
        monkeypatch.setattr(step, "TRACKER", kind)
        plans.append(_plan("gpt"))
    assert plans[0].ranks == plans[1].ranks, [p.ranks for p in plans]


@pytest.mark.single_process
def test_plan_command_takes_the_tensor_parallel_size_and_plan():
    """`lightning-fsdp plan --tensor-parallel-size 2 --tensor-parallel-plan FILE.py:PLAN | JSON | auto`: the plan of
    the Python form, for the (shard, tp) mesh. Several tensor-parallel plans in one process give the same bytes (the
    planner clears DTensor's caches, which held the meshes of an earlier plan's destroyed process group)."""
    common = ["plan", "--inputs", "tp_models.py:gpt_batch", "--world-size", "4", "--auto-wrap-policy",
              "tp_models.Block", "--tensor-parallel-size", "2", "--json"]
    expected = _plan("gpt").peak_bytes
    for plan in ("tp_models.py:PLAN", json.dumps(PLAN)):
        run = run_cli([*common, "--model", "tp_models.py:GPT", "--tensor-parallel-plan", plan], cwd=WORKERS)
        assert run.returncode == 0, run.stderr
        out = json.loads(run.stdout)
        assert out["mesh"] == {"shard": 2, "tp": 2} and out["settings"]["tensor_parallel_size"] == 2, out
        assert {int(r): b for r, b in out["peak_bytes"].items()} == expected, (plan, out["peak_bytes"])
    run = run_cli(["plan", "--model", "tp_models.py:llama", "--inputs", "tp_models.py:llama_batch", "--world-size",
                   "4", "--auto-wrap-policy", "transformers.models.llama.modeling_llama.LlamaDecoderLayer",
                   "--tensor-parallel-size", "2", "--tensor-parallel-plan", "auto"], cwd=WORKERS)
    assert run.returncode == 0, run.stderr
    assert "on 4 rank(s) as a (shard=2, tp=2) mesh" in run.stdout, run.stdout


@pytest.mark.parametrize("options, needles", [
    (["--tensor-parallel-size", "3", "--tensor-parallel-plan", "tp_models.py:PLAN"],
     ["`--tensor-parallel-size 3`", "a divisor of world_size=4: 1, 2, 4", "`--tensor-parallel-size 2`"]),
    (["--tensor-parallel-plan", "tp_models.py:PLAN"],
     ["`--tensor-parallel-size 1`", "without a tensor_parallel_size", "`--tensor-parallel-size K`"]),
    (["--tensor-parallel-size", "2"], ["`--tensor-parallel-plan None`", "needs a plan", "'auto'"]),
    (["--tensor-parallel-size", "2", "--tensor-parallel-plan", "colwise"],
     ["'colwise' is not 'auto', a JSON mapping or MODULE:NAME", "path/to/train.py:PLAN"]),
    (["--tensor-parallel-size", "2", "--tensor-parallel-plan", "tp_models.py:VOCAB"], ["holds 'VOCAB' as int"]),
    (["--tensor-parallel-size", "2", "--tensor-parallel-plan", "auto"],
     ["`--tensor-parallel-plan 'auto'`", "`GPT` has none", '\'{"layers.*.mlp.up_proj": "colwise"']),
])
@pytest.mark.single_process
def test_a_bad_tensor_parallel_combination_is_one_line_naming_the_option_and_a_hint(options, needles):
    run = run_cli(["plan", "--model", "tp_models.py:GPT", "--inputs", "tp_models.py:gpt_batch", "--world-size", "4",
                   *options], cwd=WORKERS)
    assert run.returncode == 2 and run.stdout == "", (run.returncode, run.stdout)
    assert run.stderr.count("\n") == 1 and "HINT:" in run.stderr, run.stderr
    for needle in needles:
        assert needle in run.stderr, f"{needle!r} not in {run.stderr!r}"


@pytest.mark.single_process
def test_plan_memory_refuses_a_size_that_does_not_divide_the_world_naming_the_allowed_sizes():
    with pytest.raises(ValueError, match=r"Invalid `tensor_parallel_size=3`.*Allowed: a divisor of world_size=4: 1,"
                                         r" 2, 4\. HINT: .*`world_size=6`"):
        plan_memory(GPT, gpt_batch, world_size=4, tensor_parallel_size=3, tensor_parallel_plan=PLAN)
    with pytest.raises(ValueError, match=r"Invalid `tensor_parallel_size=1`.*HINT:"):
        plan_memory(GPT, gpt_batch, world_size=4, tensor_parallel_plan=PLAN)
