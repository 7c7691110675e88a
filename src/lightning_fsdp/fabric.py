"""The Fabric front: ``Fabric(strategy=FSDPStrategy(...))``.

This class only maps Lightning Fabric's strategy hooks onto :class:`~lightning_fsdp.engine.core.FSDPEngine`. Anything
that is not about Fabric's API belongs in the engine, so the Trainer front can share it.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, ExitStack, nullcontext
from datetime import timedelta
from enum import Enum
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, Union

import torch
from lightning.fabric.accelerators import Accelerator
from lightning.fabric.plugins import ClusterEnvironment, Precision
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies.parallel import ParallelStrategy
from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_only
from lightning.fabric.utilities.seed import reset_seed
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy
from torch.nn import Module
from torch.optim import Optimizer

from lightning_fsdp import checkpoint
from lightning_fsdp._base.compat import BackwardSyncControl as _BackwardSyncControl, FABRIC_SETUP_TAKES_SCHEDULER
from lightning_fsdp._base.compat import FabricSubprocessScriptLauncher as _SubprocessScriptLauncher, Sharded as _Sharded
from lightning_fsdp._base.secrets import StorageOptions
from lightning_fsdp._fronts.mixin import FrontMixin, config_arguments
from lightning_fsdp._fronts.replica import (
    drop_gradients,
    refuse_second_setup,
    refuse_unsupported_layout,
    refuse_unsupported_precision,
    start_replica_group,
)
from lightning_fsdp._fronts.replica_checkpoint import restore_replica_state, with_replica_state
from lightning_fsdp.engine.config import FSDPConfig, HybridNoSync, MeshInput, ShardingInput, StateDictType
from lightning_fsdp.engine.fault_tolerance.config import FaultTolerance
from lightning_fsdp.engine.core import FSDPEngine
from lightning_fsdp.engine.meta_init import empty_init_context
from lightning_fsdp.engine.policy import PolicyInput
from lightning_fsdp.engine.precision import FSDPPrecision, PrecisionName, as_fsdp_precision

__all__ = ["FSDPStrategy"]


class FSDPStrategy(FrontMixin, ParallelStrategy, _Sharded):
    """Fully Sharded Data Parallel with torch's FSDP2 ``fully_shard``, for Lightning Fabric.

    Accepts the arguments of Lightning's Fabric ``FSDPStrategy`` and gives them their FSDP2 meaning.

    Args:
        accelerator: set by Fabric; rarely passed by hand.
        parallel_devices: set by Fabric; rarely passed by hand.
        cluster_environment: set by Fabric; rarely passed by hand.
        precision: a precision plugin or name (``"bf16-mixed"``, ...). Usually set with ``Fabric(precision=...)``;
            when given here, Lightning's connector uses it and ignores ``Fabric(precision=...)``.
        process_group_backend: ``"nccl"`` on CUDA and ``"gloo"`` on CPU unless given.
        timeout: how long a collective waits for a missing rank before failing: a ``timedelta`` or a number of
            seconds.
        cpu_offload: ``True`` or a ``CPUOffloadPolicy``: keep sharded parameters, gradients and optimizer state in
            host memory (pinned on CUDA).
        mixed_precision: a ``MixedPrecisionPolicy`` that overrides the one the precision setting implies.
        auto_wrap_policy: which modules become FSDP units; see :mod:`lightning_fsdp.engine.policy`. Default ``"auto"``.
        activation_checkpointing_policy: which modules recompute activations in backward; same policy language, or
            a dict for finer control: ``{"blocks": [Block], "every": 2}`` checkpoints every 2nd block (the 2nd, 4th,
            ... in module order); ``{"save_ops": "default"}`` is op-level selective checkpointing (the outputs of
            matmuls and attention are saved, pointwise ops recomputed), ``"save_ops"`` also takes a list of op
            names such as ``"torch.ops.aten.mm"``. See :mod:`lightning_fsdp.engine.activation_checkpointing`.
        activation_checkpointing: deprecated spelling of ``activation_checkpointing_policy``.
        sharding_strategy: ``FULL_SHARD``, ``SHARD_GRAD_OP``, ``NO_SHARD``, ``HYBRID_SHARD`` or
            ``_HYBRID_SHARD_ZERO2`` (any case), or torch's ``ShardingStrategy`` enum.
        state_dict_type: ``"sharded"`` (default; a DCP directory) or ``"full"`` (one file).
        device_mesh: ``(replicate, shard)`` sizes or a ``DeviceMesh``, for hybrid sharding.
            Default: ``(num_nodes, devices per node)``.
        reshard_after_forward: FSDP2's own switch; overrides what ``sharding_strategy`` implies. ``True``/``False``;
            an int ``k`` that divides the shard-axis size keeps a copy sharded over groups of ``k`` ranks after
            forward, so backward gathers within the group; or a dict per unit, keyed by ``"root"``, a module class
            (object, dotted path or bare name) or a module name (``"blocks.11"``), e.g. ``{"root": True, "Block":
            2}``; units not named follow ``sharding_strategy``. Keys are read at setup, against the model (a
            submodule name first), never imported at construction. See :mod:`lightning_fsdp.engine.resharding`.
        forward_prefetch: how many units ahead each unit starts the all-gather in forward. ``0`` (default) is
            FSDP2's own behaviour; ``True`` means 1. Units are assumed to run in module-tree order (a ``ModuleList``
            of blocks called in a loop); see :mod:`lightning_fsdp.engine.prefetch`.
        backward_prefetch: how many units ahead, in backward order, each unit starts the all-gather. ``1`` (default)
            is FSDP2's own behaviour, and FSDP1's ``BackwardPrefetch.BACKWARD_PRE``; FSDP2 cannot go lower.
        tensor_parallel_size: split the layers that ``tensor_parallel_plan`` names over groups of this many ranks
            (tensor parallelism inside FSDP): the mesh becomes ``(shard, tp)`` (``(replicate, shard, tp)`` for the
            hybrid strategies), FSDP shards over the data-parallel axes, and the ranks of one group must see the same
            batch (``fabric.setup_dataloaders`` does this; see the tensor-parallel guide). ``1`` (default): none.
        tensor_parallel_plan: what to split: a dict from module-name patterns to styles in Hugging Face's
            ``tp_plan`` format (``{"layers.*.self_attn.q_proj": "colwise", "layers.*.self_attn.o_proj":
            "rowwise"}``; styles ``"colwise"``, ``"rowwise"``, ``"colwise_rep"``, ``"rowwise_rep"`` and the other
            names of :data:`lightning_fsdp.engine.tensor_parallel.STYLES` (``"sequence_parallel"`` is refused), or
            torch ``ParallelStyle`` objects), ``"auto"`` (a Hugging Face model's own plan), or a callable
            ``(module, tp_mesh) -> None``. Checked against the model at setup, before any weight moves.
        hybrid_no_sync: what ``fabric.no_backward_sync`` skips under hybrid sharding: ``"skip_all"`` (default) skips
            every gradient collective; ``"reduce_scatter_only"`` still reduce-scatters inside each shard group, which
            keeps gradients sharded, and skips only the all-reduce across replicas.
        async_save: write sharded checkpoints in the background: ``save`` returns once the tensors are copied to host
            memory, and training continues while DCP writes. The next save, load or teardown waits for it and raises
            its error, if any. Ignored (with a warning) for ``state_dict_type="full"``.
        storage_options: keyword arguments for the fsspec filesystem of checkpoint URLs (``s3://``, ``gs://``,
            ``az://``, ...), e.g. ``{"endpoint_url": ...}``; credentials and endpoint otherwise come from the
            environment as each filesystem reads them. ``save_checkpoint(..., storage_options=...)`` and
            ``load_checkpoint(..., storage_options=...)`` (``fabric_load(..., storage_options=...)``) override it for
            one call. Keep credentials in the environment or a profile (``{"profile": "name"}``): values under
            secret-looking keys (``key``, ``secret``, ``token``, ...) are shown as ``***`` in the config's repr,
            errors and LightningCLI's config dump, and a ``***`` read back is refused.
        part_size: bytes per upload part when a rank streams its shard from memory to object storage (None: the
            default, 8 MiB; 5 MiB to 5 GiB). A rank's upload buffers hold at most
            ``(parts_in_flight + 1) * part_size``.
        parts_in_flight: upload parts sent at once per object (None: the default, 4).
        ranges_in_flight: ranged reads at once per rank during a load from object storage (None: the default, 4).
        range_size: the largest byte range one read asks for; neighbouring ranges merge up to it (None: the
            default, 8 MiB; a load holds at most about ``ranges_in_flight * range_size`` of bodies).
        fault_tolerance: per-step fault tolerance across replica groups (torchft): ``None`` (off), a
            :class:`lightning_fsdp.FaultTolerance` or a dict of its fields (``replica_id``, ``num_replica_groups``,
            ``lighthouse``, ``min_replicas``, the timeouts); ``replica_id`` defaults to ``$REPLICA_GROUP_ID``,
            ``num_replica_groups`` to ``$NUM_REPLICA_GROUPS``, ``lighthouse`` to ``$TORCHFT_LIGHTHOUSE``. Each group
            is a job of its own that shards with ``FULL_SHARD``; needs ``pip install 'lightning-fsdp[ft]'``. See the
            fault-tolerance guide.
        sync_module_states: every rank starts from rank 0's parameters and buffers (broadcast once at setup, before
            sharding), as with DDP. On unless ``False``: switch it off only when every rank builds identical weights.
            With ``empty_init=True`` only buffers are broadcast; parameters are initialized shard by shard.
        param_init_fn: how a model built with ``init_module(empty_init=True)`` is initialized after sharding. ``None``
            (default): as its own construction would (``reset_parameters()`` per module, then Hugging Face's
            ``_init_weights``); a tensor no initializer writes is an error. A callable ``fn(module)`` (or its dotted
            path): called instead on each module that owns meta tensors, whose parameters are then allocated DTensor
            shards to fill in place. ``"skip"``: allocate only, for weights loaded right after setup.
        **kwargs: FSDP1 keywords of Lightning's strategy (``use_orig_params``, ``limit_all_gathers``, ...) are
            accepted and ignored with a warning; anything else is a ``TypeError``.
    """

    _launcher_class = _SubprocessScriptLauncher

    def __init__(
        self,
        accelerator: Optional[Accelerator] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        precision: Optional[Union[Precision, PrecisionName]] = None,
        process_group_backend: Optional[str] = None,
        timeout: Optional[Union[float, timedelta]] = default_pg_timeout,
        cpu_offload: Union[bool, CPUOffloadPolicy, None] = None,
        mixed_precision: Optional[MixedPrecisionPolicy] = None,
        auto_wrap_policy: Optional[PolicyInput] = None,
        activation_checkpointing: Optional[Any] = None,
        activation_checkpointing_policy: Optional[Union[PolicyInput, dict[str, Any]]] = None,
        sharding_strategy: ShardingInput = "FULL_SHARD",
        state_dict_type: StateDictType = "sharded",
        device_mesh: Optional[MeshInput] = None,
        reshard_after_forward: Optional[Union[bool, int, dict[str, Union[bool, int]]]] = None,
        hybrid_no_sync: HybridNoSync = "skip_all",
        async_save: bool = False,
        sync_module_states: Optional[bool] = None,
        param_init_fn: Optional[Union[str, Callable[[Module], None]]] = None,
        forward_prefetch: Union[int, bool] = 0,
        backward_prefetch: Union[int, str, Enum] = 1,
        tensor_parallel_size: int = 1,
        tensor_parallel_plan: Optional[Union[str, dict[str, str], Callable[[Module, DeviceMesh], None]]] = None,
        storage_options: Optional[StorageOptions] = None,  # any dict; the type masks secrets in dumps
        part_size: Optional[int] = None,
        parts_in_flight: Optional[int] = None,
        ranges_in_flight: Optional[int] = None,
        range_size: Optional[int] = None,
        fault_tolerance: Optional[Union[dict[str, Any], FaultTolerance]] = None,
        **kwargs: Any,
    ) -> None:
        config = FSDPConfig.from_arguments(**config_arguments(locals()))
        own_precision = FSDPPrecision(precision) if isinstance(precision, (str, int)) else precision
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            precision=own_precision,
        )
        self._engine = FSDPEngine(config, process_group_backend, config.timeout)
        self._num_nodes = 1
        self._backward_sync_control = _EngineBackwardSyncControl(self._engine)
        self._background_saves = checkpoint.AsyncSaves()

    # --- properties Lightning reads -----------------------------------------------------------------------

    @property
    def precision(self) -> FSDPPrecision:
        return self._precision if isinstance(self._precision, FSDPPrecision) else FSDPPrecision()

    @precision.setter
    def precision(self, precision: Optional[Precision]) -> None:
        # Lightning's connector hands over either the plugin given to this strategy or one it built from
        # `Fabric(precision=...)`; both are translated to their FSDP2 meaning.
        self._precision = as_fsdp_precision(precision) if precision is not None else None

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    # --- lifecycle ------------------------------------------------------------------------------------------

    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()
        assert self.cluster_environment is not None
        self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
        self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank
        self.precision.set_device_type(self.root_device.type)
        self._engine.setup_distributed(self.cluster_environment, self.root_device, self.num_nodes)

    def setup_module_and_optimizers(
        self, module: Module, optimizers: list[Optimizer], scheduler: Optional[Any] = None
    ) -> tuple:
        module = self._setup(module, optimizers, [scheduler] if scheduler is not None else [])
        # Lightning 2.5's `Fabric.setup` unpacks (module, optimizers); 2.6 also passes and unpacks the scheduler.
        return (module, optimizers, scheduler) if FABRIC_SETUP_TAKES_SCHEDULER else (module, optimizers)

    def setup_module(self, module: Module) -> Module:
        return self._setup(module, [])

    def _setup(self, module: Module, optimizers: list[Optimizer], schedulers: Sequence[Any] = ()) -> Module:
        ft = self.config.fault_tolerance
        if ft is not None:
            refuse_second_setup(ft, self._replica_group, optimizers)
            refuse_unsupported_precision(ft, self.precision)
            refuse_unsupported_layout(ft, self.config.sharding_strategy, self.world_size,
                                      self.config.tensor_parallel.size)
        module = self._engine.setup_module(module, self.precision.mixed_precision_policy(), optimizers)
        rank_zero_info(self._engine.last_summary)
        if ft is not None:
            # The scheduler given to `fabric.setup` (Lightning 2.6) is healed with the rest.
            self._replica_group = start_replica_group(ft, module, optimizers, device=self.root_device,
                                                      schedulers=schedulers)
        return module

    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        if self.config.fault_tolerance is not None:
            refuse_second_setup(self.config.fault_tolerance, object(), [optimizer])
        return self._engine.setup_optimizer(optimizer)

    def module_to_device(self, module: Module) -> None:
        pass  # `fully_shard` places the shards on the mesh's device.

    def module_init_context(self, empty_init: Optional[bool] = None) -> AbstractContextManager:
        stack = ExitStack()
        if empty_init:
            # Parameters on meta, buffers real; materialized in `setup_module`, after sharding, so only local shards
            # are ever allocated (see `meta_init.empty_init_context`).
            stack.enter_context(empty_init_context())
        stack.enter_context(self.precision.module_init_context())
        return stack

    def module_sharded_context(self) -> AbstractContextManager:
        # FSDP2 shards at setup, not at construction; `empty_init=True` is the memory-saving path.
        return nullcontext()

    def teardown(self) -> None:
        self._background_saves.wait(self._engine)
        self._close_replica_group()
        # Lightning's teardown also tears down `checkpoint_io`, which this strategy does not have.
        self.precision.teardown()
        if self.accelerator is not None:
            self.accelerator.teardown()
        if self.cluster_environment is not None:
            self.cluster_environment.teardown()

    # --- training-step helpers ------------------------------------------------------------------------------

    def backward(self, tensor: Tensor, module: Optional[Module], *args: Any, **kwargs: Any) -> None:
        with self._engine.guard("backward"), self._aborting():
            super().backward(tensor, module, *args, **kwargs)

    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        """The optimizer's step. Under fault tolerance, the step runs only when the replica groups' vote commits,
        and the vote is returned (``if optimizer.step(): scheduler.step()``); a step that does not commit drops the
        window's gradients."""
        group = self._replica_group
        if group is not None and not group.commit():
            drop_gradients(optimizer)
            return False
        with self._engine.guard("optimizer step"):
            result = super().optimizer_step(optimizer, **kwargs)
        return True if group is not None else result

    def clip_gradients_norm(
        self,
        module: Module,
        optimizer: Optimizer,
        max_norm: Union[float, int],
        norm_type: Union[float, int] = 2.0,
        error_if_nonfinite: bool = True,
    ) -> Tensor:
        self.precision.unscale_gradients(optimizer)
        return self._engine.clip_gradients_norm(optimizer, float(max_norm), float(norm_type), error_if_nonfinite)

    def clip_gradients_value(self, module: Module, optimizer: Optimizer, clip_val: Union[float, int]) -> None:
        self.precision.unscale_gradients(optimizer)
        self._engine.clip_gradients_value(optimizer, float(clip_val))

    def all_reduce(self, tensor: Tensor, group: Optional[Any] = None, reduce_op: Optional[Any] = "mean") -> Tensor:
        return self._engine.all_reduce(tensor, group=group, reduce_op=reduce_op)

    # --- checkpoints --------------------------------------------------------------------------------------

    def save_checkpoint(
        self,
        path: Union[str, Path],
        state: dict[str, Any],
        storage_options: Optional[Any] = None,
        filter: Optional[dict[str, Callable[[str, Any], bool]]] = None,
    ) -> None:
        if not self._writes_checkpoints():
            return
        storage_options = self._storage_options(storage_options)
        full = self.config.state_dict_type == "full"
        background = self._background_saves if self.config.async_save and not full else None
        if background is None:
            self._background_saves.wait(self._engine)
        # Under fault tolerance torchft's step goes with the state, so a whole-job restart resumes at it.
        state = with_replica_state(self._replica_group, state)
        checkpoint.save_checkpoint(path, state, full=full, comm=self._engine, filter=filter, background=background,
                                   storage_options=storage_options)

    def load_checkpoint(
        self,
        path: Union[str, Path],
        state: Optional[Union[Module, Optimizer, dict[str, Any]]] = None,
        strict: bool = True,
        weights_only: Optional[bool] = None,
        storage_options: Optional[Any] = None,
    ) -> dict[str, Any]:
        """Restore ``state`` from ``path``; ``storage_options`` override the strategy's for this one load (Lightning's
        ``fabric.load`` passes none: reach it with ``lightning_fsdp.fabric_load(..., storage_options=...)``)."""
        options = self._storage_options(storage_options, "load_checkpoint")
        if not state:
            raise ValueError(
                f"`{type(self).__name__}.load_checkpoint(..., state={state!r})` needs the objects to restore. HINT:"
                " pass them like so: `fabric.load(path, {'model': model, 'optimizer': optimizer})`."
            )
        self._background_saves.wait(self._engine)
        remainder = checkpoint.load_checkpoint(path, state, strict=strict, weights_only=weights_only,
                                               comm=self._engine, storage_options=options)
        if isinstance(state, dict):  # a resume; a bare module (`fabric.load_raw`) leaves torchft's step alone
            restore_replica_state(self._replica_group, remainder, path)
        return remainder

class _EngineBackwardSyncControl(_BackwardSyncControl):
    def __init__(self, engine: FSDPEngine) -> None:
        self._engine = engine

    def no_backward_sync(self, module: Module, enabled: bool) -> AbstractContextManager:
        return self._engine.no_backward_sync(module, enabled)
