"""Lightning's ``WeightAveraging`` callbacks (``EMAWeightAveraging`` included) on a sharded model, for the Trainer front.

The callback deep-copies the LightningModule into an ``AveragedModel`` in its ``setup`` hook, before the strategy
shards anything, and then updates, swaps and saves that copy parameter by parameter against the live model. This
module makes that work unchanged:

- :func:`shard_averaged_copies` shards each copy exactly like the model (same policy, same mesh), right after the model
  is sharded. Each rank then holds 1/N of the average, and every update (``lerp_``/``copy_`` between a shard of the
  average and the same shard of the model) is local: no communication. The swap for validation and the copy at the
  end of fit are shard-local too; the strategy keeps both models at rest (sharded) whenever callbacks run.
- On save, the callback moves the live weights to ``current_model_state`` and puts the average under
  ``state_dict``: both hold DTensors, and the strategy writes both as sharded tensors (or gathers both into a full
  file).
- :func:`refuse_stochastic_weight_averaging`: the older ``StochasticWeightAveraging`` callback is refused, as Lightning
  refuses it for its own FSDP (it keeps an unsharded copy and its own LR schedule); ``WeightAveraging`` is the fix.
- :func:`load_request` and :func:`complete_for_callback` route a checkpoint's two weight sets back into the two sharded
  models on load, and hand the callback live state dicts to "load", so its own ``on_load_checkpoint`` runs unchanged.
"""

from __future__ import annotations

from typing import Any, Optional

from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import StochasticWeightAveraging
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch.nn import Module

from lightning_fsdp._base.compat import WeightAveraging, averaged_model, lightning_version
from lightning_fsdp.checkpoint.save import sharded_model_state

__all__ = [
    "CURRENT_MODEL_KEY",
    "averaged_modules",
    "refuse_copying_a_sharded_model",
    "refuse_stochastic_weight_averaging",
    "shard_averaged_copies",
    "load_request",
    "complete_for_callback",
]

CURRENT_MODEL_KEY = "current_model_state"
"""Where ``WeightAveraging.on_save_checkpoint`` moves the live model's weights (the average takes ``state_dict``)."""

# Lightning warns in `WeightAveraging.setup` that the copy is not sharded; with this strategy it is.
UNSHARDED_COPY_WARNING = ".*WeightAveraging doesn't support sharding model layers.*"


def _is_averaging(callback: Any) -> bool:
    # Lightning 2.5 has no `WeightAveraging` (it came in 2.6), so no callback there can be one.
    return WeightAveraging is not None and isinstance(callback, WeightAveraging)


def averaged_modules(trainer: Trainer) -> list[Module]:
    """The LightningModule copies inside the trainer's weight-averaging callbacks (created when fit begins)."""
    found = []
    for callback in trainer.callbacks:
        average = averaged_model(callback) if _is_averaging(callback) else None
        if average is not None:
            found.append(average.module)
    return found


def refuse_copying_a_sharded_model(trainer: Trainer, model: Optional[Module], sharded: Optional[Module]) -> None:
    """Before the callbacks' ``setup``: a weight-averaging callback deep-copies the model when fit begins, and FSDP2
    cannot copy a model that is already sharded (an earlier ``fit``, ``validate``, ``test`` or ``predict`` on this
    Trainer sharded it). Say so, and how to order the calls, instead of FSDP's bare "does not support deepcopy"."""
    fitting = trainer.state.fn is not None and trainer.state.fn.value == "fit"
    has_averaging = any(_is_averaging(c) for c in trainer.callbacks)
    if fitting and has_averaging and model is not None and model is sharded:
        raise RuntimeError(
            "A WeightAveraging callback copies the model when `fit` begins, but this model was already sharded by an"
            " earlier `fit`, `validate`, `test` or `predict` call, and a sharded model cannot be copied. HINT: run"
            " `trainer.fit` on a model that no Trainer call has set up yet, and evaluate afterwards; to evaluate"
            " before training, use a separate model instance, e.g. `Trainer(...).validate(LitModel(...))` and then"
            " `trainer.fit(LitModel(...))`."
        )


def refuse_stochastic_weight_averaging(trainer: Trainer) -> None:
    """Before the callbacks' ``setup``, where ``StochasticWeightAveraging`` would refuse us with Lightning's bare "SWA
    does not currently support sharded models" (it sees an ``FSDPStrategy``; see :mod:`lightning_fsdp._fronts.dropin`): the
    same refusal and exception type, with the callback that does work."""
    if not any(isinstance(c, StochasticWeightAveraging) for c in trainer.callbacks):
        return
    if WeightAveraging is not None:
        fix = ("use `lightning.pytorch.callbacks.WeightAveraging()` instead, which this strategy shards like the model"
               " and which averages equally, as SWA does (without SWA's learning-rate schedule: add an LR scheduler"
               " for that), or `EMAWeightAveraging(decay=...)` for an exponential average.")
    else:
        fix = (f"upgrade to Lightning 2.6 (this is {lightning_version()}) and use its `WeightAveraging()` callback,"
               " which this strategy shards like the model.")
    raise MisconfigurationException(
        "`StochasticWeightAveraging` does not support sharded models: it keeps an unsharded copy of the model and"
        " copies weights between the two parameter by parameter, and Lightning refuses it for its own FSDPStrategy"
        f" too. HINT: {fix}"
    )


def shard_averaged_copies(trainer: Trainer, shard: Any) -> None:
    """Call ``shard(module)`` on each averaged copy that is not sharded yet (a second ``fit`` makes a new copy)."""
    for module in averaged_modules(trainer):
        if not getattr(module, "_lightning_fsdp_sharded", False):
            shard(module)
            module._lightning_fsdp_sharded = True


def load_request(trainer: Trainer, model: Module, keys: set[str]) -> tuple[dict[str, Module], Optional[Module], bool]:
    """Which model each weight set of the checkpoint loads into; the averaged copy, if any; and whether the
    checkpoint was written with averaging.

    A checkpoint written with weight averaging keeps the average under ``state_dict`` (the Trainer's model key, so a
    plain ``load_from_checkpoint`` gives the averaged model) and the live weights under ``current_model_state``.
    """
    copies = averaged_modules(trainer)
    average = copies[0] if copies else None
    if average is not None and CURRENT_MODEL_KEY in keys:
        # The average sits under the model's own key: "state_dict" in a full file, "model" in a sharded one.
        average_key = "state_dict" if "state_dict" in keys else "model"
        return {average_key: average, CURRENT_MODEL_KEY: model}, average, True
    return {"model": model}, average, False


def complete_for_callback(loaded: dict[str, Any], model: Module, average: Optional[Module], averaged: bool) -> dict:
    """Give the callback's ``on_load_checkpoint`` the entries it reads, as the live (already loaded) sharded state:
    it then "loads" each model from itself, which changes nothing and needs no gathering."""
    if average is None:
        return loaded
    if averaged:
        loaded[CURRENT_MODEL_KEY] = sharded_model_state(model)
        loaded["state_dict"] = sharded_model_state(average)
    else:
        # A checkpoint written without averaging: the callback starts the average from the model's weights.
        loaded["state_dict"] = sharded_model_state(model)
    return loaded
