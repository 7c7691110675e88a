"""Two-rank Trainer cases for evaluation around and inside fit, grad-free forwards in callbacks and manual
optimization, metrics, the "fsdp" string on CPU, and WeightAveraging (see ``workers/trainer_patterns.py``)."""

import pytest

from launch import case_tests
from lightning_fsdp._base.compat import WeightAveraging

CASES = [
    "validate_then_fit_trains_every_unit",
    "fit_validate_test_predict_then_fit_again",
    "validation_in_the_middle_of_accumulation",
    "no_grad_forward_in_a_callback_before_the_step",
    "manual_optimization_with_a_grad_free_forward_before_the_step",
    "torchmetrics_updates_in_training_step_match_the_reference",
    "registry_string_trains_on_cpu",
] + [
    # Lightning's `WeightAveraging` came in 2.6; the oldest-Lightning CI venv (2.5) reports these as skipped.
    pytest.param(name, marks=pytest.mark.skipif(WeightAveraging is None, reason="WeightAveraging needs Lightning 2.6"))
    for name in (
        "swa_weight_averaging_matches_averaged_model",
        "ema_weight_averaging_matches_averaged_model_shard_grad_op",
        "ema_multi_avg_fn_matches_averaged_model_with_activation_checkpointing",
        "weight_averaging_after_an_earlier_call_is_refused_with_a_hint",
        "weight_averaging_resumes_exactly_from_a_full_checkpoint",
        "weight_averaging_resumes_exactly_from_a_sharded_checkpoint",
    )
]

results, test_case = case_tests("trainer_patterns.py", 2, CASES)
