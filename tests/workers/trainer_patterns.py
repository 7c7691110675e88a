"""Two-rank Trainer cases for what users run around ``fit``: validate/test/predict before, between and in the middle
of training (mid-accumulation included), grad-free forwards in callbacks and in manual optimization, torchmetrics in
``training_step``, the ``"fsdp"`` string on CPU, and Lightning's ``WeightAveraging`` callbacks with checkpoints.

Each case compares with a single-process reference on the global batches (see ``trainer_common.py``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch
import torchmetrics
from lightning.pytorch import Callback
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.distributed.tensor import DTensor
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from common import loss_fn
from harness import assert_close, case, run_cases
from lightning_fsdp._base.compat import WeightAveraging

if WeightAveraging is not None:
    from lightning.pytorch.callbacks import EMAWeightAveraging

# Lightning < 2.6 has no weight averaging: its cases are left out here and skipped in test_trainer_patterns.py.
averaging_case = case if WeightAveraging is not None else (lambda fn: fn)
from models import TinyTransformer
from trainer_common import (
    ATOL,
    WORLD,
    LitGPT,
    assert_trained,
    compare_params,
    gathered,
    global_batches,
    loader,
    make_trainer,
    plain_sgd,
    reference_fit,
    sgd,
    strategy,
)

import os

OUT = Path(os.environ["LFSDP_TEST_OUT"])


def model_weights(lit: LitGPT) -> dict[str, torch.Tensor]:
    return gathered(lit.model)


# --- evaluation around and inside fit ----------------------------------------------------------------------------


@case
def validate_then_fit_trains_every_unit():
    # The validation forward leaves the root unit gathered; the optimizer built afterwards must still get shards.
    lit = LitGPT()
    trainer = make_trainer(strategy(sharding_strategy="SHARD_GRAD_OP"))
    trainer.validate(lit, loader(8, offset=100))
    trainer.fit(lit, loader())
    reference, _ = reference_fit(2)
    return {"param_diff": compare_params(model_weights(lit), reference.state_dict(), ATOL),
            "moved": assert_trained(reference)}


@case
def fit_validate_test_predict_then_fit_again():
    # plain SGD: the second fit builds a new optimizer, and without momentum the reference need not model that.
    lit = LitGPT(optimizer="plain_sgd")
    trainer = make_trainer(max_epochs=1)
    trainer.fit(lit, loader())
    trainer.validate(lit, loader(8, offset=100))
    trainer.test(lit, loader(8, offset=200))
    trainer.predict(lit, loader(4, offset=300))
    trainer.fit_loop.max_epochs = 2
    trainer.fit(lit, loader())
    assert trainer.current_epoch == 2, trainer.current_epoch
    reference, _ = reference_fit(2, plain_sgd)
    return {"param_diff": compare_params(model_weights(lit), reference.state_dict(), ATOL)}


@case
def validation_in_the_middle_of_accumulation():
    # 4 batches per epoch per rank, a step every 2, validation after every 3rd batch: the first check falls
    # between the two backwards of an accumulation window.
    lit = LitGPT()
    trainer = make_trainer(accumulate_grad_batches=2, val_check_interval=3)
    trainer.fit(lit, loader(), loader(8, offset=100))
    reference, _ = reference_fit(2, accumulate=2)
    return {"param_diff": compare_params(model_weights(lit), reference.state_dict(), ATOL)}


class NoGradForwardBeforeEachStep(Callback):
    """Logs a grad-free loss on a fixed probe batch right before every optimizer step."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        probe = next(iter(loader(2, offset=500)))
        with torch.no_grad():
            self.losses.append(loss_fn(pl_module.model, probe).item())


@case
def no_grad_forward_in_a_callback_before_the_step():
    diffs = {}
    for sharding in ("FULL_SHARD", "SHARD_GRAD_OP"):
        probe_losses = NoGradForwardBeforeEachStep()
        lit = LitGPT()
        make_trainer(strategy(sharding_strategy=sharding), callbacks=[probe_losses]).fit(lit, loader())
        assert len(probe_losses.losses) == 8, probe_losses.losses  # one probe per optimizer step
        reference, _ = reference_fit(2)
        diffs[sharding] = compare_params(model_weights(lit), reference.state_dict(), ATOL)
    return diffs


class ManualWithLoggingForward(LitGPT):
    """Manual optimization: backward, a grad-free forward for logging, then the step."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        opt = self.optimizers()
        self.manual_backward(loss_fn(self.model, batch))
        with torch.no_grad():
            self.log("probe", loss_fn(self.model, batch), sync_dist=True)
        opt.step()
        opt.zero_grad()


@case
def manual_optimization_with_a_grad_free_forward_before_the_step():
    lit = ManualWithLoggingForward()
    make_trainer().fit(lit, loader())
    reference, _ = reference_fit(2)
    return {"param_diff": compare_params(model_weights(lit), reference.state_dict(), ATOL)}


class MetricInTrainingStep(LitGPT):
    """Updates a torchmetrics metric with the per-sample losses in every training step."""

    def __init__(self) -> None:
        super().__init__()
        self.train_mean = torchmetrics.MeanMetric()

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = loss_fn(self.model, batch)
        with torch.no_grad():
            self.train_mean.update(self._per_sample(batch))
        return loss


@case
def torchmetrics_updates_in_training_step_match_the_reference():
    lit = MetricInTrainingStep()
    make_trainer(max_epochs=1).fit(lit, loader())
    synced = lit.train_mean.compute().item()
    # The reference: the same per-sample losses, evaluated on the model before each step.
    torch.manual_seed(0)
    model = TinyTransformer()
    opt = sgd(model.parameters())
    seen = []
    for batch in global_batches(0):
        with torch.no_grad():
            logits = model(batch[:, :-1]).float()
            seen.append(torch.nn.functional.cross_entropy(logits.transpose(1, 2), batch[:, 1:], reduction="none").mean(1))
        loss_fn(model, batch).backward()
        opt.step()
        opt.zero_grad()
    expected = torch.cat(seen).mean().item()
    diff = assert_close(torch.tensor(synced), torch.tensor(expected), ATOL, "synced metric")
    compare_params(model_weights(lit), model.state_dict(), ATOL)
    return {"metric": synced, "diff": diff}


@case
def registry_string_trains_on_cpu():
    from lightning.pytorch import Trainer

    from lightning_fsdp.trainer import FSDPStrategy

    lit = LitGPT()
    trainer = Trainer(accelerator="cpu", devices=WORLD, strategy="fsdp", max_epochs=2, logger=False,
                      enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False)
    assert type(trainer.strategy) is FSDPStrategy
    trainer.fit(lit, loader())
    reference, _ = reference_fit(2)
    return {"param_diff": compare_params(model_weights(lit), reference.state_dict(), ATOL)}


# --- weight averaging ------------------------------------------------------------------------------------------


def averaged_reference(epochs: int, make_average, val_n: int = 8) -> tuple[AveragedModel, list[float]]:
    """Single-process SGD on the global batches with an AveragedModel updated after every step, as the callback
    does; returns the average and its validation loss after each epoch (the callback swaps it in for validation)."""
    torch.manual_seed(0)
    model = TinyTransformer()
    average = make_average(model)
    opt = sgd(model.parameters())
    val_losses = []
    val = torch.cat(list(loader(val_n, offset=100)))
    for epoch in range(epochs):
        for batch in global_batches(epoch):
            loss_fn(model, batch).backward()
            opt.step()
            opt.zero_grad()
            average.update_parameters(model)
        with torch.no_grad():
            val_losses.append(loss_fn(average.module, val).item())
    return average, val_losses


AVERAGES = {
    "swa": (lambda: WeightAveraging(), lambda m: AveragedModel(m)),
    "ema": (lambda: EMAWeightAveraging(decay=0.9), lambda m: AveragedModel(
        m, avg_fn=lambda avg, cur, n: 0.9 * avg + 0.1 * cur, use_buffers=True)),
    "ema_multi": (lambda: WeightAveraging(multi_avg_fn=get_ema_multi_avg_fn(0.8)),
                  lambda m: AveragedModel(m, multi_avg_fn=get_ema_multi_avg_fn(0.8))),
}


class ValLoss(LitGPT):
    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.log("val_loss", loss_fn(self.model, batch), sync_dist=True)


def _averaging_fit(kind: str, **strategy_kwargs) -> dict:
    make_callback, make_reference = AVERAGES[kind]
    callback = make_callback()
    lit = ValLoss()
    trainer = make_trainer(strategy(**strategy_kwargs), callbacks=[callback])
    trainer.fit(lit, loader(), loader(8, offset=100))
    average, val_losses = averaged_reference(2, make_reference)
    copy_params = list(callback._average_model.module.parameters())
    assert all(isinstance(p, DTensor) for p in copy_params), "the averaged copy is not sharded"
    local = sum(p.to_local().numel() for p in copy_params)
    total = sum(p.numel() for p in copy_params)
    assert local <= total / WORLD + 64, f"each rank holds {local} of {total} averaged elements"
    expected = {f"model.{k}": v for k, v in average.module.state_dict().items()}
    average_diff = compare_params(gathered(callback._average_model.module), expected, ATOL)
    # At the end of fit the callback copies the average into the model.
    model_diff = compare_params(model_weights(lit), average.module.state_dict(), ATOL)
    val_diff = assert_close(trainer.callback_metrics["val_loss"], torch.tensor(val_losses[-1]), ATOL, "val_loss")
    return {"average_diff": average_diff, "model_diff": model_diff, "val_diff": val_diff,
            "local_fraction": local / total}


@averaging_case
def swa_weight_averaging_matches_averaged_model():
    return _averaging_fit("swa")


@averaging_case
def ema_weight_averaging_matches_averaged_model_shard_grad_op():
    return _averaging_fit("ema", sharding_strategy="SHARD_GRAD_OP")


@averaging_case
def ema_multi_avg_fn_matches_averaged_model_with_activation_checkpointing():
    return _averaging_fit("ema_multi", activation_checkpointing_policy=["models.Block"])


@averaging_case
def weight_averaging_after_an_earlier_call_is_refused_with_a_hint():
    # FSDP2 cannot deep-copy a sharded model, which the callback does when fit begins; the error says what to do.
    lit = LitGPT()
    trainer = make_trainer(callbacks=[EMAWeightAveraging(decay=0.9)])
    trainer.validate(lit, loader(8, offset=100))
    try:
        trainer.fit(lit, loader())
    except RuntimeError as err:
        message = str(err)
    else:
        raise AssertionError("fit after validate with WeightAveraging did not raise")
    assert "already sharded" in message and "HINT:" in message and "does not support deepcopy" not in message, message
    # The documented way: a fresh model for fit.
    fresh = LitGPT()
    callback = EMAWeightAveraging(decay=0.9)
    make_trainer(callbacks=[callback]).fit(fresh, loader())
    assert callback._average_model.n_averaged.item() == 8
    return {"message": message[:120]}


def _averaging_resume(state_dict_type: str) -> dict:
    """Two epochs in one go against one epoch, a checkpoint, and a resumed second epoch in a new Trainer: the live
    and the averaged weights must both match."""
    root = OUT / f"averaging_{state_dict_type}"

    def run(ckpt_path: Optional[str], dirpath: Path) -> tuple[LitGPT, Any]:
        callback = EMAWeightAveraging(decay=0.9)
        saver = ModelCheckpoint(dirpath=dirpath, save_top_k=-1, every_n_epochs=1, save_on_train_epoch_end=True)
        lit = LitGPT()
        trainer = make_trainer(strategy(state_dict_type=state_dict_type), callbacks=[callback, saver],
                               enable_checkpointing=True)
        trainer.fit(lit, loader(), ckpt_path=ckpt_path)
        return lit, callback

    straight, straight_cb = run(None, root / "straight")
    first = sorted((root / "straight").glob("epoch=0*"))
    assert len(first) == 1, first
    resumed, resumed_cb = run(str(first[0]), root / "resumed")
    model_diff = compare_params(model_weights(resumed), model_weights(straight), 0.0)
    average_diff = compare_params(gathered(resumed_cb._average_model.module),
                                  gathered(straight_cb._average_model.module), 0.0)
    assert resumed_cb._average_model.n_averaged.item() == straight_cb._average_model.n_averaged.item() == 8
    return {"model_diff": model_diff, "average_diff": average_diff}


@averaging_case
def weight_averaging_resumes_exactly_from_a_full_checkpoint():
    return _averaging_resume("full")


@averaging_case
def weight_averaging_resumes_exactly_from_a_sharded_checkpoint():
    return _averaging_resume("sharded")


if __name__ == "__main__":
    run_cases()
