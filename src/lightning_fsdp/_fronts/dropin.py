"""Be recognized as Lightning's ``FSDPStrategy``: ``isinstance`` checks in Lightning and litgpt answer True for ours.

Lightning and litgpt choose code paths with ``isinstance(strategy, lightning.*.FSDPStrategy)``. Our classes are not
Lightning's (theirs drive FSDP1), so without help every such check takes the non-FSDP path. Lightning's strategy base
classes are ABCs, so :func:`register` (run by ``import lightning_fsdp``) makes each front's class a *virtual subclass*
of the matching Lightning class with ``ABCMeta.register``: ``isinstance`` and ``issubclass`` answer True, while
``type(strategy) is FSDPStrategy`` (the connectors' "FSDP needs a GPU" check) stays False, and nothing of Lightning's
FSDP1 class is inherited. Then each site's FSDP branch runs with our strategy, so each was checked. Every site in
Lightning 2.5.6 and 2.6.6 and litgpt 0.5.9 (transformers 5.23 has none), as *site*: what its FSDP branch does ->
what happens with ours:

- ``Trainer.fit/validate/test/predict``, ``_verify_strategy_supports_compile``: a ``torch.compile``-d LightningModule
  is accepted (other strategies: RuntimeError) -> accepted; the compiled steps run around FSDP2's hooks, which dynamo
  skips, and train exactly as the uncompiled module does.
- both connectors' ``_check_and_init_precision``: builds Lightning's FSDP1 precision plugin from ``precision=`` ->
  pre-empted by :func:`choose_our_precision`: our plugin, from the same name (``"16-mixed"`` stays fp16 on CPU too,
  where the non-FSDP branch switched to bf16); a plugin instance the user passes goes through as before.
- ``Fabric._validate_setup``: refuses ``fabric.setup(model, optimizer)`` when the optimizer holds meta-device
  parameters -> lifted by :func:`allow_meta_optimizers`: our setup materializes the shards and points the optimizer
  at them.
- the loops' ``_no_grad_context``: evaluation runs under ``no_grad``, never ``inference_mode`` (FSDP cannot train on
  parameters gathered in it) -> the same; ``trainer.py`` also turns the loops' ``inference_mode`` off.
- ``StochasticWeightAveraging.setup``: refuses, "SWA does not currently support sharded models" -> refused before it,
  with the same exception type and the fix (:func:`lightning_fsdp.averaging.refuse_stochastic_weight_averaging`):
  ``WeightAveraging``, whose copy we shard.
- ``ServableModuleValidator.on_train_start``: refuses to serve a sharded model -> the same refusal.
- the Trainer connector's ``is_distributed``: True -> True, as our own property says.
- litgpt ``utils.load_checkpoint`` and ``load_checkpoint_update``: ``fabric.load_raw(path, model)`` instead of
  ``model.load_state_dict`` of full tensors -> our raw load: each rank takes its shards of the full file.
- litgpt ``pretrain.initialize_weights``: skips ``reset_parameters(model)``, since the strategy initializes the meta
  tensors -> the same: with ``param_init_fn=None`` setup runs each module's ``reset_parameters``, the ones litgpt
  patched included.

- both ``ThroughputMonitor``s' ``_plugin_to_compute_dtype`` (Fabric's utility, the Trainer's callback): a
  precision-plugin check, ``isinstance(plugin, FSDPPrecision)`` (Lightning's), which our plugin is not, so a
  ``bf16-mixed`` run was counted as fp32 and its MFU understated -> taught ours by :func:`count_our_compute_dtype`:
  the plugin's ``compute_dtype`` (bf16 for ``bf16-mixed`` and ``bf16-true``, fp16 for the ``16`` ones).

Not affected: ``type(flag) is FSDPStrategy`` in both connectors' "FSDP needs a GPU" check (``registry.py`` deals with
the names). ``tests/test_dropin.py`` runs each site.
"""

from __future__ import annotations

from typing import Any

from lightning_fsdp._base.compat import (
    CONNECTOR_PRECISION_CHOICE,
    FABRIC_CONNECTOR_PRECISION_FLAGS,
    FABRIC_SETUP_CHECK,
    THROUGHPUT_COMPUTE_DTYPE,
    TRAINER_CONNECTOR_PRECISION_FLAGS,
    throughput_modules,
)
from lightning_fsdp._fronts.mixin import FrontMixin
from lightning_fsdp._fronts.patching import wrap_once

__all__ = ["register", "choose_our_precision", "allow_meta_optimizers", "count_our_compute_dtype"]

def register() -> None:
    """Make both fronts virtual subclasses of Lightning's two ``FSDPStrategy`` classes, and correct the branches that
    then run with them (each listed in the module docstring). Idempotent."""
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import FSDPStrategy as LightningFabricFSDP
    from lightning.pytorch.strategies import FSDPStrategy as LightningTrainerFSDP

    from lightning_fsdp import fabric, trainer
    from lightning_fsdp._base.compat import FabricConnector, TrainerConnector
    from lightning_fsdp.engine.precision import FSDPPrecision

    LightningFabricFSDP.register(fabric.FSDPStrategy)
    LightningTrainerFSDP.register(trainer.FSDPStrategy)
    choose_our_precision(FabricConnector, FABRIC_CONNECTOR_PRECISION_FLAGS, FSDPPrecision)
    choose_our_precision(TrainerConnector, TRAINER_CONNECTOR_PRECISION_FLAGS, trainer.FSDPTrainerPrecision)
    allow_meta_optimizers(Fabric)
    for module in throughput_modules():
        count_our_compute_dtype(module, FSDPPrecision)


def _is_ours(strategy: Any) -> bool:
    return isinstance(strategy, FrontMixin)


def choose_our_precision(connector_cls: type, flags: tuple[str, str], plugin_cls: type) -> None:
    """Make ``connector_cls`` build ``plugin_cls`` from the precision name when the strategy is ours.

    Its FSDP branch would build Lightning's FSDP1 plugin: a ``ShardedGradScaler`` that disables itself off CUDA, and
    its own error for names we also refuse. Our strategy would translate that plugin, but our plugin built from the
    same name is exactly what the user asked for, and a bad name gets our message. ``flags`` names the connector's
    two attributes: the plugin instance the user passed (then Lightning's code runs unchanged) and the name.
    """
    instance_flag, name_flag = flags

    def make(original: Any) -> Any:
        def check_and_init_precision(self: Any) -> Any:
            from lightning.fabric.plugins.precision import Precision  # the Trainer's plugins subclass it too

            if _is_ours(self.strategy) and not isinstance(getattr(self, instance_flag), Precision):
                return plugin_cls(getattr(self, name_flag))
            return original(self)

        return check_and_init_precision

    wrap_once(connector_cls, CONNECTOR_PRECISION_CHOICE, make)


def allow_meta_optimizers(fabric_cls: type) -> None:
    """Lift ``Fabric.setup``'s refusal of optimizers that hold meta-device parameters, for our strategy only.

    Lightning refuses them for its FSDP because FSDP1 cannot re-point an optimizer at the parameters it materializes.
    Ours does (``sharding.remap_optimizer``), and the README's first snippet builds the optimizer from a meta-device
    model. Fabric's other checks (launched, model or optimizer set up twice) still run: the check is called with the
    optimizers that hold no meta tensors, and an optimizer that does cannot have been set up before.
    """

    def make(original: Any) -> Any:
        def validate_setup(self: Any, module: Any, optimizers: Any) -> None:
            if _is_ours(self.strategy):
                optimizers = [opt for opt in optimizers if not _holds_meta_tensors(opt)]
            original(self, module, optimizers)

        return validate_setup

    wrap_once(fabric_cls, FABRIC_SETUP_CHECK, make)


def _holds_meta_tensors(optimizer: Any) -> bool:
    groups = getattr(optimizer, "param_groups", [])
    return any(getattr(p, "is_meta", False) for group in groups for p in group["params"])


def count_our_compute_dtype(module: Any, plugin_cls: type) -> None:
    """Make ``module``'s ``_plugin_to_compute_dtype`` (the FLOP dtype a ``ThroughputMonitor`` counts in) answer
    ``plugin.compute_dtype`` for our plugins (``plugin_cls`` and its subclasses); any other plugin as before."""

    def make(original: Any) -> Any:
        def plugin_to_compute_dtype(plugin: Any) -> Any:
            if isinstance(plugin, plugin_cls):
                return plugin.compute_dtype
            return original(plugin)

        return plugin_to_compute_dtype

    wrap_once(module, THROUGHPUT_COMPUTE_DTYPE, make)
