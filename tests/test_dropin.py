"""Lightning's and litgpt's ``isinstance(strategy, FSDPStrategy)`` checks answer True for our strategies, and each
site's FSDP branch does the right thing with them (``lightning_fsdp._fronts.dropin``; issue 19 part 2).

The single-process tests check what needs no process group: the ``isinstance`` answers, the precision plugin each
connector picks, the loops' choice of ``no_grad``, and Lightning's compile check. ``workers/dropin.py`` (2 ranks, one
launch) trains through each site: a compiled module, every precision on both fronts, SWA's refusal, an optimizer on
meta-device parameters, litgpt's ``load_checkpoint`` and weight init.
"""

from __future__ import annotations

import pytest
import torch
from lightning.fabric import Fabric
from lightning.fabric.plugins.precision import MixedPrecision
from lightning.fabric.strategies import FSDPStrategy as LightningFabricFSDP
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.plugins.precision import MixedPrecision as TrainerMixedPrecision
from lightning.pytorch.strategies import FSDPStrategy as LightningTrainerFSDP

import lightning_fsdp  # noqa: F401  (registers)
from launch import case_tests
from lightning_fsdp import fabric, trainer
from lightning_fsdp.engine.precision import DTensorGradScaler, FSDPPrecision
from lightning_fsdp.trainer import FSDPTrainerPrecision

CASES = [
    "compiled_module_fits_exactly_like_the_uncompiled_one",
    "every_precision_gets_our_plugin_and_trains_on_the_trainer_front",
    "every_precision_gets_our_plugin_and_trains_on_the_fabric_front",
    "stochastic_weight_averaging_is_refused_with_the_fix",
    "an_optimizer_on_meta_parameters_is_set_up_with_its_model",
    "litgpt_load_checkpoint_loads_a_full_file_into_the_shards",
    "litgpt_pretrain_init_runs_litgpts_initializers_at_setup",
]

results, test_case = case_tests("dropin.py", 2, CASES)

PRECISIONS = ["32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true"]


def _trainer(precision="32-true", **kwargs) -> Trainer:
    return Trainer(accelerator="cpu", devices=2, strategy=trainer.FSDPStrategy(), precision=precision, logger=False,
                   enable_progress_bar=False, enable_model_summary=False, **kwargs)


def test_both_fronts_are_lightnings_fsdp_strategy_to_isinstance():
    assert isinstance(fabric.FSDPStrategy(), LightningFabricFSDP)
    assert isinstance(trainer.FSDPStrategy(), LightningTrainerFSDP)
    assert issubclass(fabric.FSDPStrategy, LightningFabricFSDP) and issubclass(trainer.FSDPStrategy, LightningTrainerFSDP)
    # Each front only as its own front's class; and `type(...) is`, the connectors' "FSDP needs a GPU" check, says no.
    assert not isinstance(fabric.FSDPStrategy(), LightningTrainerFSDP)
    assert not isinstance(trainer.FSDPStrategy(), LightningFabricFSDP)
    assert type(trainer.FSDPStrategy()) is not LightningTrainerFSDP
    # What the registered names build, on CPU.
    assert isinstance(Fabric(accelerator="cpu", devices=2, strategy="fsdp").strategy, LightningFabricFSDP)
    t = Trainer(accelerator="cpu", devices=2, strategy="fsdp", logger=False)
    assert isinstance(t.strategy, LightningTrainerFSDP) and isinstance(t.strategy, trainer.FSDPStrategy)
    assert t._accelerator_connector.is_distributed


@pytest.mark.parametrize("precision", PRECISIONS)
def test_the_connectors_pick_our_precision_plugin(precision):
    plugin = Fabric(accelerator="cpu", devices=2, strategy=fabric.FSDPStrategy(), precision=precision).strategy.precision
    assert type(plugin) is FSDPPrecision and plugin.precision == precision
    plugin = _trainer(precision).strategy.precision_plugin
    assert type(plugin) is FSDPTrainerPrecision and plugin.precision == precision
    # "16-mixed" keeps fp16 with our scaler on CPU too (the non-FSDP branch switched to bf16 there).
    assert (type(plugin.scaler) is DTensorGradScaler) == (precision == "16-mixed")


def test_a_precision_plugin_instance_still_goes_through_the_connectors():
    plugin = _trainer(precision=None, plugins=[TrainerMixedPrecision("bf16-mixed", "cpu")]).strategy.precision_plugin
    assert type(plugin) is FSDPTrainerPrecision and plugin.precision == "bf16-mixed"
    f = Fabric(accelerator="cpu", devices=2, strategy=fabric.FSDPStrategy(), plugins=[MixedPrecision("bf16-mixed", "cpu")])
    assert type(f.strategy.precision) is FSDPPrecision and f.strategy.precision.precision == "bf16-mixed"


def test_an_unsupported_precision_name_gets_our_message_not_lightnings_fsdp_one():
    for make in (lambda: _trainer("64-true"),
                 lambda: Fabric(accelerator="cpu", devices=2, strategy=fabric.FSDPStrategy(), precision="64-true")):
        with pytest.raises(ValueError, match=r"Invalid `precision='64-true'`.*Allowed: '32-true'.*HINT: "):
            make()


def test_evaluation_loops_choose_no_grad_as_for_lightnings_fsdp():
    # Lightning's loops pick `no_grad` over `inference_mode` for an FSDPStrategy (and for gloo, so this is checked
    # here, without a process group, rather than in the 2-rank launch).
    from lightning.pytorch.loops.utilities import _no_grad_context

    t = _trainer()
    loop = t.validate_loop
    assert loop.inference_mode  # the Trainer's default; our strategy's `setup` turns it off too, but has not run
    ran_under = _no_grad_context(lambda self: (torch.is_inference_mode_enabled(), torch.is_grad_enabled()))(loop)
    assert ran_under == (False, False)


def test_lightnings_compile_check_accepts_our_strategy():
    from lightning.pytorch.utilities.compile import _verify_strategy_supports_compile, from_compiled

    class Module(LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(2, 2)

    module = from_compiled(torch.compile(Module(), backend="eager"))
    assert module._compiler_ctx is not None, "not a compiled module: Lightning's check would pass for any strategy"
    # The control: a strategy Lightning does not compile for is refused by the very same call...
    from lightning.pytorch.strategies import ModelParallelStrategy

    with pytest.raises(RuntimeError, match="incompatible with the current strategy"):
        _verify_strategy_supports_compile(module, ModelParallelStrategy())
    # ...and ours is let through (it raised the same RuntimeError before the drop-in).
    assert _verify_strategy_supports_compile(module, trainer.FSDPStrategy()) is None


@pytest.mark.parametrize(("precision", "dtype"), [("32-true", torch.float32), ("bf16-mixed", torch.bfloat16),
                                                  ("16-mixed", torch.float16), ("bf16-true", torch.bfloat16),
                                                  ("16-true", torch.float16)])
def test_throughput_monitors_count_flops_in_our_compute_dtype(precision, dtype):
    """Both ThroughputMonitors read the FLOP dtype (for MFU) from the precision plugin: with ours they said fp32
    for every precision. Asked the way each monitor asks, with the plugin each front builds."""
    from lightning.fabric.utilities import throughput
    from lightning.pytorch.callbacks import throughput_monitor

    fabric_plugin = Fabric(accelerator="cpu", devices=2, strategy=fabric.FSDPStrategy(), precision=precision)
    trainer_plugin = _trainer(precision).strategy.precision_plugin
    assert throughput._plugin_to_compute_dtype(fabric_plugin.strategy.precision) == dtype
    assert throughput_monitor._plugin_to_compute_dtype(trainer_plugin) == dtype
    # Lightning's own plugins are answered as before.
    assert throughput._plugin_to_compute_dtype(MixedPrecision("bf16-mixed", "cpu")) == torch.bfloat16
    assert throughput_monitor._plugin_to_compute_dtype(TrainerMixedPrecision("16-mixed", "cpu")) == torch.float16
