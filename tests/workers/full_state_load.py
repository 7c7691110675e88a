"""Two-rank cases: full (unsharded) state dicts into a set-up model, by every route (issue 19, part 1).

Each case builds the same model twice from one seed: a plain copy that stays unsharded (the reference, which says
what torch does without sharding) and one set up by the strategy. A full state dict made on the side is loaded into
both; the sharded model, gathered back to full tensors, must equal the reference bit for bit, and the missing and
unexpected keys (or the error) must be the ones torch reports for the reference.
"""

from __future__ import annotations


import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from common import full, make_fabric, shared_tmpdir
from harness import case, run_cases
from models import Odd, Remapped
from trainer_common import make_trainer, strategy

WORLD = 2
FABRICS: dict[str, object] = {}


def fabric_for(sharding: str = "FULL_SHARD"):
    # One Fabric per sharding strategy; they share the process group torchrun set up.
    if sharding not in FABRICS:
        FABRICS[sharding] = make_fabric(WORLD, sharding_strategy=sharding)
    return FABRICS[sharding]


# ------------------------------------------------------------------------------------------------- models


class Flattened(nn.Module):
    """A hook that reshapes: the checkpoint stores the weight flattened, the module views it back to 2-D."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(3, 7)

    def forward(self, x):
        return self.proj(x)

    def _load_from_state_dict(self, sd, prefix, *args, **kwargs):
        key = prefix + "proj.weight"
        if key in sd and sd[key].ndim == 1:
            sd[key] = sd[key].view(7, 3)
        super()._load_from_state_dict(sd, prefix, *args, **kwargs)


def built(factory, seed: int = 0):
    torch.manual_seed(seed)
    return factory()


def reference_and_sharded(factory, sharding: str = "FULL_SHARD"):
    fabric = fabric_for(sharding)
    reference = built(factory)
    model = fabric.setup(built(factory))
    return fabric, reference, model


def other_values(factory) -> dict[str, torch.Tensor]:
    """A full state dict that differs from the freshly built model everywhere (seed 1 instead of 0)."""
    return {k: v.clone() for k, v in built(factory, seed=1).state_dict().items()}


def gathered(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: full(v).detach().clone() for k, v in model.state_dict().items()}


def assert_equal_to(model: nn.Module, reference: nn.Module) -> int:
    got, expected = gathered(model), reference.state_dict()
    assert sorted(got) == sorted(expected), f"keys differ: {sorted(set(got) ^ set(expected))}"
    for key, value in expected.items():
        assert torch.equal(got[key], value), f"{key}: differs from the unsharded reference"
    return len(expected)


def assert_all_sharded(model: nn.Module) -> None:
    plain = [n for n, p in model.named_parameters() if not isinstance(p, DTensor)]
    assert not plain, f"parameters that are no longer DTensor shards: {plain}"


def same_on_every_rank(value):
    everyone = [None] * WORLD
    dist.all_gather_object(everyone, value)
    assert all(v == everyone[0] for v in everyone), f"ranks differ: {everyone}"
    return everyone[0]


def keys_of(result) -> tuple[list[str], list[str]]:
    return sorted(result.missing_keys), sorted(result.unexpected_keys)


def one_step(model: nn.Module, x: torch.Tensor, fabric=None) -> float:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    if fabric is not None:
        optimizer = fabric.setup_optimizers(optimizer)
    loss = model(x).square().mean()
    (fabric.backward(loss) if fabric is not None else loss.backward())
    optimizer.step()
    return loss.item()


# ------------------------------------------------------------------------------------------------- Fabric


@case
def issue_reproduction_load_state_dict_of_a_full_dict():
    factory = lambda: nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))  # noqa: E731
    _, reference, model = reference_and_sharded(factory)
    full_sd = other_values(factory)
    reference.load_state_dict(full_sd)
    result = model.load_state_dict(full_sd)
    assert keys_of(result) == ([], []), result
    assert_all_sharded(model)
    return assert_equal_to(model, reference)


@case
def issue_reproduction_load_raw_through_a_renaming_module():
    fabric, reference, model = reference_and_sharded(Remapped)
    path = shared_tmpdir(fabric) / "base.pth"
    base = built(lambda: nn.Linear(4, 4), seed=1).state_dict()
    if fabric.global_rank == 0:
        torch.save(base, path)
    fabric.barrier()
    reference.load_state_dict(base, strict=False)
    fabric.load_raw(path, model, strict=False)
    assert_all_sharded(model)
    return assert_equal_to(model, reference)


@case
def renaming_module_through_load_state_dict():
    _, reference, model = reference_and_sharded(Remapped)
    base = built(lambda: nn.Linear(4, 4), seed=1).state_dict()
    expected = keys_of(reference.load_state_dict(base, strict=True))
    assert keys_of(model.load_state_dict(base, strict=True)) == expected
    return assert_equal_to(model, reference)


@case
def reshaping_hook():
    _, reference, model = reference_and_sharded(Flattened)
    values = other_values(Flattened)
    values["proj.weight"] = values["proj.weight"].reshape(-1)
    reference.load_state_dict(values)
    model.load_state_dict(values)
    return assert_equal_to(model, reference)


@case
def strict_false_reports_the_keys_torch_reports():
    _, reference, model = reference_and_sharded(Odd)
    values = other_values(Odd)
    del values["proj.bias"]
    values["extra.weight"] = torch.ones(2, 2)
    expected = keys_of(reference.load_state_dict(dict(values), strict=False))
    got = keys_of(model.load_state_dict(dict(values), strict=False))
    assert got == expected, f"{got} != torch's {expected}"
    assert expected == (["proj.bias"], ["extra.weight"])
    assert_equal_to(model, reference)
    return same_on_every_rank(got)


@case
def strict_raises_what_torch_raises():
    _, reference, model = reference_and_sharded(Odd)
    values = other_values(Odd)
    del values["proj.bias"]
    errors = []
    for target in (reference, model):
        try:
            target.load_state_dict(dict(values))
        except RuntimeError as err:
            errors.append(str(err).replace("FSDPOdd", "Odd"))  # fully_shard renames the class
    assert len(errors) == 2 and errors[0] == errors[1], errors
    return same_on_every_rank(errors[1])


@case
def size_mismatch_is_reported_by_torch():
    _, reference, model = reference_and_sharded(Odd)
    values = other_values(Odd)
    values["proj.weight"] = torch.ones(3, 5)
    messages = []
    for target in (reference, model):
        try:
            target.load_state_dict(values)
        except RuntimeError as err:
            messages.append("size mismatch for proj.weight" in str(err))
    assert messages == [True, True], messages
    return True


@case
def odd_shapes_load_exactly():
    fabric, reference, model = reference_and_sharded(Odd)
    shards = {n: tuple(p.to_local().shape) for n, p in model.module.named_parameters()}
    values = other_values(Odd)
    reference.load_state_dict(values)
    model.load_state_dict(values)
    assert_equal_to(model, reference)
    if fabric.global_rank == 1:
        assert shards["narrow.weight"] == (0, 7), shards  # the 1-row weight leaves rank 1 nothing
    return shards


@case
def assign_true_keeps_shards_of_their_own():
    fabric, reference, model = reference_and_sharded(Odd)
    placements = {n: p.placements for n, p in model.named_parameters()}
    values = other_values(Odd)
    reference.load_state_dict(values, assign=True)
    model.load_state_dict(values, assign=True)
    assert_all_sharded(model)
    assert {n: p.placements for n, p in model.named_parameters()} == placements
    full_storages = {v.untyped_storage().data_ptr() for v in values.values()}
    for name, param in model.named_parameters():
        local = param.to_local()
        if local.numel():
            assert local.untyped_storage().data_ptr() not in full_storages, f"{name} keeps the full tensor alive"
    assert_equal_to(model, reference)
    # FSDP still trains the assigned parameters: one step matches the unsharded step.
    x = torch.arange(4).reshape(2, 2) % 7
    one_step(model, x, fabric)
    one_step(reference, x)
    return assert_equal_to(model, reference)


@case
def one_training_step_after_a_load_matches_one_process():
    fabric, reference, model = reference_and_sharded(Odd)
    values = other_values(Odd)
    reference.load_state_dict(values)
    model.load_state_dict(values)
    x = torch.tensor([[0, 3, 6], [5, 1, 2]])
    # The same batch on both ranks, so the averaged gradient is the single-process one.
    loss, ref_loss = one_step(model, x, fabric), one_step(reference, x)
    assert loss == ref_loss, (loss, ref_loss)
    return assert_equal_to(model, reference)


@case
def load_after_a_grad_free_forward_is_not_lost():
    # SHARD_GRAD_OP keeps units gathered after forward; a forward under no_grad, then a load, then a forward.
    fabric, reference, model = reference_and_sharded(Odd, "SHARD_GRAD_OP")
    x = torch.tensor([[0, 3, 6]])
    with torch.no_grad():
        model(x)
    values = other_values(Odd)
    reference.load_state_dict(values)
    model.load_state_dict(values)
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))
    return assert_equal_to(model, reference)


@case
def shard_grad_op_and_no_shard():
    shapes = {}
    for sharding in ("SHARD_GRAD_OP", "NO_SHARD"):
        _, reference, model = reference_and_sharded(Odd, sharding)
        values = other_values(Odd)
        reference.load_state_dict(values)
        model.load_state_dict(values)
        assert_equal_to(model, reference)
        shapes[sharding] = tuple(model.module.proj.weight.to_local().shape)
    assert shapes["NO_SHARD"] == (7, 5), shapes
    return shapes


@case
def load_raw_of_a_full_file_strict():
    fabric, reference, model = reference_and_sharded(Odd)
    path = shared_tmpdir(fabric) / "odd.pth"
    values = other_values(Odd)
    if fabric.global_rank == 0:
        torch.save(values, path)
    fabric.barrier()
    reference.load_state_dict(values)
    fabric.load_raw(path, model)
    return assert_equal_to(model, reference)


@case
def load_of_a_full_checkpoint_with_optimizer():
    fabric, reference, model = reference_and_sharded(Odd)
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
    path = shared_tmpdir(fabric) / "odd-full.ckpt"
    values = other_values(Odd)
    if fabric.global_rank == 0:
        torch.save({"model": values, "step": 3}, path)
    fabric.barrier()
    reference.load_state_dict(values)
    remainder = fabric.load(path, {"model": model}, strict=False)
    assert remainder == {"step": 3}, remainder
    del optimizer
    return assert_equal_to(model, reference)


def saved_by_rank0(fabric, values, name):
    path = shared_tmpdir(fabric) / name
    if fabric.global_rank == 0:
        torch.save(values, path)
    fabric.barrier()
    return path


@case
def load_raw_strict_through_hooks_is_judged_as_torch_judges_it():
    # Renamed entries fill the module, so torch's strict load accepts the file; the names alone would not match.
    fabric, reference, model = reference_and_sharded(Remapped)
    base = built(lambda: nn.Linear(4, 4), seed=1).state_dict()
    reference.load_state_dict(base, strict=True)
    fabric.load_raw(saved_by_rank0(fabric, base, "base.pth"), model, strict=True)
    assert_equal_to(model, reference)
    # One entry short: torch's strict load reports the missing key, here on every rank.
    del base["bias"]
    fresh = fabric.setup(built(Remapped))
    try:
        fabric.load_raw(saved_by_rank0(fabric, base, "short.pth"), fresh, strict=True)
    except RuntimeError as err:
        message = str(err)
    else:
        raise AssertionError("a strict load of a file without 'bias' passed")
    assert "linear.bias" in message and "strict=False" in message, message
    return same_on_every_rank(message.split("HINT")[0])


@case
def load_raw_through_a_reshaping_hook():
    fabric, reference, model = reference_and_sharded(Flattened)
    values = other_values(Flattened)
    values["proj.weight"] = values["proj.weight"].reshape(-1)
    reference.load_state_dict(values)
    fabric.load_raw(saved_by_rank0(fabric, values, "flat.pth"), model)
    return assert_equal_to(model, reference)


@case
def bf16_parameters_offloaded_to_the_host():
    # Parameters in bf16 ("bf16-true") and offloaded: the fp32 full tensors are cast as torch casts them.
    fabric = make_fabric(WORLD, precision="bf16-true", cpu_offload=True)
    with fabric.init_module():
        model = built(Odd)
    model = fabric.setup(model)
    reference = built(Odd).to(torch.bfloat16)
    values = other_values(Odd)
    reference.load_state_dict(values)
    model.load_state_dict(values)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    return assert_equal_to(model, reference)


# ------------------------------------------------------------------------------------------------- Trainer


def lit_module():
    from lightning.pytorch import LightningModule

    class LitOdd(LightningModule):
        def __init__(self):
            super().__init__()
            self.model = None

        def configure_model(self):
            if self.model is None:
                self.model = built(Odd)

        def validation_step(self, batch, batch_idx):
            self.model(batch)

    return LitOdd()


def set_up_by_trainer():
    module = lit_module()
    loader = torch.utils.data.DataLoader(torch.arange(12).reshape(4, 3) % 7, batch_size=2)
    make_trainer(strategy()).validate(module, loader, verbose=False)
    return module


@case
def trainer_lightning_module_load_state_dict():
    module = set_up_by_trainer()
    reference = built(Odd)
    values = {f"model.{k}": v for k, v in other_values(Odd).items()}
    reference.load_state_dict({k[len("model."):]: v for k, v in values.items()})
    result = module.load_state_dict(values)
    assert keys_of(result) == ([], []), result
    return assert_equal_to(module.model, reference)


@case
def trainer_strict_false_result_object():
    module = set_up_by_trainer()
    reference = built(Odd)
    values = other_values(Odd)
    del values["embed.weight"]
    values["stray"] = torch.zeros(1)
    expected = keys_of(reference.load_state_dict(dict(values), strict=False))
    prefixed = {f"model.{k}": v for k, v in values.items()}
    got = keys_of(module.load_state_dict(prefixed, strict=False))
    assert got == ([f"model.{k}" for k in expected[0]], [f"model.{k}" for k in expected[1]]), (got, expected)
    return assert_equal_to(module.model, reference)


@case
def trainer_strategy_load_model_state_dict():
    module = set_up_by_trainer()
    reference = built(Odd)
    values = other_values(Odd)
    reference.load_state_dict(values)
    module.trainer.strategy.load_model_state_dict({"state_dict": {f"model.{k}": v for k, v in values.items()}})
    return assert_equal_to(module.model, reference)


if __name__ == "__main__":
    run_cases()
