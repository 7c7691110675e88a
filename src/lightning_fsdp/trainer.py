"""The Trainer front: ``Trainer(strategy=FSDPStrategy(...))`` and ``trainer.strategy`` in LightningCLI YAML.

This module only maps the Lightning Trainer's strategy and precision hooks onto
:class:`~lightning_fsdp.engine.core.FSDPEngine` and :mod:`~lightning_fsdp.checkpoint`. Anything that is not about the
Trainer's API belongs in the engine, so the Fabric front can share it.

How the Trainer's pieces land on the engine:

- the LightningModule is sharded at ``setup`` as a *harness*: its ``training_step`` calls submodules, not its own
  ``forward``, so its top-level submodules become FSDP root units (see :func:`lightning_fsdp.engine.sharding.harness_roots`);
- gradient accumulation (``accumulate_grad_batches``, ``toggle_model(sync_grad=False)``) enters the engine's
  ``no_backward_sync`` through ``block_backward_sync``;
- gradient clipping, which Lightning routes through the precision plugin, uses the engine's sharded clipping;
- a checkpoint is Lightning's dict with sharded values: sharded saves write it as DCP keys ``model`` and
  ``optimizer_<i>`` plus ``meta.pt``, full saves stream it into one ``.ckpt`` file with the Trainer's usual keys.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Generator, Mapping
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from enum import Enum
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy
from torch.nn import Module
from torch.optim import Optimizer

from lightning_fsdp import averaging, checkpoint
from lightning_fsdp._base.compat import TrainerSubprocessScriptLauncher as _SubprocessScriptLauncher
from lightning_fsdp._base.errors import bad_argument
from lightning_fsdp._base.secrets import StorageOptions
from lightning_fsdp._fronts import fault_tolerance_loop, trainer_heal
from lightning_fsdp._fronts.mixin import FrontMixin, config_arguments
from lightning_fsdp._fronts.replica import (
    refuse_unsupported_layout,
    refuse_unsupported_precision,
    start_replica_group,
)
from lightning_fsdp._fronts.replica_checkpoint import restore_replica_state, with_replica_state
from lightning_fsdp.checkpoint.formats.lightning_layouts import (
    TRAINER_MODEL_KEY,
    TRAINER_OPTIMIZER_LIST_KEY,
    id_keyed_optimizer_state,
)
from lightning_fsdp.checkpoint.io.store import store_for
from lightning_fsdp.checkpoint.save import sharded_model_state, sharded_optimizer_state, write_full, write_sharded
from lightning_fsdp.checkpoint.state import holds_dtensors
from lightning_fsdp.engine.config import FSDPConfig
from lightning_fsdp.engine.fault_tolerance.config import FaultTolerance
from lightning_fsdp.engine.core import FSDPEngine
from lightning_fsdp.engine.meta_init import empty_init_context
from lightning_fsdp.engine.policy import PolicyInput
from lightning_fsdp.engine.precision import FSDPPrecision, as_fsdp_precision

__all__ = ["FSDPStrategy", "FSDPTrainerPrecision"]

_SHARDED_OPTIMIZER_KEY = "optimizer_{}"


def _sharded_extra(key: str) -> bool:
    """An entry that ``save_checkpoint`` wrote as shards beside the model and the optimizers because it held DTensors
    (a callback's state, a LightningModule's ``on_save_checkpoint`` extras): a load reads it whole, plain tensors as a
    full checkpoint holds them, for Lightning to restore (it was dropped). Not the model, the optimizers or the
    averaged weights, which would be a whole model's or optimizer's state on every rank."""
    own = key in ("model", TRAINER_MODEL_KEY, averaging.CURRENT_MODEL_KEY) or re.fullmatch(r"optimizer_\d+", key)
    return not own


class FSDPTrainerPrecision(FSDPPrecision, Precision):
    """:class:`~lightning_fsdp.engine.precision.FSDPPrecision` with the Trainer's hooks: the optimizer step runs Lightning's
    closure (and, under ``16-mixed``, unscales before clipping), and clipping works on sharded gradients.

    Lightning's own FSDP precision refuses ``gradient_clip_algorithm="norm"``; here both algorithms work.
    """

    def optimizer_step(  # type: ignore[override]
        self, optimizer: Optimizer, model: LightningModule, closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        group = fault_tolerance_loop.replica_group_of(getattr(model, "_trainer", None))
        if group is not None:
            return self._voted_step(group, optimizer, model, closure, **kwargs)
        scaler = self.scaler
        if scaler is None:
            return Precision.optimizer_step(self, optimizer, model=model, closure=closure, **kwargs)
        closure_result = closure()
        # An automatic step whose training_step returned None skipped backward: nothing to unscale or step.
        skipped = closure_result is None and model.automatic_optimization
        if not skipped:
            scaler.unscale_(optimizer)  # before `configure_gradient_clipping` sees the gradients
        self._after_closure(model, optimizer)
        if skipped:
            return closure_result
        step_output = scaler.step(optimizer, **kwargs)
        scaler.update()
        return step_output

    def _voted_step(self, group: Any, optimizer: Optimizer, model: LightningModule, closure: Callable[[], Any],
                    **kwargs: Any) -> Any:
        """Under fault tolerance: the window's last forward and backward, clipping (on the gradients the groups
        averaged in that backward), then the optimizer's step only if the groups' vote commits. The closure runs
        here, not inside ``optimizer.step``, because the vote must come between the two; an optimizer that calls
        its closure itself (LBFGS) is refused at setup. fp16's GradScaler is refused at setup too."""
        aborted = True
        with group.aborting():  # a peer group that died mid-backward ends the step here, reset
            closure_result = closure()
            aborted = False
        if aborted:
            fault_tolerance_loop.forget_closure_result(closure)
        elif closure_result is None and model.automatic_optimization:
            raise RuntimeError(
                "`training_step` returned None under fault_tolerance. Every rank of every replica group must run"
                " the step's backward, or the groups' cross-group average and vote never pair up. HINT: return the"
                " loss from every `training_step` (multiply it by 0 to make a batch count for nothing)."
            )
        else:
            self._after_closure(model, optimizer)  # on_before_optimizer_step and gradient clipping
        if not group.commit():
            for param_group in optimizer.param_groups:  # the window's gradients belong to a step not taken
                for param in param_group["params"]:
                    param.grad = None
            return None
        return optimizer.step(**kwargs)

    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: Union[int, float]) -> None:
        # Like torch's `clip_grad_norm_`, which Lightning calls for other strategies: a non-finite norm is no error
        # (under 16-mixed the scaler then skips the step).
        FSDPEngine.clip_gradients_norm(optimizer, float(clip_val), 2.0, error_if_nonfinite=False)

    def clip_grad_by_value(self, optimizer: Optimizer, clip_val: Union[int, float]) -> None:
        FSDPEngine.clip_gradients_value(optimizer, float(clip_val))


class FSDPStrategy(FrontMixin, ParallelStrategy):
    """Fully Sharded Data Parallel with torch's FSDP2 ``fully_shard``, for the Lightning Trainer.

    Accepts the arguments of Lightning's Trainer ``FSDPStrategy`` and gives them their FSDP2 meaning; they mean what
    they mean in :class:`lightning_fsdp.fabric.FSDPStrategy` (see there), and bad values raise the same errors.
    Differences from the Fabric front follow Lightning's Trainer ``FSDPStrategy``: the precision plugin is
    ``precision_plugin`` (usually set with ``Trainer(precision=...)``), ``checkpoint_io`` is accepted but only as
    ``None`` (checkpoints are written by DCP or the streaming full-file writer), and ``state_dict_type`` defaults to
    ``"full"``. The FSDP options after ``precision_plugin`` are keyword-only.

    What becomes an FSDP unit: the blocks ``auto_wrap_policy`` selects, and each top-level submodule of the
    LightningModule that holds parameters outside them (``self.model``, or ``self.generator`` and
    ``self.discriminator``). Those are root units that gather their parameters in their own forward, so the steps
    must call them, not only their children (or name the children in ``auto_wrap_policy``); a parameter that belongs
    to the LightningModule itself is refused with a hint, and so are two top-level models that share a module or a
    tied parameter (``encoder.embed is decoder.embed``): two roots cannot hold one parameter, so hold both in one
    module whose forward calls them (``self.model``), which becomes the one root over both, as under Fabric.

    In YAML (LightningCLI), write the policies as lists of dotted class names (``activation_checkpointing_policy``
    also as a mapping with ``blocks``, ``every`` and ``save_ops``), ``reshard_after_forward`` as a bool, an int or a
    mapping from ``root``, class names or module names to those, ``sharding_strategy`` as a string,
    ``device_mesh`` as a list and ``cpu_offload`` as a bool; set mixed precision with ``trainer.precision``. The
    annotations name those YAML forms first, and strings stay plain ``str``, so LightningCLI hands the values over
    unchanged and a bad one meets the same check, with the same message, as in Python.
    """

    _launcher_class = _SubprocessScriptLauncher
    strategy_name = "fsdp"

    def __init__(
        self,
        accelerator: Optional[Accelerator] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
        *,
        process_group_backend: Optional[str] = None,
        timeout: Optional[Union[float, timedelta]] = default_pg_timeout,
        cpu_offload: Optional[Union[bool, CPUOffloadPolicy]] = None,
        mixed_precision: Optional[MixedPrecisionPolicy] = None,
        auto_wrap_policy: Optional[Union[str, list[str], PolicyInput]] = None,
        activation_checkpointing: Optional[Any] = None,
        activation_checkpointing_policy: Optional[Union[str, list[str], dict[str, Any], PolicyInput]] = None,
        sharding_strategy: Union[str, Enum] = "FULL_SHARD",
        state_dict_type: str = "full",
        device_mesh: Optional[Union[list[int], tuple[int, int], DeviceMesh]] = None,
        reshard_after_forward: Optional[Union[bool, int, dict[str, Union[bool, int]]]] = None,
        hybrid_no_sync: str = "skip_all",
        async_save: bool = False,
        sync_module_states: Optional[bool] = None,
        param_init_fn: Optional[Union[str, Callable[[Module], None]]] = None,
        forward_prefetch: Union[int, bool] = 0,
        backward_prefetch: Union[int, str] = 1,
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
        if checkpoint_io is not None:
            self.checkpoint_io = checkpoint_io  # refused, with the reason
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, precision_plugin=precision_plugin)
        config = FSDPConfig.from_arguments(**config_arguments(locals()))
        self._engine = FSDPEngine(config, process_group_backend, config.timeout)
        self._background_saves = checkpoint.AsyncSaves()
        self._sharded: Optional[Module] = None
        self._restored_checkpoint: Optional[dict[str, Any]] = None  # what `load_checkpoint` last returned
        self._loop_position: Optional[trainer_heal.LoopPosition] = None  # fault tolerance: the loop's heal state
        self.num_nodes = 1

    # --- properties Lightning reads -----------------------------------------------------------------------

    @property
    def precision_plugin(self) -> FSDPTrainerPrecision:
        if not isinstance(self._precision_plugin, FSDPTrainerPrecision):
            self._precision_plugin = FSDPTrainerPrecision()  # kept, so its device type and scaler persist
        return self._precision_plugin

    @precision_plugin.setter
    def precision_plugin(self, precision_plugin: Optional[Precision]) -> None:
        # The connector hands over the plugin given to this strategy or one it built from `Trainer(precision=...)`.
        self._precision_plugin = as_fsdp_precision(precision_plugin, FSDPTrainerPrecision) if precision_plugin else None

    @property
    def is_distributed(self) -> bool:
        # Lightning asks this of strategies it does not know, e.g. to decide whether `self.log(sync_dist=True)` syncs.
        return True

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the sharded model and its optimizers must exist before a checkpoint is loaded into them

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False  # `load_checkpoint` restores the optimizers itself

    # --- lifecycle ------------------------------------------------------------------------------------------

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        assert self.cluster_environment is not None
        self.precision_plugin.set_device_type(self.root_device.type)
        self._engine.setup_distributed(self.cluster_environment, self.root_device, self.num_nodes)
        # `WeightAveraging.setup`, which runs next, warns that its copy of the model is not sharded; here it will be.
        warnings.filterwarnings("ignore", message=averaging.UNSHARDED_COPY_WARNING)
        assert self.lightning_module is not None
        averaging.refuse_copying_a_sharded_model(self.lightning_module.trainer, self.model, self._sharded)
        averaging.refuse_stochastic_weight_averaging(self.lightning_module.trainer)
        # `LightningModule.device_mesh` works in `configure_model`, as with Lightning's ModelParallelStrategy.
        self.lightning_module._device_mesh = self._engine.mesh

    def setup(self, trainer: Trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        self.model = self.precision_plugin.convert_module(self.model)
        mp_policy = self.precision_plugin.mixed_precision_policy()
        if self._sharded is not self.model:  # `fit` then `test` set the same model up twice
            self._engine.setup_module(self.model, mp_policy, harness=True)
            self._sharded = self.model
            rank_zero_info(self._engine.last_summary)
        # The copies `WeightAveraging` callbacks made of the model are sharded like it (see `averaging.py`).
        averaging.shard_averaged_copies(trainer, lambda copy: self._engine.setup_module(copy, mp_policy, harness=True))
        # FSDP2 cannot gather parameters in inference mode and train on them afterwards (torch refuses the in-place
        # update of an inference tensor), so evaluation runs under `no_grad`, as Lightning does for its own FSDP. The
        # loops already choose `no_grad` for any `FSDPStrategy`, ours included (see `dropin.py`); this keeps the
        # choice ours should a Lightning release change that branch.
        for loop in (trainer.fit_loop.epoch_loop.val_loop, trainer.validate_loop, trainer.test_loop, trainer.predict_loop):
            loop.inference_mode = False
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            if self.config.fault_tolerance is not None:
                self._join_replica_group(trainer)
        self.setup_precision_plugin()

    def _join_replica_group(self, trainer: Trainer) -> None:
        """Refuse what the groups' vote cannot gate, then join this rank's replica group (collective)."""
        ft = self.config.fault_tolerance
        module = self.lightning_module
        assert ft is not None and module is not None and self.model is not None
        if not module.automatic_optimization:
            raise ValueError(bad_argument(
                "fault_tolerance", ft, "a LightningModule with automatic optimization",
                "Set `self.automatic_optimization = True` and let the Trainer step the optimizer, or train with"
                " Fabric, where `optimizer.step()` returns the groups' vote (docs/guides/fault-tolerance.md).",
                problem="manual optimization steps the optimizer in `training_step`, where no vote can gate it",
            ))
        # Several optimizers need manual optimization, which Lightning itself refuses them without: one is left.
        (optimizer,) = self.optimizers
        if isinstance(optimizer, torch.optim.LBFGS):
            raise ValueError(bad_argument(
                "fault_tolerance", ft, "an optimizer that does not call its closure itself",
                "Use an optimizer whose step needs no closure (SGD, Adam, AdamW, ...), or turn fault_tolerance off.",
                problem="LBFGS re-runs the forward and backward inside its step, after the groups' vote",
            ))
        refuse_unsupported_precision(ft, self.precision_plugin)
        refuse_unsupported_layout(ft, self.config.sharding_strategy, self.world_size, self.config.tensor_parallel.size)
        fault_tolerance_loop.register()
        trainer_heal.register()
        # Kept across fits with its cursor (the data position); see `_fronts/trainer_heal.py` for the heal's design.
        if self._loop_position is None or self._loop_position.trainer is not trainer:
            self._loop_position = trainer_heal.LoopPosition(trainer)
        self._replica_group = self._new_replica_group(trainer)

    def _new_replica_group(self, trainer: Trainer) -> Any:
        assert self.config.fault_tolerance is not None and self.model is not None
        schedulers = [config.scheduler for config in trainer.lr_scheduler_configs]
        return start_replica_group(self.config.fault_tolerance, self.model, self.optimizers, device=self.root_device,
                                   schedulers=schedulers, extra=self._loop_position)

    def process_dataloader(self, dataloader: Any) -> Any:
        # Under fault tolerance the training loader reads through the cursor a heal positions (`trainer_heal.py`).
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if self._loop_position is not None and self.replica_group is not None and trainer is not None \
                and trainer.training:
            return self._loop_position.wrap_training_loader(dataloader)
        return dataloader

    def on_train_start(self) -> None:
        # The training loaders are set up, no batch is trained yet (the first window is already open: its batches
        # take no snapshot, so the refusal cannot wait for one).
        if self._loop_position is not None and self.replica_group is not None:
            self._loop_position.refuse_several_training_loaders()

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        # The window of an optimizer step opens at its first batch. `begin_window` does nothing while a window is
        # open, so calling it at every batch opens one per accumulation window, the epoch's last, shorter window
        # and a resumed mid-window run included, without repeating Lightning's arithmetic of where windows end.
        if self.replica_group is not None:
            # What a peer healing in this window receives: the state at the window's first batch, taken only when
            # a window opens (a live group that heals does so at its window's vote, and compares its own snapshot,
            # which must then be of that window's start too, with the sender's).
            if self._loop_position is not None and not self.replica_group.window_open:
                self._loop_position.snapshot(at_batch_start=True)
            self.replica_group.begin_window()

    def setup_optimizers(self, trainer: Trainer) -> None:
        # A second `fit` builds new optimizers on the sharded parameters; the previous ones point at nothing valid.
        self._reset_optimizers_and_schedulers()
        super().setup_optimizers(trainer)
        for optimizer in self.optimizers:
            self._engine.setup_optimizer(optimizer)

    def model_to_device(self) -> None:
        pass  # `fully_shard` places the shards on the mesh's device.

    @contextmanager
    def tensor_init_context(self, empty_init: Optional[bool] = None) -> Generator[None, None, None]:
        # With `empty_init=True` parameters are built on the meta device (buffers for real) and materialized in
        # `setup`, after sharding, so only local shards are ever allocated (see `meta_init.empty_init_context`).
        with empty_init_context() if empty_init else nullcontext(), self.precision_plugin.tensor_init_context():
            yield

    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        assert self.model is not None
        with self._engine.no_backward_sync(self.model, enabled=True):
            yield

    def teardown(self) -> None:
        self._background_saves.wait(self._engine)
        self._close_replica_group()  # this group leaves the quorum; a later `fit` joins again
        # Lightning's teardown would move the model to CPU and tear down a CheckpointIO this strategy does not use.
        self.precision_plugin.teardown()
        assert self.cluster_environment is not None and self.accelerator is not None
        self.cluster_environment.teardown()
        self.accelerator.teardown()

    # --- collectives -------------------------------------------------------------------------------------------

    def reduce(self, tensor: Union[Tensor, Any], group: Optional[Any] = None, reduce_op: Optional[Any] = "mean") -> Any:
        return self._engine.all_reduce(tensor, group=group, reduce_op=reduce_op)

    # --- checkpoints --------------------------------------------------------------------------------------------

    def lightning_module_state_dict(self) -> dict[str, Any]:
        # Sharded values on every rank; a full save gathers them one at a time while it writes.
        assert self.model is not None
        return sharded_model_state(self.model)

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        assert self.model is not None
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer.optimizer
        state = sharded_optimizer_state(self.model, optimizer)
        # A full checkpoint keys parameters by position, as `optimizer.state_dict()` does, so any Trainer strategy
        # (DDP included) resumes from it; a sharded one keeps the names DCP needs to reshard.
        return id_keyed_optimizer_state(state) if self.config.state_dict_type == "full" else state

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        # Lightning's restore passes back what `load_checkpoint` returned: the model was restored there (its
        # "state_dict", if any, is the live sharded state a weight-averaging callback reads). A state dict a caller
        # passes under "state_dict" (full tensors, say) loads through the module's own `load_state_dict`, which cuts
        # full tensors to shards (see `full_state_load`).
        if checkpoint is self._restored_checkpoint:
            self._restored_checkpoint = None
            return
        if TRAINER_MODEL_KEY in checkpoint:
            assert self.lightning_module is not None
            self.lightning_module.load_state_dict(checkpoint[TRAINER_MODEL_KEY], strict=strict)

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        pass  # `load_checkpoint` has restored the optimizers already.

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Union[str, Path], storage_options: Optional[Any] = None
    ) -> None:
        if not self._writes_checkpoints():  # fault tolerance: one group writes; the others hold the same state
            return
        checkpoint = with_replica_state(self._replica_group, checkpoint)  # torchft's step, for a whole-job restart
        storage_options = self._storage_options(storage_options)
        if self.config.state_dict_type == "full":
            self._background_saves.wait(self._engine)
            write_full(filepath, checkpoint, self._engine, storage_options=storage_options)
            return
        # Lightning's FSDP layout, which `lightning.pytorch.utilities.consolidate_checkpoint` reads.
        tensors = {"model": checkpoint.pop(TRAINER_MODEL_KEY)}
        for index, state in enumerate(checkpoint.pop(TRAINER_OPTIMIZER_LIST_KEY, [])):
            tensors[_SHARDED_OPTIMIZER_KEY.format(index)] = state
        # Other sharded entries (a weight-averaging callback's `current_model_state`) are written as shards too:
        # `meta.pt` is written by rank 0 alone and would keep only its own shard of them.
        for key in [k for k, v in checkpoint.items() if holds_dtensors(v)]:
            tensors[key] = checkpoint.pop(key)
        background = self._background_saves if self.config.async_save else None
        if background is None:
            self._background_saves.wait(self._engine)
        write_sharded(filepath, tensors, checkpoint, self._engine, background, storage_options=storage_options)

    def load_checkpoint(
        self, checkpoint_path: Union[str, Path], weights_only: Optional[bool] = None,
        storage_options: Optional[Any] = None,
    ) -> dict[str, Any]:
        # `storage_options` override the strategy's for this one load; the Trainer's own calls pass none.
        options = self._storage_options(storage_options, "load_checkpoint")
        assert self.model is not None and self.lightning_module is not None
        self._background_saves.wait(self._engine)
        trainer = self.lightning_module.trainer
        keys = set()
        if averaging.averaged_modules(trainer):
            keys = checkpoint.checkpoint_keys(checkpoint_path, weights_only=weights_only, comm=self._engine,
                                              storage_options=options)
        models, average, averaged = averaging.load_request(trainer, self.model, keys)
        state: dict[str, Any] = dict(models)
        if trainer.state.fn == TrainerFn.FITTING:
            state.update({_SHARDED_OPTIMIZER_KEY.format(i): opt for i, opt in enumerate(self.optimizers)})
        # A full file keeps the model under "state_dict" and the optimizers in the list "optimizer_states"; the loader
        # maps the keys asked for here onto either layout, and returns everything else for Lightning to restore.
        strict = self.lightning_module.strict_loading
        loaded = checkpoint.load_checkpoint(
            checkpoint_path, state, strict=strict, weights_only=weights_only, comm=self._engine,
            storage_options=options, read_whole=_sharded_extra,
        )
        # torchft's step; a checkpoint without it resumes torchft at its global_step, which the loop checks against.
        restore_replica_state(self._replica_group, loaded, checkpoint_path, fallback_step=loaded.get("global_step", 0))
        self._restored_checkpoint = averaging.complete_for_callback(loaded, self.model, average, averaged)
        return self._restored_checkpoint

    def remove_checkpoint(self, filepath: Union[str, Path]) -> None:
        # `ModelCheckpoint(save_top_k=...)` drops old checkpoints right after the save that supersedes them returns;
        # a background save is not written yet then, so the removal waits for its commit (see `checkpoint.in_flight`).
        if not self.is_global_zero or not self._writes_checkpoints():
            return
        # Through the store with the strategy's `storage_options`, as the checkpoint was saved (one built from the
        # environment alone may hold no credentials, or another endpoint).
        store = store_for(filepath, self._storage_options(None))
        self._background_saves.remove(store.target(filepath), store)
