"""Two-rank cases for the sites where Lightning and litgpt branch on ``isinstance(strategy, FSDPStrategy)``, which
answer True for our strategies (``lightning_fsdp._fronts.dropin``): each site's FSDP branch must do the right thing with ours.

- ``Trainer.fit(torch.compile(module))`` is accepted and trains exactly as the uncompiled module does;
- the precision each connector picks is our plugin, and it trains, for every precision name on both fronts;
- ``StochasticWeightAveraging`` is refused on every rank, with the fix;
- ``fabric.setup(model, optimizer)`` with an optimizer on meta-device parameters is accepted, and Fabric's other
  checks of ``setup`` still run;
- litgpt's ``load_checkpoint`` takes its FSDP branch (``fabric.load_raw``) and loads a full file into the shards, and
  its ``pretrain.initialize_weights`` leaves initialization to setup, which runs litgpt's initializers.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import StochasticWeightAveraging
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from common import full, full_params, loss_fn, make_fabric, shared_tmpdir, train_steps
from harness import case, run_cases
from lightning_fsdp.engine.precision import DTensorGradScaler, FSDPPrecision
from lightning_fsdp.trainer import FSDPTrainerPrecision
from models import TinyTransformer
from trainer_common import ATOL, WORLD, LitGPT, compare_params, gathered, loader, make_trainer, reference_fit, strategy

PRECISIONS = ("32-true", "bf16-mixed", "16-mixed", "bf16-true")


class _Unlogged(LitGPT):
    """LitGPT whose training step does not call ``self.log``: dynamo cannot trace Lightning's ``self.log`` (it
    inspects the compiled ``training_step``'s signature and fails with "'method' object has no attribute
    '__dict__'"), under DDPStrategy too, so a compiled module with logging fails whatever the strategy."""

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return loss_fn(self.model, batch)


@case
def compiled_module_fits_exactly_like_the_uncompiled_one():
    from torch._dynamo.utils import counters

    eager = _Unlogged()
    make_trainer(strategy(), max_epochs=1).fit(eager, loader())
    uncompiled = gathered(eager.model)
    found = {}
    # "eager" and "aot_eager" run the captured graphs without inductor's code generation (no compiler needed, and
    # seconds on 2 CPU cores).
    for backend in ("eager", "aot_eager"):
        module = _Unlogged()
        counters.clear()
        make_trainer(strategy(), max_epochs=1).fit(torch.compile(module, backend=backend), loader())
        assert counters["stats"]["unique_graphs"] > 0, dict(counters["stats"])  # dynamo did capture the steps
        assert module._compiler_ctx is not None  # Lightning ran the compiled steps
        got = gathered(module.model)
        assert not [k for k in got if "_orig_mod" in k]
        found[backend] = max((got[k] - uncompiled[k]).abs().max().item() for k in uncompiled)
        assert found[backend] <= 1e-6, f"{backend}: compiled differs from uncompiled by {found[backend]:.3e}"
    reference, _ = reference_fit(1)
    found["uncompiled_vs_one_process"] = compare_params(uncompiled, reference.state_dict(), ATOL)
    return found


class _AutocastProbe(LitGPT):
    """Records the autocast state each training step runs under."""

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        self.autocast = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None
        return loss_fn(self.model, batch)


def _expected(precision: str) -> tuple:
    autocast = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(precision)
    stored = torch.bfloat16 if precision == "bf16-true" else torch.float32
    return autocast, stored


@case
def every_precision_gets_our_plugin_and_trains_on_the_trainer_front():
    seen = {}
    for precision in PRECISIONS:
        module = _AutocastProbe(build_in_init=True)  # as `before` below: fp32 from seed 0, then cast by the plugin
        trainer = make_trainer(strategy(), max_epochs=1, precision=precision)
        plugin = trainer.strategy.precision_plugin
        assert type(plugin) is FSDPTrainerPrecision and plugin.precision == precision, (type(plugin), plugin.precision)
        torch.manual_seed(0)
        before = {k: v.float() for k, v in TinyTransformer().state_dict().items()}
        trainer.fit(module, loader())
        after = gathered(module.model)
        moved = max((after[k].float() - before[k]).abs().max().item() for k in before)
        assert moved > 1e-3 and all(torch.isfinite(v).all() for v in after.values()), (precision, moved)
        assert (module.autocast, after["head.weight"].dtype) == _expected(precision), (precision, module.autocast)
        if precision == "16-mixed":
            assert type(plugin.scaler) is DTensorGradScaler and plugin.scaler.is_enabled(), plugin.scaler
        seen[precision] = moved
    return seen


@case
def every_precision_gets_our_plugin_and_trains_on_the_fabric_front():
    seen = {}
    for precision in PRECISIONS:
        fabric = make_fabric(WORLD, precision=precision)
        plugin = fabric.strategy.precision
        assert type(plugin) is FSDPPrecision and plugin.precision == precision, (type(plugin), plugin.precision)
        torch.manual_seed(0)
        with fabric.init_module():
            model = TinyTransformer()
        model, opt = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        before = full_params(model)
        with fabric.autocast():
            autocast = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None
        train_steps(fabric, model, opt, 3)
        after = full_params(model)
        moved = max((after[k].float() - before[k].float()).abs().max().item() for k in before)
        assert moved > 1e-3 and all(torch.isfinite(v).all() for v in after.values()), (precision, moved)
        assert (autocast, before["head.weight"].dtype) == _expected(precision), (precision, autocast)
        if precision == "16-mixed":
            assert type(plugin.scaler) is DTensorGradScaler and plugin.scaler.is_enabled(), plugin.scaler
        seen[precision] = moved
    return seen


@case
def stochastic_weight_averaging_is_refused_with_the_fix():
    trainer = make_trainer(strategy(), max_epochs=1, callbacks=[StochasticWeightAveraging(swa_lrs=0.1)])
    try:
        trainer.fit(LitGPT(), loader())
    except MisconfigurationException as err:
        message = str(err)
    else:
        raise AssertionError("StochasticWeightAveraging was not refused")
    assert message.startswith("`StochasticWeightAveraging` does not support sharded models"), message
    assert "HINT: " in message and "WeightAveraging()" in message, message  # Lightning 2.5: "upgrade to 2.6 and use"
    messages = [None] * WORLD
    dist.all_gather_object(messages, message)
    assert len(set(messages)) == 1, messages  # the same refusal on every rank
    return message


@case
def an_optimizer_on_meta_parameters_is_set_up_with_its_model():
    # Lightning refuses this for its FSDPStrategy, which our strategy now is to `isinstance`; ours materializes the
    # shards in setup and points the optimizer at them, so the refusal is lifted for it.
    fabric = make_fabric(WORLD)
    with fabric.init_module(empty_init=True):
        model = TinyTransformer()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    assert all(p.is_meta for group in optimizer.param_groups for p in group["params"])
    model, optimizer = fabric.setup(model, optimizer)
    assert not any(p.is_meta for group in optimizer.param_groups for p in group["params"])
    before = full_params(model)
    train_steps(fabric, model, optimizer, 2)
    moved = max((full_params(model)[k] - before[k]).abs().max().item() for k in before)
    assert moved > 1e-3, moved
    # Fabric's other checks of `setup` still run for our strategy.
    refusals = []
    for args in ((model,), (TinyTransformer(), optimizer)):
        try:
            fabric.setup(*args)
        except ValueError as err:
            refusals.append(str(err))
    assert refusals == ["A model should be passed only once to the `setup` method.",
                        "An optimizer should be passed only once to the `setup` method."], refusals
    return {"moved": moved}


@case
def litgpt_load_checkpoint_loads_a_full_file_into_the_shards():
    from litgpt.utils import load_checkpoint

    fabric = make_fabric(WORLD)
    torch.manual_seed(1)
    source = TinyTransformer()
    path = shared_tmpdir(fabric) / "lit_model.pth"
    if fabric.global_rank == 0:
        torch.save(source.state_dict(), path)
    fabric.barrier()
    torch.manual_seed(2)
    model = fabric.setup_module(TinyTransformer())
    # litgpt's FSDP branch: `fabric.load_raw(path, model)`; its other branch would `load_state_dict` full tensors
    # into DTensor parameters.
    load_checkpoint(fabric, model, path)
    loaded = full_params(model)
    diff = max((loaded[k] - v).abs().max().item() for k, v in source.state_dict().items())
    assert diff == 0.0, diff
    assert isinstance(model.module.head.weight, torch.distributed.tensor.DTensor)
    return {"diff": diff, "local_rows": model.module.head.weight.to_local().shape[0], "full_rows": full(
        model.module.head.weight).shape[0]}


@case
def litgpt_pretrain_init_runs_litgpts_initializers_at_setup():
    # litgpt's FSDP branch leaves the meta-device model to the strategy: setup runs each module's `reset_parameters`,
    # which `initialize_weights` replaced with its GPT-NeoX initializers.
    from litgpt import GPT, Config
    from litgpt.pretrain import initialize_weights

    config = Config(n_layer=2, n_embd=64, n_head=4, block_size=16, vocab_size=64, padded_vocab_size=64)
    fabric = make_fabric(WORLD)
    torch.manual_seed(0)
    with fabric.init_module(empty_init=True):
        model = GPT(config)
    initialize_weights(fabric, model, n_layer=config.n_layer, n_embd=config.n_embd)
    model = fabric.setup(model)
    weights = full_params(model)
    # The embedding's std is sqrt(2 / 5 / n_embd) ~ 0.079 under litgpt's init (nn.Embedding's own would be 1.0).
    found = {"wte_std": weights["transformer.wte.weight"].std().item()}
    assert 0.06 < found["wte_std"] < 0.1, found
    return found


if __name__ == "__main__":
    run_cases()
