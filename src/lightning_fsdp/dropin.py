"""Be recognized as Lightning's ``FSDPStrategy``: ``isinstance`` checks in Lightning and litgpt answer True for ours.

Lightning and litgpt choose code paths with ``isinstance(strategy, lightning.*.FSDPStrategy)``. Our classes are not
Lightning's (theirs drive FSDP1), so without help every such check takes the non-FSDP path. Lightning's strategy base
classes are ABCs, so :func:`register` (run by ``import lightning_fsdp``) makes each front's class a *virtual subclass*
of the matching Lightning class with ``ABCMeta.register``: ``isinstance`` and ``issubclass`` answer True, while
``type(strategy) is FSDPStrategy`` (the connectors' "FSDP needs a GPU" check) stays False, and nothing of Lightning's
FSDP1 class is inherited. Then each site's FSDP branch runs with our strategy, so each was checked:

============================================ ===================================== =====================================
site (Lightning 2.5.6 and 2.6.6, litgpt 0.5.9) what the FSDP branch does              with our strategy
============================================ ===================================== =====================================
``Trainer.fit/validate/test/predict``:        accepts a ``torch.compile``-d           accepted: the compiled steps run
``_verify_strategy_supports_compile``         LightningModule (others: RuntimeError)  around FSDP2's hooks (torch skips
                                                                                      them in dynamo) and train like eager
both connectors' ``_check_and_init_precision`` builds Lightning's FSDP1 precision    pre-empted (:func:`choose_our_precision`):
                                              plugin from ``precision=``              our plugin, from the same name; a
                                                                                      plugin instance passes as before
``Fabric._validate_setup``                    refuses ``fabric.setup(model, opt)``    lifted (:func:`allow_meta_optimizers`):
                                              when the optimizer holds meta-device    setup materializes the shards and
                                              parameters                              points the optimizer at them
loops' ``_no_grad_context``                   evaluation under ``no_grad``, never     the same; ``trainer.py`` also turns
                                              ``inference_mode`` (FSDP cannot train   the loops' ``inference_mode`` off,
                                              on tensors gathered in it)              which gloo forced anyway
``StochasticWeightAveraging.setup``           refuses: "SWA does not currently        refused earlier, with the fix
                                              support sharded models"                 (``averaging.refuse_swa``): use
                                                                                      ``WeightAveraging``, which we shard
``ServableModuleValidator.on_train_start``    refuses to serve a sharded model        the same refusal
Trainer connector ``is_distributed``          True                                    True (as our property says)
litgpt ``utils.load_checkpoint`` and          ``fabric.load_raw(path, model)``, not   our raw load: a full file into the
``load_checkpoint_update``                    a ``load_state_dict`` of full tensors   sharded model, each rank its shards
litgpt ``pretrain.initialize_weights``        skips ``reset_parameters(model)``: the  the same: ``param_init_fn=None``
                                              strategy initializes meta tensors       runs each module's (patched)
                                                                                      ``reset_parameters`` at setup
============================================ ===================================== =====================================

Not affected: ``type(flag) is FSDPStrategy`` in both connectors' GPU check (``registry.py`` handles the names), and
``isinstance(plugin, FSDPPrecision)`` in the throughput utilities (a precision-plugin check; ours is not Lightning's
FSDP precision, so MFU counts it as fp32). transformers 5.23 has no Lightning checks. ``tests/test_dropin.py`` runs
each site.
"""

from __future__ import annotations

from typing import Any

from lightning_fsdp._compat import (
    CONNECTOR_PRECISION_CHOICE,
    FABRIC_CONNECTOR_PRECISION_FLAGS,
    FABRIC_SETUP_CHECK,
    TRAINER_CONNECTOR_PRECISION_FLAGS,
)

__all__ = ["register", "choose_our_precision", "allow_meta_optimizers"]

_PATCHED = "_lightning_fsdp_dropin"


def register() -> None:
    """Make both fronts virtual subclasses of Lightning's two ``FSDPStrategy`` classes, and correct the branches that
    then run with them (see the table above). Idempotent."""
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import FSDPStrategy as LightningFabricFSDP
    from lightning.pytorch.strategies import FSDPStrategy as LightningTrainerFSDP

    from lightning_fsdp import fabric, trainer
    from lightning_fsdp._compat import FabricConnector, TrainerConnector

    LightningFabricFSDP.register(fabric.FSDPStrategy)
    LightningTrainerFSDP.register(trainer.FSDPStrategy)
    choose_our_precision(FabricConnector, FABRIC_CONNECTOR_PRECISION_FLAGS, fabric.FSDPPrecision)
    choose_our_precision(TrainerConnector, TRAINER_CONNECTOR_PRECISION_FLAGS, trainer.FSDPTrainerPrecision)
    allow_meta_optimizers(Fabric)


def _is_ours(strategy: Any) -> bool:
    from lightning_fsdp.front import FrontMixin

    return isinstance(strategy, FrontMixin)


def _wrap(owner: type, name: str, make: Any) -> None:
    original = getattr(owner, name)
    if getattr(original, _PATCHED, False):
        return
    wrapper = make(original)
    setattr(wrapper, _PATCHED, True)
    wrapper.__wrapped__ = original
    setattr(owner, name, wrapper)


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
            from lightning.fabric.plugins.precision import Precision as FabricPrecision
            from lightning.pytorch.plugins.precision import Precision as TrainerPrecision

            given = getattr(self, instance_flag)
            if _is_ours(self.strategy) and not isinstance(given, (FabricPrecision, TrainerPrecision)):
                return plugin_cls(getattr(self, name_flag))
            return original(self)

        return check_and_init_precision

    _wrap(connector_cls, CONNECTOR_PRECISION_CHOICE, make)


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

    _wrap(fabric_cls, FABRIC_SETUP_CHECK, make)


def _holds_meta_tensors(optimizer: Any) -> bool:
    groups = getattr(optimizer, "param_groups", [])
    return any(getattr(p, "is_meta", False) for group in groups for p in group["params"])
