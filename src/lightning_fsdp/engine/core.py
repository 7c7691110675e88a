"""The engine: everything the Fabric and Trainer fronts share, and nothing that knows either front.

A front owns one :class:`FSDPEngine`. It forwards Lightning's hooks to it: ``setup_distributed`` from
``setup_environment``, ``setup_module`` and ``setup_optimizer`` from the setup hooks, and so on. The engine in turn
calls the owners of each concept: :mod:`~lightning_fsdp.engine.mesh`, :mod:`~lightning_fsdp.engine.sharding`,
:mod:`~lightning_fsdp.engine.grads` and :mod:`~lightning_fsdp.checkpoint`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from datetime import timedelta
from typing import Any, Optional, TypeVar, Union

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.nn import Module
from torch.optim import Optimizer

from lightning_fsdp._base.failures import explain_collective_failure
from lightning_fsdp.engine import at_rest, full_state_load, grads, sharding
from lightning_fsdp.engine.config import FSDPConfig
from lightning_fsdp.engine.mesh import ClusterInfo, build_mesh, default_backend, init_process_group

__all__ = ["FSDPEngine"]

T = TypeVar("T")


class FSDPEngine:
    """Holds the validated config, the mesh and the device once processes are up."""

    def __init__(self, config: FSDPConfig, process_group_backend: Optional[str], timeout: Optional[timedelta]):
        self.config = config
        self.process_group_backend = process_group_backend
        self.timeout = timeout
        self._mesh: Optional[DeviceMesh] = None
        self.device = torch.device("cpu")
        self.global_rank = 0
        self.world_size = 1
        self.last_summary = ""
        # Weak: a notebook or a sweep sets up model after model with one strategy and drops each; the strategy must
        # not keep them alive. Each model's owner tables live on the model itself (`_owner_tables`).
        self._models = at_rest.ModelSet()
        self._no_sync_depth = 0

    # --- process group and mesh -------------------------------------------------------------------------

    @property
    def mesh(self) -> DeviceMesh:
        if self._mesh is None:
            raise RuntimeError(
                "The device mesh does not exist before the processes are set up. HINT: use the strategy's mesh only"
                " after launch (Fabric: after `fabric.launch()`; Trainer: from `configure_model` on)."
            )
        return self._mesh

    def setup_distributed(self, cluster: ClusterInfo, device: torch.device, num_nodes: int) -> None:
        self.device = device
        self.global_rank = cluster.global_rank()
        self.world_size = cluster.world_size()
        self.process_group_backend = self.process_group_backend or default_backend(device)
        init_process_group(cluster, self.process_group_backend, device, self.timeout)
        self._mesh = build_mesh(self.config, device, self.world_size, num_nodes)

    # --- model and optimizers -----------------------------------------------------------------------------

    def setup_module(
        self,
        module: Module,
        mp_policy: Optional[MixedPrecisionPolicy],
        optimizers: Sequence[Optimizer] = (),
        *,
        harness: bool = False,
    ) -> Module:
        """Shard ``module`` in place and point ``optimizers`` (created before setup) at the sharded parameters.

        ``mp_policy`` is what the precision setting implies; the strategy's own ``mixed_precision`` overrides it.
        ``harness=True``: ``module``'s own forward need not run, its code calls submodules (a LightningModule); see
        :func:`lightning_fsdp.engine.sharding.shard_model`.
        """
        _owner_tables(module).append(sharding.ParameterOwners(module))
        mp_policy = self.config.mixed_precision or mp_policy
        result = sharding.shard_model(module, self.config, self.mesh, self.device, mp_policy, harness=harness)
        self._models.add(module)
        # `module.load_state_dict(full)` and full checkpoints then cut each full tensor to this rank's shard.
        full_state_load.accept_full_tensors(module)
        at_rest.reshard_after_grad_free_forwards(module, result.roots)
        _move_metrics_to_device(module, self.device)
        for optimizer in optimizers:
            self.setup_optimizer(optimizer)
        self.last_summary = f"FSDP units: {result.summary} on mesh {_mesh_summary(self.mesh)}"
        return module

    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """Separate setup. An optimizer built before its model was set up is remapped like in joint setup; one that
        holds parameters of no set-up model is refused, since it would train nothing."""
        models = self._models()
        sharding.remap_optimizer(optimizer, [table for model in models for table in _owner_tables(model)], models)
        at_rest.reshard_before_steps(optimizer, self._models)
        return optimizer

    @contextmanager
    def no_backward_sync(self, module: Module, enabled: bool) -> Iterator[None]:
        # Only the outermost block switches communication off and on again, so nested blocks (a loop inside a
        # helper that also accumulates) do not turn sync back on early.
        if not enabled or self._no_sync_depth:
            self._no_sync_depth += enabled
            try:
                yield
            finally:
                self._no_sync_depth -= enabled
            return
        reduce_scatter_only = (
            self.config.hybrid_no_sync == "reduce_scatter_only" and self.config.sharding_strategy.is_hybrid
        )
        self._no_sync_depth += 1
        try:
            with sharding.no_backward_sync(module, reduce_scatter_only):
                yield
        finally:
            self._no_sync_depth -= 1

    # Static: the Trainer clips from its precision plugin, which has no handle on the strategy. A failed collective
    # is then explained with the timeout the process group was created with, the same one the engine holds.

    @staticmethod
    def clip_gradients_norm(optimizer: Optimizer, max_norm: float, norm_type: float, error_if_nonfinite: bool) -> Tensor:
        with explain_collective_failure("gradient clipping"):
            return grads.clip_grad_norm(_params(optimizer), max_norm, norm_type, error_if_nonfinite)

    @staticmethod
    def clip_gradients_value(optimizer: Optimizer, clip_val: float) -> None:
        grads.clip_grad_value(_params(optimizer), clip_val)

    # --- collectives ----------------------------------------------------------------------------------------

    def guard(self, phase: str) -> AbstractContextManager:
        """Re-raise a failed collective inside the block with the rank, the likely cause and the timeout."""
        return explain_collective_failure(phase)

    def all_reduce(self, tensor: Any, group: Optional[Any] = None, reduce_op: Optional[Union[str, Any]] = "mean") -> Any:
        if not isinstance(tensor, Tensor) or not _distributed():
            return tensor
        op = _reduce_op(reduce_op)
        mean = op is None
        # gloo has no AVG: sum, then divide. The result stays in the tensor passed in, as with Lightning's own
        # strategies; integer tensors cannot hold a mean, so they are promoted to a new float tensor first.
        if mean and not tensor.is_floating_point():
            tensor = tensor.to(torch.get_default_dtype())
        with self.guard("all_reduce"):
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM if mean else op, group=group)
        if mean:
            tensor.div_(dist.get_world_size(group))
        return tensor

    def barrier(self) -> None:
        if not _distributed():
            return
        with self.guard("barrier"):
            if dist.get_backend() == "nccl":
                dist.barrier(device_ids=[self.device.index])
            else:
                dist.barrier()

    def agree(self, error: Optional[Any]) -> Optional[tuple[int, Any]]:
        """Share each rank's error (or ``None``) and return ``(rank, error)`` for the first rank that had one,
        identically on every rank, so a failure seen by one rank (a corrupted shard only it reads, a failed write) is
        raised by all instead of leaving the others waiting in the next collective."""
        if not _distributed():
            return None if error is None else (self.global_rank, error)
        errors: list[Optional[Any]] = [None] * dist.get_world_size()
        with self.guard("agreement on errors"):
            dist.all_gather_object(errors, error)
        return next(((r, e) for r, e in enumerate(errors) if e is not None), None)

    def broadcast(self, obj: T, src: int = 0) -> T:
        if not _distributed():
            return obj
        box = [obj]
        with self.guard("broadcast"):
            dist.broadcast_object_list(box, src)
        return box[0]


class _OwnerTables(list):
    """The :class:`~lightning_fsdp.engine.sharding.ParameterOwners` of each setup of one model, kept on the model
    itself, not in the engine: a table holds the model's modules, so an engine-held table kept every model it ever set
    up alive. A copy of the model (``copy.deepcopy``, pickling) gets an empty one: its parameters are new objects,
    which no table of the original names."""

    def __deepcopy__(self, memo: dict) -> "_OwnerTables":
        return _OwnerTables()

    def __reduce__(self) -> tuple:
        return _OwnerTables, ()


_OWNER_TABLES = "_lightning_fsdp_owner_tables"


def _owner_tables(module: Module) -> _OwnerTables:
    tables = module.__dict__.get(_OWNER_TABLES)
    if tables is None:
        tables = module.__dict__[_OWNER_TABLES] = _OwnerTables()
    return tables


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN, "product": dist.ReduceOp.PRODUCT}


def _reduce_op(reduce_op: Any) -> Optional[Any]:
    """``None`` stands for the mean; anything else is a ``dist.ReduceOp``."""
    if reduce_op is None:
        return dist.ReduceOp.SUM
    if isinstance(reduce_op, str):
        name = reduce_op.lower()
        if name in ("mean", "avg"):
            return None
        if name in _OPS:
            return _OPS[name]
        raise ValueError(
            f"Invalid `reduce_op={reduce_op!r}`. Allowed: 'mean', 'sum', 'max', 'min', 'product' or a"
            " torch.distributed.ReduceOp. HINT: use e.g. `fabric.all_reduce(x, reduce_op='sum')`."
        )
    if reduce_op == dist.ReduceOp.AVG:
        return None
    return reduce_op


def _params(optimizer: Optimizer) -> list[Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _move_metrics_to_device(module: Module, device: torch.device) -> None:
    """torchmetrics states are plain tensors outside the FSDP units; move them with the model."""
    try:
        from torchmetrics import Metric
    except ImportError:  # pragma: no cover - torchmetrics is a dependency, this only guards odd installs
        return
    for sub in module.modules():
        if isinstance(sub, Metric):
            sub.to(device)


def _mesh_summary(mesh: DeviceMesh) -> str:
    names = mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(mesh.ndim))
    return "(" + ", ".join(f"{n}={mesh.size(i)}" for i, n in enumerate(names)) + ")"
