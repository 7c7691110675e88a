"""Empty initialization gives the model's own initialization (``workers/meta_init.py``, 2 ranks), and the
``param_init_fn`` argument's validation (single process)."""

import pytest

from launch import case_tests
from lightning_fsdp.engine.config import FSDPConfig
from lightning_fsdp.engine.meta_init import SKIP

CASES = [
    "hf_llama_matches_its_own_construction",
    "hf_llama_parity_and_generate_against_one_process",
    "litgpt_gpt_matches_its_own_construction",
    "torch_modules_match_their_own_construction",
    "user_module_with_reset_parameters_and_computed_buffer",
    "uninitialized_tensor_is_an_error",
    "param_init_fn_replaces_the_initializers",
    "litgpt_activation_checkpointing_parity",
    "trainer_configure_model_builds_hf_under_empty_init",
    "hf_llama_under_tensor_parallel_matches_its_own_construction_and_trains_like_one_process",
    "litgpt_under_tensor_parallel_matches_its_own_construction_and_trains_like_one_process",
]

results, test_case = case_tests("meta_init.py", 2, CASES)


def _init(module):
    pass


def test_param_init_fn_forms():
    assert FSDPConfig.from_arguments().param_init_fn is None
    assert FSDPConfig.from_arguments(param_init_fn=_init).param_init_fn is _init
    assert FSDPConfig.from_arguments(param_init_fn=" Skip ").param_init_fn == SKIP
    assert FSDPConfig.from_arguments(param_init_fn="torch.nn.init.zeros_").param_init_fn.__name__ == "zeros_"


@pytest.mark.parametrize(("value", "error", "words"), [
    (42, TypeError, ["`param_init_fn=42`", "Allowed:", "HINT"]),
    ("no_such_module.fn", ValueError, ["could not be imported", "HINT"]),
    ("torch.nn.init.no_such_fn", ValueError, ["could not be imported", "'skip'"]),
    ("torch.float32", ValueError, ["names no callable"]),
])
def test_param_init_fn_refuses_bad_values(value, error, words):
    with pytest.raises(error) as info:
        FSDPConfig.from_arguments(param_init_fn=value)
    assert all(w in str(info.value) for w in words), str(info.value)
