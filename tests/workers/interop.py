"""Two-rank interoperability with Lightning's own checkpoints, in both directions.

- Lightning writes, we read: every layout Lightning 2.6.6 writes for a sharded model is loaded with
  ``fabric.load(path, {"model": model, "optimizer": optimizer})`` into our strategy, and the full parameters and the
  full optimizer state must equal, exactly, what the writer held when it saved. The loading model starts from other
  weights and its optimizer from another learning rate and no state, so a load that skips anything fails.
  - Fabric's and the Trainer's ``ModelParallelStrategy`` (FSDP2) run here on CPU and write real checkpoints.
  - Lightning's ``FSDPStrategy`` is FSDP1 and refuses the CPU accelerator (the refusal is Lightning's: torch's FSDP1
    trains here on gloo, ``torchs_fsdp1_trains_on_cpu_gloo``), so its four layouts are built here the way its code
    writes them (file and line numbers cited at each builder), from a plain model and a plain optimizer.
- We write, Lightning reads: ``lightning.fabric.utilities.consolidate_checkpoint`` turns our sharded checkpoint into
  one file, as a function and as the command line tool.
"""

from __future__ import annotations

import copy
import os
import runpy
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from lightning.fabric import Fabric
from lightning.fabric.strategies import ModelParallelStrategy as FabricModelParallelStrategy
from lightning.fabric.wrappers import _unwrap_objects
from lightning.pytorch.strategies import ModelParallelStrategy as TrainerModelParallelStrategy
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import OptimStateKeyType, fully_shard
from torch.utils.data import DataLoader

from common import full, global_batch, loss_fn, make_fabric
from harness import TIMEOUT, case, run_cases
from models import TinyTransformer

WORLD = 2
LR = 0.0123  # the writers' learning rate; the loading optimizer starts with another one
STEPS = 2

# ---------------------------------------------------------------------------------------------------------------------
# Snapshots and the comparison


def snapshot(model, optimizer) -> dict[str, Any]:
    """Full parameters and full optimizer state (keyed by parameter name), the same on every rank."""
    model, optimizer = _unwrap_objects(model), _unwrap_objects(optimizer)  # what `fabric.save` hands the strategy
    options = StateDictOptions(full_state_dict=True)
    params = {k: full(v).detach().clone() for k, v in get_model_state_dict(model, options=options).items()}
    optim = copy.deepcopy(get_optimizer_state_dict(model, optimizer, options=options))
    return {"params": params, "optim": optim}


def plain_snapshot(model, optimizer) -> dict[str, Any]:
    """The same for an unsharded model and a plain optimizer."""
    return {"params": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "optim": copy.deepcopy(named_optimizer_state(model, optimizer))}


def assert_same_state(got: dict[str, Any], expected: dict[str, Any]) -> dict[str, Any]:
    params, ref = got["params"], expected["params"]
    assert sorted(params) == sorted(ref), f"parameter names differ: {sorted(set(params) ^ set(ref))}"
    differ = [k for k in ref if not torch.equal(params[k], ref[k])]
    assert not differ, f"parameters differ from the saved ones: {differ}"
    state, ref_state = got["optim"]["state"], expected["optim"]["state"]
    assert sorted(state) == sorted(ref_state), f"optimizer state names differ: {sorted(set(state) ^ set(ref_state))}"
    assert ref_state, "the writer's optimizer has no state; the comparison would prove nothing"
    for name, fields in ref_state.items():
        assert sorted(state[name]) == sorted(fields), f"{name}: fields {sorted(state[name])} != {sorted(fields)}"
        for field, value in fields.items():
            mine = full(state[name][field])
            assert torch.equal(torch.as_tensor(mine), torch.as_tensor(value)), f"optimizer state {name}.{field} differs"
    groups, ref_groups = got["optim"]["param_groups"], expected["optim"]["param_groups"]
    assert len(groups) == len(ref_groups), f"{len(groups)} param groups != {len(ref_groups)}"
    for mine, theirs in zip(groups, ref_groups):
        mine, theirs = _lists_for_tuples(mine), _lists_for_tuples(theirs)
        assert mine == theirs, f"param group differs: {mine} != {theirs}"
    return {"params": len(ref), "optimizer_states": len(ref_state), "lr": ref_groups[0]["lr"]}


def _lists_for_tuples(group: dict[str, Any]) -> dict[str, Any]:
    # Hyperparameters such as Adam's `betas` come back from some save/load paths as lists; the optimizer reads both.
    return {k: list(v) if isinstance(v, tuple) else v for k, v in group.items()}


def load_into_ours(path: Path, expected: dict[str, Any], leftover: dict[str, Any]) -> dict[str, Any]:
    """``fabric.load`` into our strategy, starting from other weights and a fresh optimizer, then compare; ``leftover``
    is some of what the load must return (the checkpoint's entries that were not requested)."""
    fabric = make_fabric(WORLD)
    torch.manual_seed(1)
    plain = TinyTransformer()
    model, optimizer = fabric.setup(plain, torch.optim.Adam(plain.parameters(), lr=0.5))
    remainder = fabric.load(path, {"model": model, "optimizer": optimizer})
    # What the checkpoint holds beyond the requested entries; the entries the model and optimizer came from are not.
    assert not {"model", "optimizer", "state_dict", "optimizer_states", "optimizer_0"} & set(remainder), sorted(remainder)
    remainder = {k: remainder.get(k, "<missing>") for k in leftover}
    assert remainder == leftover, f"the load returned {remainder}, expected {leftover}"
    loaded = snapshot(model, optimizer)
    report = assert_same_state(loaded, expected)
    # The loaded optimizer must also work: one more step changes every parameter.
    fabric.backward(loss_fn(model, global_batch(9, 1)))
    optimizer.step()
    stepped = snapshot(model, optimizer)["params"]
    unchanged = [k for k, v in loaded["params"].items() if torch.equal(v, stepped[k])]
    assert not unchanged, f"a step after the load left these parameters unchanged: {unchanged}"
    return {**report, "remainder": remainder}


def checkpoint_path(name: str) -> Path:
    """A fresh path in the launch's output folder, which every rank sees (one machine) and pytest cleans up."""
    root = Path(os.environ["LFSDP_TEST_OUT"]) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)  # on every rank: some writers below do not create parent folders
    return root / name


# ---------------------------------------------------------------------------------------------------------------------
# Lightning Fabric's ModelParallelStrategy (FSDP2, runs on CPU)


def fully_shard_blocks_and_root(model, device_mesh):
    # Fabric's ModelParallelStrategy hands parallelize_fn a 2-D mesh named ("data_parallel", "tensor_parallel")
    # (lightning/fabric/strategies/model_parallel.py `_setup_device_mesh`); FSDP runs on the first axis.
    mesh = device_mesh["data_parallel"]
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def fabric_model_parallel_checkpoint(distributed: bool) -> tuple[Path, dict[str, Any]]:
    strategy = FabricModelParallelStrategy(
        fully_shard_blocks_and_root, data_parallel_size=WORLD, tensor_parallel_size=1,
        save_distributed_checkpoint=distributed, timeout=TIMEOUT,
    )
    fabric = Fabric(accelerator="cpu", devices=WORLD, strategy=strategy)
    fabric.launch()
    torch.manual_seed(0)
    model = fabric.setup_module(TinyTransformer())
    optimizer = fabric.setup_optimizers(torch.optim.Adam(model.parameters(), lr=LR))  # after sharding: the traps
    for step in range(STEPS):
        fabric.backward(loss_fn(model, global_batch(step, 1)))
        optimizer.step()
        optimizer.zero_grad()
    path = checkpoint_path("fabric_model_parallel" + ("" if distributed else ".pt"))
    fabric.save(path, {"model": model, "optimizer": optimizer, "step": STEPS})
    return path, snapshot(model, optimizer)


@case
def fabric_model_parallel_sharded_checkpoint_loads():
    path, expected = fabric_model_parallel_checkpoint(distributed=True)
    assert (path / ".metadata").is_file() and (path / "meta.pt").is_file()
    return load_into_ours(path, expected, {"step": STEPS})


@case
def fabric_model_parallel_full_checkpoint_loads():
    path, expected = fabric_model_parallel_checkpoint(distributed=False)
    assert path.is_file()
    return load_into_ours(path, expected, {"step": STEPS})


# ---------------------------------------------------------------------------------------------------------------------
# The Trainer's ModelParallelStrategy (FSDP2, runs on CPU)


class LitTiny(L.LightningModule):
    """A LightningModule with TinyTransformer's parameter names (no ``model.`` prefix), so the Trainer's checkpoints
    load into a bare TinyTransformer: this file tests the layout, not name prefixes."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        inner = TinyTransformer()
        self.embed, self.pos, self.blocks, self.head = inner.embed, inner.pos, inner.blocks, inner.head

    def forward(self, idx):
        return TinyTransformer.forward(self, idx)

    def configure_model(self):
        fully_shard_blocks_and_root(self, self.device_mesh)

    def training_step(self, batch, batch_idx):
        return loss_fn(self, batch)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=LR)

    def on_train_end(self):
        self.snapshot = snapshot(self, self.trainer.optimizers[0])


def trainer_model_parallel_checkpoint(distributed: bool) -> tuple[Path, dict[str, Any]]:
    strategy = TrainerModelParallelStrategy(
        data_parallel_size=WORLD, tensor_parallel_size=1, save_distributed_checkpoint=distributed, timeout=TIMEOUT
    )
    trainer = L.Trainer(
        accelerator="cpu", devices=WORLD, strategy=strategy, max_steps=STEPS, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    module = LitTiny()
    data = DataLoader(list(global_batch(0, 2 * WORLD * STEPS)), batch_size=2)
    trainer.fit(module, data)
    path = checkpoint_path("trainer_model_parallel" + ("" if distributed else ".ckpt"))
    trainer.save_checkpoint(path)
    return path, module.snapshot


@case
def trainer_model_parallel_sharded_checkpoint_loads():
    path, expected = trainer_model_parallel_checkpoint(distributed=True)
    keys = {k.split(".", 1)[0] for k in dcp.FileSystemReader(path).read_metadata().state_dict_metadata}
    assert keys == {"state_dict", "optimizer_0"}, keys  # pytorch/strategies/model_parallel.py l. 317-320
    return load_into_ours(path, expected, {"global_step": STEPS})


@case
def trainer_model_parallel_full_checkpoint_loads():
    path, expected = trainer_model_parallel_checkpoint(distributed=False)
    contents = torch.load(path, weights_only=False)
    assert isinstance(contents["optimizer_states"], list) and "state_dict" in contents, sorted(contents)
    assert isinstance(next(iter(contents["optimizer_states"][0]["state"])), int)  # ids, model_parallel.py l. 290
    return load_into_ours(path, expected, {"global_step": STEPS})


# ---------------------------------------------------------------------------------------------------------------------
# Lightning's FSDPStrategy (FSDP1; Lightning refuses it on CPU, torch does not): its layouts built the way its code
# writes them.
#
# FSDP1 state dicts name parameters by their clean FQNs (FSDP strips its wrapper prefixes). With the default
# `use_orig_params=True` (fabric/strategies/fsdp.py l. 169, pytorch/strategies/fsdp.py l. 189):
# - `model.state_dict()` under the FULL context: plain full tensors; under the SHARDED context: ShardedTensors, which
#   DCP stores like any tensor (global shape, chunked), so plain tensors give the same DCP keys and shapes.
# - `FSDP.optim_state_dict(model, optim)`: {"state": {fqn: {"step", "exp_avg", ...}}, "param_groups": [{...,
#   "params": [fqn, ...]}]}, the param groups in the optimizer's order (torch/distributed/fsdp/_optim_utils.py
#   `_unflatten_param_groups`), full tensors under the FULL context, ShardedTensors under the SHARDED one.


@case
def torchs_fsdp1_trains_on_cpu_gloo():
    """The CPU refusal is Lightning's `FSDPStrategy`'s (`tests/test_registry.py`), not torch's: torch's own FSDP1,
    FULL_SHARD on these 2 gloo ranks, holds half the flat parameter on each rank and trains as one process does."""
    from torch.distributed.fsdp import ShardingStrategy as FSDP1ShardingStrategy

    make_fabric(WORLD)  # the process group
    torch.manual_seed(0)
    reference = TinyTransformer()
    torch.manual_seed(0)
    model = FSDP(TinyTransformer(), sharding_strategy=FSDP1ShardingStrategy.FULL_SHARD, device_id=torch.device("cpu"))
    total = sum(p.numel() for p in reference.parameters())
    local = sum(p.numel() for p in model.parameters())  # this rank's shard of the flat parameter (padded)
    assert total / WORLD <= local < total / WORLD + WORLD, (local, total)
    initial = [p.detach().clone() for p in reference.parameters()]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(STEPS):
        loss_fn(model, global_batch(step, WORLD).chunk(WORLD)[dist.get_rank()]).backward()
        optimizer.step()
        optimizer.zero_grad()
        loss_fn(reference, global_batch(step, WORLD)).backward()
        ref_optimizer.step()
        ref_optimizer.zero_grad()
    with FSDP.summon_full_params(model):
        got = [p.detach().clone() for p in model.parameters()]
    expected = list(reference.parameters())
    diff = max((a - b).abs().max().item() for a, b in zip(got, expected))
    moved = max((a - b).abs().max().item() for a, b in zip(expected, initial))
    assert len(got) == len(expected) and diff < 1e-5 < moved, (diff, moved)
    return {"shard": local, "parameters": total, "max_diff": diff, "moved": moved}


def trained_plain() -> tuple[TinyTransformer, torch.optim.Optimizer]:
    """An unsharded model and a plain optimizer, trained identically on every rank."""
    make_fabric(WORLD)  # the process group, for writing the checkpoint
    torch.manual_seed(0)
    model = TinyTransformer()
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    for step in range(STEPS):
        loss_fn(model, global_batch(step, WORLD)).backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def named_optimizer_state(model, optimizer) -> dict[str, Any]:
    """What `FSDP.optim_state_dict` returns: the optimizer's state dict with parameter names for ids."""
    names = {id(p): n for n, p in model.named_parameters()}
    order = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
    osd = optimizer.state_dict()
    return {
        "state": {order[i]: v for i, v in osd["state"].items()},
        "param_groups": [{**g, "params": [order[i] for i in g["params"]]} for g in osd["param_groups"]],
    }


def trainer_metadata() -> dict[str, Any]:
    # The other entries of `dump_checkpoint` (pytorch/trainer/connectors/checkpoint_connector.py l. 445-467).
    return {"epoch": 0, "global_step": STEPS, "pytorch-lightning_version": L.__version__,
            "loops": {"fit_loop": {"state_dict": {}}}, "callbacks": {}, "lr_schedulers": []}


def write_dcp(converted_state: dict[str, Any], metadata: dict[str, Any], path: Path) -> None:
    # `_distributed_checkpoint_save` (fabric/strategies/fsdp.py l. 860-867) is `dcp.save(state, checkpoint_id=path)`;
    # rank 0 then writes the rest to meta.pt.
    if dist.get_rank() == 0:
        path.mkdir(parents=True)
    dist.barrier()
    dcp.save(converted_state, checkpoint_id=path)
    if dist.get_rank() == 0:
        torch.save(metadata, path / "meta.pt")
    dist.barrier()


def write_file(contents: dict[str, Any], path: Path) -> None:
    if dist.get_rank() == 0:
        torch.save(contents, path)
    dist.barrier()


@case
def fsdp1_fabric_full_layout_loads():
    # fabric/strategies/fsdp.py l. 492-509: under the FULL context, every Module -> `obj.state_dict()`, every
    # Optimizer -> `FSDP.optim_state_dict(module, obj)` (names, NOT re-keyed), the rest as is; one dict, under the
    # user's keys, `torch.save`d by rank 0.
    model, optimizer = trained_plain()
    path = checkpoint_path("fsdp1_fabric_full.pt")
    write_file({"model": model.state_dict(), "optimizer": named_optimizer_state(model, optimizer), "step": STEPS}, path)
    return load_into_ours(path, plain_snapshot(model, optimizer), {"step": STEPS})


@case
def fsdp1_fabric_sharded_layout_loads():
    # fabric/strategies/fsdp.py l. 460-490: under the SHARDED context, Modules and Optimizers (converted as above)
    # under the user's keys go to `_distributed_checkpoint_save`; the rest to meta.pt by rank 0.
    model, optimizer = trained_plain()
    path = checkpoint_path("fsdp1_fabric_sharded")
    write_dcp({"model": model.state_dict(), "optimizer": named_optimizer_state(model, optimizer)}, {"step": STEPS}, path)
    return load_into_ours(path, plain_snapshot(model, optimizer), {"step": STEPS})


@case
def fsdp1_trainer_full_layout_loads():
    # pytorch/strategies/fsdp.py: `lightning_module_state_dict` (l. 505-515) is the full `model.state_dict()`;
    # `optimizer_state` (l. 533-540) re-keys `FSDP.optim_state_dict` to parameter ids on rank 0
    # (`FSDP.rekey_optim_state_dict(state_dict, OptimStateKeyType.PARAM_ID, self.model)`); `dump_checkpoint` puts them
    # under "state_dict" and the list "optimizer_states" (checkpoint_connector.py l. 449, 467); `save_checkpoint`
    # (l. 578-581) hands the dict to the CheckpointIO: `torch.save` on rank 0.
    model, optimizer = trained_plain()
    by_id = FSDP.rekey_optim_state_dict(named_optimizer_state(model, optimizer), OptimStateKeyType.PARAM_ID, model)
    path = checkpoint_path("fsdp1_trainer_full.ckpt")
    write_file({**trainer_metadata(), "state_dict": model.state_dict(), "optimizer_states": [by_id]}, path)
    return load_into_ours(path, plain_snapshot(model, optimizer), {"global_step": STEPS})


@case
def fsdp1_trainer_sharded_layout_loads():
    # pytorch/strategies/fsdp.py l. 562-577: {"model": checkpoint.pop("state_dict"), "optimizer_0": ...} (the
    # SHARDED `FSDP.optim_state_dict`, names, l. 530-532) go to `_distributed_checkpoint_save`; what remains of the
    # checkpoint dict goes to meta.pt.
    model, optimizer = trained_plain()
    path = checkpoint_path("fsdp1_trainer_sharded")
    write_dcp({"model": model.state_dict(), "optimizer_0": named_optimizer_state(model, optimizer)},
              trainer_metadata(), path)
    return load_into_ours(path, plain_snapshot(model, optimizer), {"global_step": STEPS})


# ---------------------------------------------------------------------------------------------------------------------
# We write, Lightning's consolidate_checkpoint reads


def our_sharded_checkpoint() -> tuple[Path, dict[str, Any]]:
    fabric = make_fabric(WORLD)
    torch.manual_seed(0)
    plain = TinyTransformer()
    model, optimizer = fabric.setup(plain, torch.optim.Adam(plain.parameters(), lr=LR))
    for step in range(STEPS):
        fabric.backward(loss_fn(model, global_batch(step, 1)))
        optimizer.step()
        optimizer.zero_grad()
    path = checkpoint_path("ours")
    fabric.save(path, {"model": model, "optimizer": optimizer, "step": STEPS})
    assert path.is_dir(), "the default state_dict_type should write a sharded checkpoint"
    return path, snapshot(model, optimizer)


def assert_consolidated(consolidated: dict[str, Any], expected: dict[str, Any]) -> None:
    assert consolidated["step"] == STEPS, sorted(consolidated)
    assert_same_state({"params": consolidated["model"], "optim": consolidated["optimizer"]}, expected)


@case
def consolidate_function_reads_our_sharded_checkpoint():
    from lightning.fabric.utilities.load import _load_distributed_checkpoint

    path, expected = our_sharded_checkpoint()
    assert_consolidated(_load_distributed_checkpoint(path), expected)
    return "equal"


@case
def consolidate_command_reads_our_sharded_checkpoint():
    path, expected = our_sharded_checkpoint()
    output = path.with_name("consolidated.pt")
    if dist.get_rank() == 0:
        # `python -m lightning.fabric.utilities.consolidate_checkpoint <dir> --output_file <file>`, run in this process
        # as `-m` runs it (its `__main__` block), which saves a second interpreter start-up.
        argv = sys.argv
        sys.argv = ["consolidate_checkpoint", str(path), "--output_file", str(output)]
        try:
            runpy.run_module("lightning.fabric.utilities.consolidate_checkpoint", run_name="__main__")
        except SystemExit as exit:  # how the command reports a folder it refuses
            raise AssertionError(f"the command refused {str(path)!r} (exit status {exit.code})") from exit
        finally:
            sys.argv = argv
        assert output.is_file(), "the command wrote nothing"
    dist.barrier()
    assert_consolidated(torch.load(output, weights_only=True), expected)
    # The consolidated file is a full checkpoint of our own layout: it loads back.
    return load_into_ours(output, expected, {"step": STEPS})


if __name__ == "__main__":
    run_cases()
