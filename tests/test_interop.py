"""Lightning's checkpoints load into our strategy, and Lightning's consolidation reads ours (see
``workers/interop.py``), two ranks, one launch for all cases."""

import pytest

from launch import launch

CASES = [
    "fabric_model_parallel_sharded_checkpoint_loads",
    "fabric_model_parallel_full_checkpoint_loads",
    "trainer_model_parallel_sharded_checkpoint_loads",
    "trainer_model_parallel_full_checkpoint_loads",
    "fsdp1_fabric_full_layout_loads",
    "fsdp1_fabric_sharded_layout_loads",
    "fsdp1_trainer_full_layout_loads",
    "fsdp1_trainer_sharded_layout_loads",
    "consolidate_function_reads_our_sharded_checkpoint",
    "consolidate_command_reads_our_sharded_checkpoint",
]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return launch("interop.py", 2, tmp_path_factory.mktemp("interop"))


@pytest.mark.parametrize("name", CASES)
def test_case(results, name):
    results.check(name)
