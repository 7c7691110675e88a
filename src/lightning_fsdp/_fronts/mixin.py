"""What both fronts' strategy classes share that is about Lightning's strategy API rather than about FSDP.

The engine (:mod:`lightning_fsdp.engine.core`) knows nothing of Lightning. The two fronts subclass Lightning's two
unrelated ``ParallelStrategy`` classes, which name many members alike; :class:`FrontMixin` answers those once, and
:func:`config_arguments` passes each front's constructor arguments to :class:`~lightning_fsdp.engine.config.FSDPConfig`
without either front listing them twice.
"""

from __future__ import annotations

import inspect
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Callable, Optional, TypeVar

import torch
from torch.distributed.device_mesh import DeviceMesh

from lightning_fsdp._base.secrets import StorageOptions, mask_secrets
from lightning_fsdp._fronts.registry import register_into
from lightning_fsdp.checkpoint.io.transfers import check_transfers, set_transfers
from lightning_fsdp.checkpoint.io.urls import check_storage_options
from lightning_fsdp.engine.config import FSDPConfig, check_fsdp1_kwargs
from lightning_fsdp.engine.core import FSDPEngine
from lightning_fsdp.engine.fault_tolerance.data import replica_sampler_kwargs
from lightning_fsdp.engine.fault_tolerance.group import ReplicaGroup

__all__ = ["FrontMixin", "config_arguments"]

T = TypeVar("T")


class FrontMixin:
    """What both fronts' strategy classes answer the same way, mixed in before Lightning's base class.

    Lightning's Fabric and Trainer ``ParallelStrategy`` classes are separate, but they name these members alike
    (``parallel_devices``, ``local_rank``, ``num_nodes``, ``cluster_environment``, ...), so one definition here
    serves both fronts and no Lightning import is needed. A front sets ``_engine`` and ``_launcher_class``.
    """

    _engine: FSDPEngine
    _launcher_class: type
    _background_saves: Any  # `checkpoint.AsyncSaves`

    @property
    def config(self) -> FSDPConfig:
        return self._engine.config

    @property
    def device_mesh(self) -> DeviceMesh:
        return self._engine.mesh

    @property
    def process_group_backend(self) -> Optional[str]:
        return self._engine.process_group_backend

    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Every rank is a data-parallel rank, the replicas of a hybrid mesh included; under tensor parallelism the
        # ranks of one group are one data-parallel rank, and must see the same batch.
        tp = self._engine.config.tensor_parallel.size
        size, rank = self.num_nodes * self.num_processes // tp, self.global_rank // tp
        ft = self._engine.config.fault_tolerance
        if ft is None:
            return {"num_replicas": size, "rank": rank}
        # Under fault tolerance the data is cut for every rank of every group; an absent group's share is skipped.
        return replica_sampler_kwargs(ft.replica_id, ft.num_replica_groups, rank, size)  # type: ignore[arg-type]

    # --- fault tolerance (see `_fronts/replica.py`) ---------------------------------------------------------------

    _replica_group: Optional[ReplicaGroup] = None

    @property
    def replica_group(self) -> Optional[ReplicaGroup]:
        """This group's part in fault tolerance (``fault_tolerance=...``), once the model is set up; else None.
        ``replica_group.current_step`` counts the steps the groups committed."""
        return self._replica_group

    def _aborting(self) -> AbstractContextManager:
        """Around a backward: a step that a dead peer group aborted ends here (see `ReplicaGroup.aborting`)."""
        return self._replica_group.aborting() if self._replica_group is not None else nullcontext()

    def _writes_checkpoints(self) -> bool:
        """Whether this group writes checkpoints: without fault tolerance always; with it, only the group ranked 0
        in the latest quorum (every group holds the same state, so one copy is written, the others skip)."""
        group = self._replica_group
        return group is None or group.participating_rank() == 0

    def _close_replica_group(self) -> None:
        group, self._replica_group = self._replica_group, None
        if group is not None:
            group.close()

    @property
    def checkpoint_io(self) -> Any:
        raise NotImplementedError(
            f"`{type(self).__name__}` writes checkpoints itself (DCP or one full file) and has no `CheckpointIO`. HINT: remove the"
            " `CheckpointIO` plugin from `plugins=`; the strategy saves with `save_checkpoint` itself."
        )

    @checkpoint_io.setter
    def checkpoint_io(self, io: Any) -> None:
        raise NotImplementedError(
            f"`{type(self).__name__}` does not accept a `CheckpointIO` plugin. HINT: remove it from `plugins=[...]`."
        )

    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = self._launcher_class(self.cluster_environment, self.num_processes, self.num_nodes)

    def _storage_options(self, storage_options: Optional[Any], method: str = "save_checkpoint") -> Optional[dict[str, Any]]:
        """The fsspec options of a save, load or removal: the call's own (``method``'s ``storage_options``), else the
        strategy's. Used for checkpoint URLs only (``s3://...``); a local path ignores them."""
        # Every save, load and removal sets this strategy's transfer sizes first (`part_size`, ...: one setting per
        # process, read by the upload sinks and ranged reads; two strategies in one process each move bytes with
        # their own). A strategy given none leaves the process's setting as it is.
        given = self._engine.config.transfer_arguments
        if given:
            set_transfers(check_transfers(**given))
        if storage_options is None:
            return self._engine.config.storage_options_dict
        return check_storage_options(storage_options, f"{type(self).__name__}.{method}(..., storage_options)")

    @property
    def communicator(self) -> FSDPEngine:
        """The collectives that saves and loads agree through (see :mod:`lightning_fsdp.checkpoint.integrity.agreement`)."""
        return self._engine

    def wait_for_saves(self) -> None:
        """Block until a background save (``async_save=True``) is committed, raising its error on every rank; call
        it on every rank. An emergency save must be on disk before the process exits."""
        self._background_saves.wait(self._engine)

    def after_commit(self, action: Callable[[], Any], what: str) -> None:
        """Run ``action`` on this rank once the background save in flight, if any, is committed (at once when none
        is; never if it fails). Retention prunes through this, so it never counts a save that is still being
        written, and leaves exactly ``keep_last`` once every save is committed. An error of ``action`` is raised
        on every rank by the next ``wait_for_saves``, save or load, naming ``what``."""
        self._background_saves.after_commit(action, what)

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        self._engine.barrier()

    def broadcast(self, obj: T, src: int = 0) -> T:
        return self._engine.broadcast(obj, src)

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        register_into(strategy_registry, cls)


def _register_storage_options_with_jsonargparse() -> None:
    """Make LightningCLI's config dump (``config.yaml``, ``--print_config``, a logger's ``config``) mask the
    credentials in ``storage_options``: the strategies annotate the argument as ``StorageOptions``, and jsonargparse
    writes a registered type through its serializer. Parsing is unchanged (a YAML mapping stays a dict), and a masked
    value read back is refused by the config with a hint (``secrets.refuse_masked``). Without jsonargparse there is
    no LightningCLI, and nothing to register."""
    try:
        from jsonargparse.typing import register_type
    except ImportError:
        return
    register_type(StorageOptions, serializer=mask_secrets, deserializer=StorageOptions,
                  type_check=lambda value, _: isinstance(value, dict))


_register_storage_options_with_jsonargparse()


def config_arguments(arguments: dict[str, Any]) -> dict[str, Any]:
    """The entries of a front's constructor ``locals()`` that :meth:`FSDPConfig.from_arguments` takes, after checking
    its ``**kwargs`` (FSDP1 keywords warn, anything else is a ``TypeError``).

    Both fronts name their arguments as ``from_arguments`` does, so this passes them on without either front listing
    them a second time, and a new argument reaches both fronts' validation the same way. Call it from the front's
    ``__init__`` itself: warnings point at the frame that called ``__init__``.
    """
    check_fsdp1_kwargs(arguments.get("kwargs", {}))
    names = inspect.signature(FSDPConfig.from_arguments).parameters
    return {name: value for name, value in arguments.items() if name in names}
