"""FULL_SHARD frees every unit's gathered parameters after its forward, in every module layout, on both fronts, and
the Trainer's per-rank peak of a step equals Fabric's (see ``workers/sharded_memory.py``)."""

import json
import sys

from launch import WORKERS, case_tests
from lightning_fsdp.planner import plan_memory

sys.path.insert(0, str(WORKERS))
from planned_lit import Block, PlannedLit, batch  # noqa: E402

CASES = [
    "readme_sequential_of_linears_configure_model",
    "network_whose_parameters_all_sit_in_a_modulelist_init_and_configure_model",
    "gpt_with_every_parameter_inside_a_unit",
    "gpt_with_embedding_and_head_outside_the_blocks",
    "encoder_and_decoder_as_two_children",
    "nested_modulelist_moduledict_and_sequential_containers",
    "a_unit_that_is_itself_the_top_level_child",
    "shard_grad_op_keeps_what_fabric_keeps",
    "generator_and_discriminator_with_several_forwards_per_step",
    "hugging_face_llama_held_as_self_model",
    "litgpt_gpt_held_as_self_model",
    "torch_compiled_child",
    "fabric_layouts_free_every_unit_after_forward",
    "trainer_peak_of_one_step_equals_fabric_within_2_percent",
    "trainer_step_of_the_planned_lightning_module",
]

# Own launch: its cases measure their processes' memory, which cases of other scripts before them would skew. Started
# in the background with the pools (``alone=True``), not on the main process's path, and at normal priority
# (LFSDP_TEST_NICE=0, as its launch had before): the Trainer-equals-Fabric case takes the floor of several runs because a
# busy machine delays gloo's worker thread, and a pool's lower priority would delay it more.
results, test_case = case_tests("sharded_memory.py", 2, CASES, alone=True, LFSDP_TEST_NICE="0")


def test_plan_of_a_lightning_module_is_within_10_percent_of_the_trainer_step(results):
    """``plan_memory`` takes the LightningModule itself: it runs ``configure_model``, shards it as the Trainer does,
    plans ``training_step`` with ``configure_optimizers``' optimizer, and lands within 10% of torch's tracker on the
    real 2-rank Trainer step (the worker's ``trainer_step_of_the_planned_lightning_module``)."""
    measured = results.check("trainer_step_of_the_planned_lightning_module")[0]["tracker_peak"]
    predicted = plan_memory(PlannedLit, batch, world_size=2, auto_wrap_policy={Block}).peak_of(0)
    assert abs(predicted - measured) <= 0.10 * measured, f"predicted {predicted}, measured {measured}"


def test_plan_command_takes_a_lightning_module_file(capsys):
    """`lightning-fsdp plan --model FILE.py:LitModel`: the class is the factory, and the plan is the Trainer's."""
    from lightning_fsdp.cli import main

    spec = f"{WORKERS / 'planned_lit.py'}"
    code = main(["plan", "--model", f"{spec}:PlannedLit", "--inputs", f"{spec}:batch", "--world-size", "2",
                 "--auto-wrap-policy", "planned_lit.Block", "--json"])
    out = capsys.readouterr().out
    assert code == 0, out
    plan = json.loads(out)
    expected = plan_memory(PlannedLit, batch, world_size=2, auto_wrap_policy={Block}).peak_of(0)
    assert plan["peak_bytes"]["0"] == expected, plan


def test_the_readme_trainer_example_is_the_layout_the_worker_checks():
    """`readme_sequential_of_linears_configure_model` trains the README's Trainer model: keep the two the same."""
    readme = (WORKERS.parent.parent / "README.md").read_text()
    trainer_part = readme[readme.index("## Trainer"):]
    assert "self.model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))" in trainer_part
    assert "auto_wrap_policy={nn.Linear}" in trainer_part
