"""Two-rank checkpoint cases for the Trainer front: both layouts through ModelCheckpoint and trainer.save_checkpoint,
bit-exact resume, Lightning's own readers (consolidate_checkpoint, load_from_checkpoint, a DDP Trainer), save_top_k,
failed saves, async saves, compiled models. Leaves checkpoints in ``$LFSDP_TEST_OUT/handoff`` for the one-process
launch (``trainer_resize.py``) to resume at another world size."""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning.fabric.utilities.load import _load_distributed_checkpoint
from harness import case, run_cases
from lightning_fsdp.engine.precision import DTensorGradScaler
from lightning_fsdp.trainer import FSDPTrainerPrecision
from models import UnevenModel
from trainer_common import LitGPT, adamw, compare_params, gathered, loader, make_trainer, reference_fit, strategy

OUT = Path(os.environ["LFSDP_TEST_OUT"])
HANDOFF = OUT / "handoff"


def _dir(name: str) -> Path:
    return OUT / "ckpt" / name


def _checkpointing(dirpath: Path, **kwargs) -> ModelCheckpoint:
    kwargs.setdefault("save_top_k", -1)
    return ModelCheckpoint(dirpath=dirpath, filename="{epoch}", **kwargs)


def _uninterrupted(state_dict_type: str, name: str) -> tuple[LitGPT, Path]:
    """Two epochs of AdamW with a per-step LR schedule, a checkpoint after each epoch."""
    model = LitGPT(optimizer="adamw", scheduler=True)
    trainer = make_trainer(
        strategy(state_dict_type=state_dict_type), enable_checkpointing=True,
        callbacks=[_checkpointing(_dir(name), save_last=True)],
    )
    trainer.fit(model, loader())
    return model, _dir(name)


def _resume(state_dict_type: str, ckpt_path, dirpath: Path) -> tuple[LitGPT, object]:
    model = LitGPT(optimizer="adamw", scheduler=True)
    trainer = make_trainer(
        strategy(state_dict_type=state_dict_type), enable_checkpointing=True, callbacks=[_checkpointing(dirpath)]
    )
    trainer.fit(model, loader(), ckpt_path=ckpt_path)
    return model, trainer


def _resume_is_bit_exact(state_dict_type: str) -> dict:
    uninterrupted, path = _uninterrupted(state_dict_type, f"resume_{state_dict_type}")
    expected = gathered(uninterrupted.model)
    resumed, trainer = _resume(state_dict_type, path / "epoch=0.ckpt", _dir(f"resume_{state_dict_type}_again"))
    assert trainer.global_step == 8, trainer.global_step
    diff = compare_params(gathered(resumed.model), expected, atol=0.0)
    # The uninterrupted run matches one process too, so the resumed run is right, not only repeatable.
    reference, _ = reference_fit(2, adamw, scheduler=True)
    ref_diff = compare_params(expected, reference.state_dict(), 1e-5)
    HANDOFF.mkdir(parents=True, exist_ok=True)
    if trainer.global_rank == 0:
        torch.save(expected, HANDOFF / f"final_{state_dict_type}.pt")
    return {"resumed_vs_uninterrupted": diff, "uninterrupted_vs_reference": ref_diff}


@case
def resume_from_sharded_checkpoint_is_bit_exact():
    return _resume_is_bit_exact("sharded")


@case
def resume_from_full_checkpoint_is_bit_exact():
    return _resume_is_bit_exact("full")


@case
def resume_from_last():
    # The run above saved `last.ckpt` (a sharded directory) after its second epoch; train a third epoch from it, and
    # compare with a run that does all three epochs at once.
    resumed, trainer = _make_resume_last()
    straight = LitGPT(optimizer="adamw", scheduler=True)
    make_trainer(strategy(), max_epochs=3).fit(straight, loader())
    return {"param_diff": compare_params(gathered(resumed.model), gathered(straight.model), atol=0.0),
            "global_step": trainer.global_step}


def _make_resume_last():
    dirpath = _dir("resume_sharded")
    assert (dirpath / "last.ckpt" / ".metadata").is_file()
    model = LitGPT(optimizer="adamw", scheduler=True)
    trainer = make_trainer(
        strategy(state_dict_type="sharded"), max_epochs=3, enable_checkpointing=True,
        callbacks=[_checkpointing(dirpath, save_last=True)],
    )
    trainer.fit(model, loader(), ckpt_path="last")
    assert trainer.global_step == 12, trainer.global_step
    return model, trainer


@case
def sharded_layout_is_lightnings_and_consolidates():
    from lightning.fabric.utilities.load import _load_distributed_checkpoint
    from lightning.pytorch.utilities.consolidate_checkpoint import _format_checkpoint

    scaler = DTensorGradScaler("cpu", init_scale=2.0**8)
    model = LitGPT(optimizer="adamw", scheduler=True)
    trainer = make_trainer(
        strategy(state_dict_type="sharded", precision_plugin=FSDPTrainerPrecision("16-mixed", scaler=scaler)),
        max_epochs=1, enable_checkpointing=True, callbacks=[_checkpointing(_dir("layout"))],
    )
    trainer.fit(model, loader())
    path = _dir("layout") / "epoch=0.ckpt"
    keys = {k.split(".", 1)[0] for k in dcp.FileSystemReader(path).read_metadata().state_dict_metadata}
    assert keys == {"model", "optimizer_0"}, keys
    meta = torch.load(path / "meta.pt", weights_only=True)
    wanted = {"epoch", "global_step", "loops", "callbacks", "lr_schedulers", "hyper_parameters", "FSDPTrainerPrecision"}
    assert wanted <= set(meta) and not {"state_dict", "optimizer_states"} & set(meta), sorted(meta)
    assert meta["FSDPTrainerPrecision"]["scale"] == scaler.get_scale() and meta["global_step"] == 4
    final = gathered(model)
    if trainer.global_rank == 0:
        consolidated = _format_checkpoint(_load_distributed_checkpoint(path))
        plain = LitGPT()
        plain.configure_model()
        plain.load_state_dict(consolidated["state_dict"])
        compare_params(plain.state_dict(), final, atol=0.0)
        assert len(consolidated["optimizer_states"]) == 1 and consolidated["lr_schedulers"]
    return sorted(meta)


@case
def full_checkpoint_is_a_standard_ckpt_file():
    path = _dir("resume_full") / "epoch=1.ckpt"
    assert path.is_file()
    model = LitGPT(optimizer="adamw", scheduler=True)
    trainer = make_trainer(strategy())
    trainer.validate(model, loader(), ckpt_path=path, verbose=False)
    final = gathered(model)
    if trainer.global_rank == 0:
        contents = torch.load(path, weights_only=True)
        optimizer_state = contents["optimizer_states"][0]
        # Integer parameter ids, as `optimizer.state_dict()` writes them, so any strategy can load them.
        assert all(isinstance(k, int) for k in optimizer_state["state"]), list(optimizer_state["state"])[:4]
        assert all(isinstance(p, int) for g in optimizer_state["param_groups"] for p in g["params"])
        loaded = LitGPT.load_from_checkpoint(path)  # one process, no strategy
        compare_params(loaded.state_dict(), final, atol=0.0)
        plain = loaded.configure_optimizers()["optimizer"]
        plain.load_state_dict(optimizer_state)
        # The values: the sharded run of the same training (bit-identical, see the resume cases) wrote the same
        # optimizer state by name; position j of the plain optimizer is the j-th parameter of the module.
        names = [n for n, _ in loaded.named_parameters()]
        got = {f"{names[j]}/{k}": v for j, s in plain.state_dict()["state"].items() for k, v in s.items()}
        sharded = _load_distributed_checkpoint(_dir("resume_sharded") / "epoch=1.ckpt")["optimizer_0"]["state"]
        expected = {f"{n}/{k}": v for n, s in sharded.items() for k, v in s.items()}
        assert {k.rsplit("/", 1)[1] for k in expected} == {"step", "exp_avg", "exp_avg_sq"}, sorted(expected)[:6]
        compare_params(got, expected, atol=0.0)
    return sorted(contents) if trainer.global_rank == 0 else None


@case
def full_ckpt_gathers_one_tensor_at_a_time():
    """`.ckpt` files are streamed: when a tensor is gathered, no earlier gathered tensor is still held (the loop
    variable may keep the one just written). A writer that gathered everything first would hold them all."""
    import weakref

    from torch.distributed.tensor import DTensor

    model = LitGPT(optimizer="adamw")
    trainer = make_trainer(strategy(state_dict_type="full"), max_steps=1)
    trainer.fit(model, loader())
    alive: list = []
    held: list[int] = []
    original = DTensor.full_tensor

    def counting(self, *args, **kwargs):
        held.append(sum(ref() is not None for ref in alive))
        out = original(self, *args, **kwargs)
        alive.append(weakref.ref(out))
        return out

    DTensor.full_tensor = counting
    try:
        trainer.save_checkpoint(_dir("streamed") / "one.ckpt")
    finally:
        DTensor.full_tensor = original
    tensors = 3 * len(list(model.parameters()))  # each parameter and its two AdamW moments
    assert len(held) >= tensors, f"only {len(held)} gathers for {tensors} sharded tensors"
    assert max(held) <= 1, f"gathered tensors held at once, per gather: {held}"
    return {"gathers": len(held), "most_held_at_once": max(held)}


@case
def ddp_resumes_from_our_full_checkpoint():
    expected = torch.load(HANDOFF / "final_full.pt", weights_only=True)
    model = LitGPT(optimizer="adamw", scheduler=True)
    trainer = make_trainer("ddp")
    trainer.fit(model, loader(), ckpt_path=_dir("resume_full") / "epoch=0.ckpt")
    assert trainer.global_step == 8
    # DDP averages gradients with an all-reduce, FSDP with a reduce-scatter: equal up to float rounding.
    return {"param_diff": compare_params(model.model.state_dict(), expected, atol=1e-5)}


@case
def validate_and_test_from_a_sharded_directory():
    expected = torch.load(HANDOFF / "final_sharded.pt", weights_only=True)
    report = {}
    for run in ("validate", "test"):
        model = LitGPT()
        trainer = make_trainer(strategy(state_dict_type="sharded"))
        (metrics,) = getattr(trainer, run)(model, loader(8, offset=100), ckpt_path=_dir("resume_sharded") / "epoch=1.ckpt", verbose=False)
        report[run] = compare_params(gathered(model.model), expected, atol=0.0)
    return report


@case
def save_top_k_removes_old_sharded_directories():
    dirpath = _dir("top_k")
    callback = ModelCheckpoint(dirpath=dirpath, filename="{epoch}", monitor="step", mode="max", save_top_k=1,
                               save_last=True)
    trainer = make_trainer(strategy(state_dict_type="sharded"), max_epochs=3, enable_checkpointing=True,
                           callbacks=[callback])
    trainer.fit(LitGPT(), loader())
    trainer.strategy.barrier()
    names = sorted(p.name for p in dirpath.iterdir())
    assert names == ["epoch=2.ckpt", "last.ckpt"], names
    assert all((dirpath / n / ".metadata").is_file() for n in names)
    return names


class _Unpicklable(LitGPT):
    fail = False

    def on_save_checkpoint(self, checkpoint):
        if self.fail:
            checkpoint["oops"] = lambda: None  # torch.save cannot pickle a lambda


@case
def a_failed_save_keeps_the_last_good_checkpoint():
    report = {}
    for kind in ("sharded", "full"):
        model = _Unpicklable()
        trainer = make_trainer(strategy(state_dict_type=kind), max_epochs=1)
        trainer.fit(model, loader())
        path = _dir("failed_save") / f"{kind}.ckpt"
        trainer.save_checkpoint(path)
        good = gathered(model.model)
        with torch.no_grad():  # the model moves on, so the next save would differ
            for param in model.parameters():
                param.add_(1.0)
        model.fail = True
        try:
            trainer.save_checkpoint(path)
        except Exception as err:  # noqa: BLE001 - the same error on every rank
            report[kind] = f"{type(err).__name__}: {str(err)[:120]}"
        else:
            raise AssertionError("the save should have failed")
        fresh = LitGPT()
        make_trainer(strategy()).validate(fresh, loader(8), ckpt_path=path, verbose=False)
        compare_params(gathered(fresh.model), good, atol=0.0)
        leftovers = [p.name for p in path.parent.iterdir() if p.name.startswith(".")]
        assert not leftovers, leftovers
    return report


@case
def async_sharded_saves_are_complete_after_fit():
    model = LitGPT()
    trainer = make_trainer(strategy(state_dict_type="sharded", async_save=True), enable_checkpointing=True,
                           callbacks=[_checkpointing(_dir("async"))])
    trainer.fit(model, loader())
    final = gathered(model.model)
    fresh = LitGPT()
    make_trainer(strategy()).validate(fresh, loader(8), ckpt_path=_dir("async") / "epoch=1.ckpt", verbose=False)
    return {"param_diff": compare_params(gathered(fresh.model), final, atol=0.0)}


class _CompiledWhole(LitGPT):
    def configure_model(self):
        super().configure_model()
        self.model = torch.compile(self.model, backend="eager")


@case
def compiled_model_checkpoint_has_clean_keys():
    model = _CompiledWhole()
    trainer = make_trainer(strategy(state_dict_type="full"), max_epochs=1)
    trainer.fit(model, loader())
    path = _dir("compiled") / "model.ckpt"
    trainer.save_checkpoint(path)
    final = {k.replace("_orig_mod.", ""): v for k, v in gathered(model).items()}
    if trainer.global_rank == 0:
        contents = torch.load(path, weights_only=True)
        dirty = [k for k in contents["state_dict"] if "_orig_mod" in k]
        assert not dirty, dirty
        loaded = LitGPT.load_from_checkpoint(path)  # an uncompiled module takes the keys as they are
        compare_params(loaded.state_dict(), final, atol=0.0)
    # And a compiled module loads them back on 2 ranks.
    again = _CompiledWhole()
    make_trainer(strategy()).validate(again, loader(8), ckpt_path=path, verbose=False)
    got = {k.replace("_orig_mod.", ""): v for k, v in gathered(again).items()}
    return {"param_diff": compare_params(got, final, atol=0.0)}


class _LitUneven(LitGPT):
    """LitGPT around :class:`UnevenModel`: parameters whose dim 0 does not divide by 2 ranks (vocab 37, a 3-way
    head). Module-level, so ``load_from_checkpoint`` can rebuild it."""

    def configure_model(self) -> None:
        if self.model is None:
            torch.manual_seed(0)
            self.model = UnevenModel()

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.model(batch)


def _optimizer_state(trainer) -> dict:
    from common import full

    state = trainer.optimizers[0].state_dict()["state"]
    return {(i, k): full(v).detach().clone() for i, s in state.items() for k, v in s.items() if torch.is_tensor(v)}


def _exact(got: dict, expected: dict, what: str) -> None:
    assert sorted(got, key=str) == sorted(expected, key=str), f"{what}: keys {sorted(set(got) ^ set(expected))}"
    for k, e in expected.items():
        g = got[k]
        assert g.dtype == e.dtype and g.shape == e.shape and torch.equal(g, e), f"{what}: {k} differs"


@case
def uneven_shapes_full_checkpoint_reads_back_exactly():
    """A full .ckpt of parameters whose dim 0 does not divide by the world size holds exactly their elements:
    plain torch.load (which checks every record's size), mmap, load_from_checkpoint in one process, and a resume
    into a fresh module and optimizer all read what was saved."""
    report = {}
    for sharding in ("FULL_SHARD", "SHARD_GRAD_OP"):
        model = _LitUneven(optimizer="adamw")
        trainer = make_trainer(strategy(state_dict_type="full", sharding_strategy=sharding), max_epochs=1)
        trainer.fit(model, loader())
        path = _dir("uneven") / f"{sharding}.ckpt"
        trainer.save_checkpoint(path)
        final, saved_opt = gathered(model), _optimizer_state(trainer)
        uneven = sorted(k for k, v in final.items() if v.dim() and v.shape[0] % trainer.world_size)
        assert {"model.lm.embed.weight", "model.cls.weight", "model.row"} <= set(uneven), uneven
        error = None
        if trainer.global_rank == 0:
            try:
                for mmap in (False, True):
                    contents = torch.load(path, weights_only=True, mmap=mmap)
                    _exact(contents["state_dict"], final, f"{sharding} mmap={mmap} state_dict")
                    state = contents["optimizer_states"][0]["state"]
                    _exact({(i, k): v for i, s in state.items() for k, v in s.items() if torch.is_tensor(v)},
                           saved_opt, f"{sharding} mmap={mmap} optimizer")
                loaded = _LitUneven.load_from_checkpoint(path)  # one process, no strategy
                _exact(loaded.state_dict(), final, f"{sharding} load_from_checkpoint")
            except Exception as err:  # noqa: BLE001 - raised below; the other rank fails with it too
                error = err
        message = trainer.strategy.broadcast(None if error is None else f"{type(error).__name__}: {error}")
        if error is not None:
            raise error
        if message is not None:
            raise AssertionError(f"failed on rank 0: {message}")
        # Resume into a fresh module: fit restores the model and optimizer, then stops at once (max_epochs reached).
        fresh = _LitUneven(optimizer="adamw")
        again = make_trainer(strategy(state_dict_type="full", sharding_strategy=sharding), max_epochs=1)
        again.fit(fresh, loader(), ckpt_path=path)
        assert again.global_step == trainer.global_step, (again.global_step, trainer.global_step)
        _exact(gathered(fresh), final, f"{sharding} resumed model")
        _exact(_optimizer_state(again), saved_opt, f"{sharding} resumed optimizer")
        report[sharding] = {"uneven": uneven}
    return report


class _LitPooler(LitGPT):
    """A head trained from the second epoch on only: the first epoch's checkpoint holds no optimizer state for it."""

    def configure_model(self) -> None:
        super().configure_model()
        if not hasattr(self, "pooler"):
            torch.manual_seed(1)
            self.pooler = torch.nn.Linear(32, 32)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        logits = self.model(batch[:, :-1]).float()
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        if self.current_epoch >= 1:
            loss = loss + self.pooler(logits).square().mean()
        return loss


@case
def a_head_that_never_stepped_resumes_strictly_and_exactly():
    """Issue 37 item 4 on the Trainer front, both layouts: resuming (strict, Lightning's default) from a checkpoint
    whose optimizer never stepped the pooler was refused ("missing from the checkpoint: 2 ('pooler.bias',
    'pooler.weight')"); now it loads with no state for the pooler, and the epoch that trains it matches the unbroken
    run bit for bit (a zero state with a step count of 1 would not)."""
    report = {}
    for kind in ("sharded", "full"):
        dirpath = _dir(f"pooler_{kind}")
        straight = _LitPooler(optimizer="adamw")
        make_trainer(strategy(state_dict_type=kind), enable_checkpointing=True,
                     callbacks=[_checkpointing(dirpath)]).fit(straight, loader())
        resumed = _LitPooler(optimizer="adamw")
        trainer = make_trainer(strategy(state_dict_type=kind))
        trainer.fit(resumed, loader(), ckpt_path=dirpath / "epoch=0.ckpt")
        assert trainer.global_step == 8, trainer.global_step
        report[kind] = {
            "model": compare_params(gathered(resumed.model), gathered(straight.model), atol=0.0),
            "pooler": compare_params(gathered(resumed.pooler), gathered(straight.pooler), atol=0.0),
        }
    return report


if __name__ == "__main__":
    run_cases()
