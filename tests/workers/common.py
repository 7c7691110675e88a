"""Shared pieces of the worker scripts: building Fabric, the training step and the single-process reference."""

from __future__ import annotations

import copy
import tempfile
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from torch import nn
from torch.distributed.tensor import DTensor

from harness import TIMEOUT, assert_close
from lightning_fsdp.fabric import FSDPStrategy
from models import TinyTransformer, make_batch

VOCAB = 32


def make_fabric(devices: int, num_nodes: int = 1, precision: Any = None, plugins=None, **strategy_kwargs: Any) -> Fabric:
    strategy_kwargs.setdefault("timeout", TIMEOUT)
    fabric = Fabric(
        accelerator="cpu", devices=devices, num_nodes=num_nodes, precision=precision, plugins=plugins,
        strategy=FSDPStrategy(**strategy_kwargs),
    )
    fabric.launch()
    return fabric


def loss_fn(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    logits = model(batch[:, :-1])
    return F.cross_entropy(logits.reshape(-1, VOCAB).float(), batch[:, 1:].reshape(-1))


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters gathered to full tensors, under the model's clean names (the state-dict keys)."""
    return {k: full(v).detach().clone() for k, v in model.state_dict().items()}


def unit_states(model: nn.Module) -> dict[str, str]:
    """Per FSDP unit (by module name, ``""`` for the root): ``"sharded"`` when its own parameters are DTensor shards,
    ``"unsharded"`` when they are the gathered plain tensors FSDP2 swaps in between forward and backward."""
    from torch.distributed.fsdp import FSDPModule

    model = getattr(model, "module", model)  # Fabric's wrapper
    units = [n for n, m in model.named_modules() if isinstance(m, FSDPModule)]
    states: dict[str, set] = {}
    for name, p in model.named_parameters():
        owner = max((u for u in units if u == "" or name.startswith(u + ".")), key=len)
        states.setdefault(owner, set()).add("sharded" if isinstance(p, DTensor) else "unsharded")
    return {u: "+".join(sorted(s)) for u, s in states.items()}


def offload_policies(model: nn.Module) -> set[str]:
    """The offload policy each unit was built with. FSDP2 has no public getter; on CPU the parameters live in host
    memory either way, so the policy object is the only thing that tells whether `cpu_offload` was applied."""
    from torch.distributed.fsdp import FSDPModule

    model = getattr(model, "module", model)
    return {type(group.offload_policy).__name__ for m in model.modules() if isinstance(m, FSDPModule)
            for group in m._get_fsdp_state()._fsdp_param_groups}


class RecordingReduceScatter:
    """Installed with the public ``FSDPModule.set_custom_reduce_scatter``: records the dtype of every gradient
    reduce-scatter input, then runs FSDP2's default one."""

    def __new__(cls, seen: list):
        from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter

        class Recording(DefaultReduceScatter):
            def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
                seen.append(input_tensor.dtype)
                return super().__call__(output_tensor, input_tensor, group, op, async_op)

        return Recording()


def global_batch(step: int, world_size: int) -> torch.Tensor:
    return torch.cat([make_batch(step, r) for r in range(world_size)])


def reference_run(
    steps: int,
    world_size: int,
    make_optimizer: Callable[[nn.Module], torch.optim.Optimizer],
    seed: int = 0,
    autocast_dtype: Optional[torch.dtype] = None,
    max_norm: Optional[float] = None,
) -> tuple[nn.Module, list[float], list[float]]:
    """Single-process training on the concatenation of every rank's batch: what FSDP must reproduce."""
    torch.manual_seed(seed)
    model = TinyTransformer()
    opt = make_optimizer(model)
    losses, norms = [], []
    for step in range(steps):
        with torch.autocast("cpu", dtype=autocast_dtype, enabled=autocast_dtype is not None):
            loss = loss_fn(model, global_batch(step, world_size))
        loss.backward()
        if max_norm is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm).item())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return model, losses, norms


def sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def fsdp_run(
    fabric: Fabric, steps: int, make_optimizer=sgd, seed: int = 0, max_norm: Optional[float] = None
) -> tuple[nn.Module, list[float], list[float]]:
    """Train with the strategy; each rank sees its own batch. Returns the model and the global mean losses."""
    torch.manual_seed(seed)
    model = TinyTransformer()
    opt = make_optimizer(model)
    model, opt = fabric.setup(model, opt)
    losses, norms = [], []
    for step in range(steps):
        loss = loss_fn(model, make_batch(step, fabric.global_rank))
        fabric.backward(loss)
        if max_norm is not None:
            norms.append(fabric.clip_gradients(model, opt, max_norm=max_norm).item())
        opt.step()
        opt.zero_grad()
        losses.append(fabric.all_reduce(loss.detach(), reduce_op="mean").item())
    return model, losses, norms


def compare(model: nn.Module, reference: nn.Module, losses, ref_losses, atol: float) -> dict[str, float]:
    got = full_params(model)
    expected = reference.state_dict()
    assert sorted(got) == sorted(expected), f"state-dict keys differ: {sorted(set(got) ^ set(expected))}"
    param_diff = max((got[k] - expected[k]).abs().max().item() for k in expected)
    loss_diff = max(abs(a - b) for a, b in zip(losses, ref_losses))
    assert loss_diff <= atol, f"losses differ by {loss_diff:.3e} > {atol:.1e}: {losses} vs {ref_losses}"
    assert param_diff <= atol, f"parameters differ by {param_diff:.3e} > {atol:.1e}"
    # A run that trained nothing would match a reference that trained nothing; make sure both moved.
    torch.manual_seed(0)
    initial = TinyTransformer().state_dict()
    moved = max((expected[k] - initial[k]).abs().max().item() for k in expected)
    assert moved > 1e-3, f"the reference did not train (max change {moved:.3e})"
    return {"param_diff": param_diff, "loss_diff": loss_diff, "moved": moved}


def deepcopy_model(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model)


def model_and_reference(fabric: Fabric, make_optimizer=sgd):
    """The same initial model twice: one set up with the strategy, one plain, each with its optimizer."""
    torch.manual_seed(0)
    plain = TinyTransformer()
    model, opt = fabric.setup(plain, make_optimizer(plain))
    torch.manual_seed(0)
    reference = TinyTransformer()
    return model, opt, reference, make_optimizer(reference)


def max_param_diff(model: nn.Module, reference: nn.Module, atol: float, label: str = "") -> float:
    expected = reference.state_dict()
    return max(assert_close(full(v), expected[k], atol, f"{label}{k}") for k, v in model.state_dict().items())


def accumulate_three_micro_batches(fabric: Fabric, atol: float, label: str = "",
                                   around_backward: Optional[Callable[[], Any]] = None) -> float:
    """Two micro-batches under `no_backward_sync`, then a synced one, against the reference on the global batches.
    ``around_backward()``, if given, is a context manager entered around each micro-batch's backward."""
    model, opt, reference, ref_opt = model_and_reference(fabric)
    for micro in range(3):
        with fabric.no_backward_sync(model, enabled=micro < 2):
            with around_backward() if around_backward is not None else nullcontext():
                fabric.backward(loss_fn(model, make_batch(micro, fabric.global_rank)) / 3)
        # FSDP fills the sharded `.grad` only when it finishes a reduction, so inside the block it stays empty.
        communicated = [n for n, p in model.named_parameters() if p.grad is not None]
        assert bool(communicated) == (micro == 2), f"micro-batch {micro}: gradients on {communicated[:3]}"
        (loss_fn(reference, global_batch(micro, fabric.world_size)) / 3).backward()
    opt.step()
    opt.zero_grad()
    ref_opt.step()
    ref_opt.zero_grad()
    diff = max_param_diff(model, reference, atol, label)
    # Sync is back on after the block: one plain step still matches the reference.
    fabric.backward(loss_fn(model, make_batch(7, fabric.global_rank)))
    loss_fn(reference, global_batch(7, fabric.world_size)).backward()
    opt.step()
    ref_opt.step()
    return max(diff, max_param_diff(model, reference, atol, label))


def train_side_by_side(fabric: Fabric, model, opt, reference: nn.Module, ref_opt, steps: int,
                       between: Optional[Callable[[int], None]] = None) -> None:
    """``steps`` plain steps of the set-up model on each rank's batch and of the reference on the global batch;
    ``between(step)`` runs after the backward and before the step (a grad-free forward, say)."""
    for step in range(steps):
        fabric.backward(loss_fn(model, make_batch(step, fabric.global_rank)))
        if between is not None:
            between(step)
        opt.step()
        opt.zero_grad()
        loss_fn(reference, global_batch(step, fabric.world_size)).backward()
        ref_opt.step()
        ref_opt.zero_grad()


def shared_tmpdir(fabric: Fabric) -> Path:
    """A fresh temporary directory, rank 0's, the same path on every rank."""
    return Path(fabric.broadcast(tempfile.mkdtemp()))


def train_steps(fabric: Fabric, model: nn.Module, opt: torch.optim.Optimizer, steps: int, start: int = 0) -> None:
    """``steps`` plain training steps on the per-rank batches ``make_batch(step, rank)`` from step ``start``."""
    for step in range(start, start + steps):
        fabric.backward(loss_fn(model, make_batch(step, fabric.global_rank)))
        opt.step()
        opt.zero_grad()


def tensor_opt_state(opt: torch.optim.Optimizer) -> dict:
    """Every tensor of the optimizer's state, gathered in full and copied, keyed by (parameter index, name)."""
    return {(i, k): full(v).clone() for i, per_param in opt.state_dict()["state"].items()
            for k, v in per_param.items() if torch.is_tensor(v)}


def same_tensors(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def grad_free_forwards(loss: Callable[[nn.Module, torch.Tensor], torch.Tensor]) -> dict[str, Callable]:
    """The forwards without backward that users run between the backwards and the step, by name, each returning a
    tensor to compare with one process's: a ``no_grad`` loss, an ``inference_mode`` loss, a loss in ``eval()`` (which
    alone keeps autograd on: the output requires grad and nobody backpropagates it), and greedy decoding (one forward
    per token under ``no_grad``: many forwards, none with a backward). ``loss(model, batch)`` is the model's loss."""

    def no_grad(model, batch):
        with torch.no_grad():
            return loss(model, batch)

    def inference_mode(model, batch):
        with torch.inference_mode():
            return loss(model, batch).clone()

    def eval_mode(model, batch):
        model.eval()
        try:
            return loss(model, batch)
        finally:
            model.train()

    def generation(model, batch, new_tokens: int = 5):
        tokens = batch[:, :3]
        with torch.no_grad():
            for _ in range(new_tokens):
                tokens = torch.cat([tokens, model(tokens)[:, -1].argmax(-1, keepdim=True)], dim=1)
        return tokens.float()

    return {"no_grad": no_grad, "inference_mode": inference_mode, "eval_mode": eval_mode, "generation": generation}

