"""The names this package needs that torch and Lightning do not export publicly, and every difference between the
torch and Lightning releases it supports (torch 2.13 to 2.15, Lightning 2.5 to 2.6).

Keep every such import, private attribute name and version gate here, so an upgrade that moves one breaks exactly
one file. (Two families stay where they are used: ``nn.Module``'s ``_parameters``/``_buffers`` dicts, which torch
documents for module authors and every torch release keeps, and Lightning's own strategy hooks that our fronts
override as subclasses.)
"""

import inspect
from typing import Any

import torch
from lightning.fabric.strategies.strategy import Strategy as _FabricStrategy
from lightning.fabric import Fabric as _Fabric
from lightning.fabric.strategies.launchers.subprocess_script import (
    _SubprocessScriptLauncher as FabricSubprocessScriptLauncher,
)
from lightning.fabric.strategies.strategy import _BackwardSyncControl as BackwardSyncControl
from lightning.fabric.strategies.strategy import _Sharded as Sharded
from lightning.pytorch.strategies.launchers.subprocess_script import (
    _SubprocessScriptLauncher as TrainerSubprocessScriptLauncher,
)
from lightning_utilities.core.imports import compare_version

from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (  # torch has no public alias for these
    CheckpointImpl,
    CheckpointWrapper,
    checkpoint_wrapper,
)

# The classes of torch op objects (`torch.ops.aten.mm`, `torch.ops.aten.mm.default`): selective activation
# checkpointing takes ops from the user, by object or by name.
from torch._ops import OpOverload, OpOverloadPacket

# Lightning's helpers for precision plugins: casting floating-point tensors and setting the default dtype.
from lightning.fabric.plugins.precision.utils import _convert_fp_tensor as convert_fp_tensor
from lightning.fabric.plugins.precision.utils import _DtypeContextManager as DtypeContextManager

# Lightning's two accelerator connectors. Each refuses the FSDP strategy names unless the accelerator is CUDA, in
# `_check_strategy_and_fallback`, before it looks the name up in the registry (see `registry.py`).
from lightning.fabric.connector import _Connector as FabricConnector
from lightning.pytorch.trainer.connectors.accelerator_connector import _AcceleratorConnector as TrainerConnector

# torch's zip-archive writer, the functions its pickles name to rebuild a tensor, and its dtype -> storage-class
# table: used to write torch.save files one tensor at a time, in exactly the form torch.save gives them.
from torch._utils import _rebuild_tensor_v2 as rebuild_tensor
from torch._utils import _rebuild_tensor_v3 as rebuild_tensor_with_dtype
from torch.serialization import _open_zipfile_writer as open_zipfile_writer
from torch.storage import _dtype_to_storage_type_map, _new_dtypes

# DCP's record of where one item lives in a shard file (file, offset, length): its `.metadata` pickles it, so the
# allow-list unpickler must name it, and the checksum reader verifies one such slice at a time.
from torch.distributed.checkpoint.filesystem import _StorageInfo as DCPStorageInfo

# Where a DTensor's local shard starts in the global tensor: used to redo the one index write that init code does
# (zeroing an embedding's padding row), which DTensor indexing cannot carry through to the shard.
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset


def dtensor_around(local, like):
    """A DTensor that is ``like`` in every respect (mesh, placements, global shape and strides) but holds ``local``
    as its local tensor, wherever ``local`` lives. ``DTensor.from_local`` cannot do this: it moves a local tensor to
    the mesh's device type, so a host copy of a CUDA DTensor would become a second, separate CUDA copy. torch's own
    checkpoint stagers build such host DTensors the same way, through the private constructor and ``_spec``."""
    import copy

    from torch.distributed.tensor import DTensor

    # A state dict's values may require grad (`dict(model.named_parameters())`); the DTensor made here never does.
    return DTensor(local.detach(), copy.copy(like._spec), requires_grad=False)


def legacy_storage_type(dtype):
    """The legacy storage class (e.g. ``torch.FloatStorage``) that torch.save names in its pickled references to a
    tensor of ``dtype``, or None for the dtypes it writes as an untyped storage plus the dtype instead (the float8
    types, uint16/32/64, complex32: torch added no legacy class for them). KeyError for a dtype torch.save cannot
    write either (e.g. uint4)."""
    import torch

    if dtype in _new_dtypes():
        return None
    return getattr(torch, _dtype_to_storage_type_map()[dtype])


def meta_record_offset(storage):
    """Where in the archive it read ``torch.load(..., map_location="meta")`` found the record of a meta ``storage``
    (torch's private ``_checkpoint_offset``), or None: how a full checkpoint read by ranges tells which data record
    each meta tensor stands for, views and ties included (:mod:`lightning_fsdp.checkpoint.io.remote_full`)."""
    return getattr(storage, "_checkpoint_offset", None)


def planner_tools():
    """torch's fake process group store (importing its module registers the ``"fake"`` backend), fake tensors, FSDP2
    memory tracker, and the tracker's two peak states (forward, backward): what :mod:`lightning_fsdp.planner` plans
    with. Imported on first use, so ``import lightning_fsdp`` does not pay for them."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker, _FSDPModState
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore, FakeTensorMode, FSDPMemTracker, (_FSDPModState.PEAK_FW, _FSDPModState.PEAK_BW)


def tracker_total_key() -> str:
    """The key under which torch's memory tracker keeps a device's total in each snapshot (its ``_TOTAL_KEY``)."""
    from torch.distributed._tools.mem_tracker import _TOTAL_KEY

    return _TOTAL_KEY


def real_mesh_dispatch():
    """What the planner needs to keep a DeviceMesh's rank table real under fake tensors: torch's base class of dispatch
    modes, the context that steps outside the active ``FakeTensorMode``, and the mesh's rank table itself. Every
    DeviceMesh sliced, flattened or concatenated from one root shares the root's ``_rank_map`` (a small int tensor),
    and each new mesh finds this rank's coordinates in it with ``nonzero()`` (``DeviceMesh.__init__`` ->
    ``_compute_coordinates_from_mesh``), which fake tensors cannot run (see :mod:`lightning_fsdp.planner.real_mesh`)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.utils._python_dispatch import TorchDispatchMode

    return TorchDispatchMode, unset_fake_temporarily, lambda mesh: mesh._rank_map


def clear_dtensor_caches() -> None:
    """Empty DTensor's caches of sharding propagation and redistribution plans. Their keys hold DeviceMeshes, which
    compare equal by shape and ranks alone, and their values hold the meshes of the call that filled them, with the
    names of that call's process groups. The planner runs each plan on a fake process group of its own and destroys it
    after; without this, the next plan (or the real run after a plan) in the same process gets the destroyed group's
    meshes back from the cache, and its first collective fails: "Could not resolve the process group registered under
    the name 3"."""
    from torch.distributed.tensor import _redistribute, debug

    for clear in (getattr(debug, "_clear_sharding_prop_cache", None),
                  getattr(getattr(_redistribute, "_gen_transform_infos", None), "cache_clear", None),
                  getattr(_redistribute, "clear_redistribute_planner_cache", None)):
        if clear is not None:
            clear()


def data_dependent_errors() -> tuple[type[Exception], ...]:
    """What fake tensors raise for an operation whose result depends on the data they do not have: a Python value
    (``.item()``, ``if tensor:``) or an output shape (``nonzero()``, boolean masks). The planner names them."""
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException

    return DataDependentOutputException, DynamicOutputShapeException


# --- Version differences -----------------------------------------------------------------------------------------

# Lightning 2.6 added the `WeightAveraging` callback (and `EMAWeightAveraging`). On 2.5 no user can construct one, so
# the averaging support in `averaging.py` has nothing to find; it must only not fail to import.
try:
    from lightning.pytorch.callbacks import WeightAveraging
except ImportError:  # Lightning < 2.6
    WeightAveraging = None

# Lightning 2.6's `Fabric.setup` passes the scheduler to `Strategy.setup_module_and_optimizers` and unpacks three
# values (module, optimizers, scheduler); 2.5 passes two arguments and unpacks two. Read off the base class, not the
# version number, so a patch release that backports either form still works.
FABRIC_SETUP_TAKES_SCHEDULER = "scheduler" in inspect.signature(_FabricStrategy.setup_module_and_optimizers).parameters

# Lightning 2.6's `Fabric.load` has `weights_only` (the opt-in to full unpickling); 2.5's does not, so there the
# opt-in is reached through the strategy (`fabric_load.py`; see `weights_only_hint`).
FABRIC_LOAD_TAKES_WEIGHTS_ONLY = "weights_only" in inspect.signature(_Fabric.load).parameters


def weights_only_hint() -> str:
    """The call that opts a Fabric load into full unpickling, on the installed Lightning."""
    if FABRIC_LOAD_TAKES_WEIGHTS_ONLY:
        return "`fabric.load(path, state, weights_only=False)`"
    return ("`lightning_fsdp.fabric_load(fabric, path, state, weights_only=False)` (the `fabric.load` of Lightning"
            f" {lightning_version()} has no `weights_only`; Lightning 2.6's has)")


def lightning_version() -> str:
    import lightning

    return lightning.__version__


def lightning_at_least(version: str) -> bool:
    return compare_version("lightning", lambda have, want: have >= want, version)


# --- Private attributes and functions used by name ---------------------------------------------------------------

# `torch.amp.GradScaler`'s kernel: unscale a list of gradients in place and flag any inf/NaN (FSDPPrecision runs it
# on the local shards of DTensor gradients, which the public scaler cannot take).
amp_unscale_and_check_ = torch._amp_foreach_non_finite_check_and_unscale_

# What a DCP `.metadata` pickle names to rebuild a layout: `torch.serialization._get_layout`.
get_layout = torch.serialization._get_layout

# The globals a `torch.save` index (data.pkl) names to rebuild a tensor from its storage record.
TORCH_SAVE_REBUILD_TENSOR = (("torch._utils", "_rebuild_tensor_v2"), ("torch._utils", "_rebuild_tensor"))

# The named tuple `nn.Module.load_state_dict` returns (missing_keys, unexpected_keys); `full_state_load.py` returns
# the same type from a full-file load, so callers that read `.missing_keys` or print it see what torch gives.
IncompatibleKeys = torch.nn.modules.module._IncompatibleKeys

# DCP's `FileSystemReader` asks its private `_slice_file(file, storage_info)` for a readable view of one item's bytes;
# `checkpoint/integrity/sharded_read.py` overrides it to verify every item as DCP reads it.
DCP_READER_ITEM_VIEW = "_slice_file"


def checkpoint_wrapped_module(module):
    """The module inside torch's ``CheckpointWrapper`` (its private ``_checkpoint_wrapped_module``), or ``module``
    itself when it is not wrapped."""
    return getattr(module, "_checkpoint_wrapped_module", module)


def averaged_model(callback):
    """The ``AveragedModel`` a Lightning ``WeightAveraging`` callback keeps (its private ``_average_model``; created in
    the callback's ``setup``), or None."""
    return getattr(callback, "_average_model", None)


# Lightning's two accelerator connectors refuse the FSDP strategy names off CUDA in this private method (see
# `registry.py`, which wraps it).
CONNECTOR_STRATEGY_CHECK = "_check_strategy_and_fallback"

# Where the connectors choose the precision plugin (Lightning's FSDP1 plugin for an `FSDPStrategy`), and the two
# attributes that method reads on each: the plugin instance the user passed, and the precision name. `dropin.py`
# wraps the method so our strategy gets our plugin.
CONNECTOR_PRECISION_CHOICE = "_check_and_init_precision"
FABRIC_CONNECTOR_PRECISION_FLAGS = ("_precision_instance", "_precision_input")
TRAINER_CONNECTOR_PRECISION_FLAGS = ("_precision_plugin_flag", "_precision_flag")

# `Fabric.setup`'s checks, one of which refuses optimizers on meta-device parameters for an `FSDPStrategy`
# (`dropin.py` lifts it for ours).
FABRIC_SETUP_CHECK = "_validate_setup"


# The function both ThroughputMonitors (Fabric's utility, the Trainer's callback) ask for the FLOP dtype of a
# precision plugin; it knows only Lightning's own plugins, so `dropin.py` teaches it ours.
THROUGHPUT_COMPUTE_DTYPE = "_plugin_to_compute_dtype"


# Where the Trainer turns `ckpt_path="last"` into a path. It lists each ModelCheckpoint's dirpath with fsspec and
# then looks each name up on the local filesystem (the URL's protocol is dropped on the way), so the `last.ckpt` of a
# bucket is never found and nothing is loaded. `_fronts/last_checkpoint.py` wraps it to ask the checkpoint's store.
TRAINER_CKPT_PATH_PARSE = "_parse_ckpt_path"


# The two Trainer sites fault tolerance wraps (`_fronts/fault_tolerance_loop.py`): the automatic optimization's step,
# after which the loop counts the optimizer step (`trainer.global_step`), and the epoch loop's stepping of the LR
# schedulers. A step the replica groups did not commit must move neither.
TRAINER_OPTIMIZER_STEP = "_optimizer_step"
TRAINER_LR_SCHEDULERS_STEP = "update_lr_schedulers"


def trainer_step_sites() -> tuple[type, type]:
    """The classes that hold :data:`TRAINER_OPTIMIZER_STEP` and :data:`TRAINER_LR_SCHEDULERS_STEP`."""
    from lightning.pytorch.loops.optimization.automatic import _AutomaticOptimization
    from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop

    return _AutomaticOptimization, _TrainingEpochLoop


# The fit loop's `run`, which fault tolerance wraps (`_fronts/trainer_heal.py`): a replica group's first window opens,
# and a restarted group heals its loop position, before the loop builds its data iterator and resumes from its counters.
TRAINER_FIT_RUN = "run"


def trainer_fit_loop() -> type:
    """The class that holds :data:`TRAINER_FIT_RUN`."""
    from lightning.pytorch.loops.fit_loop import _FitLoop

    return _FitLoop


def trainer_checkpoint_connector() -> type:
    """The Trainer's checkpoint connector class, which holds :data:`TRAINER_CKPT_PATH_PARSE`."""
    from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector

    return _CheckpointConnector


def throughput_modules() -> tuple[Any, Any]:
    """The two modules that hold :data:`THROUGHPUT_COMPUTE_DTYPE`: Fabric's and the Trainer's."""
    from lightning.fabric.utilities import throughput
    from lightning.pytorch.callbacks import throughput_monitor

    return throughput, throughput_monitor


def _check_names() -> None:
    """Fail at import, in this file, when a torch or Lightning release drops a private name used only by name."""
    from torch.distributed.checkpoint import FileSystemReader

    fabric_throughput, trainer_throughput = throughput_modules()
    for owner, name in ((FileSystemReader, DCP_READER_ITEM_VIEW), (FabricConnector, CONNECTOR_STRATEGY_CHECK),
                        (TrainerConnector, CONNECTOR_STRATEGY_CHECK), (FabricConnector, CONNECTOR_PRECISION_CHOICE),
                        (TrainerConnector, CONNECTOR_PRECISION_CHOICE), (_Fabric, FABRIC_SETUP_CHECK),
                        (fabric_throughput, THROUGHPUT_COMPUTE_DTYPE), (trainer_throughput, THROUGHPUT_COMPUTE_DTYPE),
                        (trainer_checkpoint_connector(), TRAINER_CKPT_PATH_PARSE),
                        (trainer_step_sites()[0], TRAINER_OPTIMIZER_STEP),
                        (trainer_step_sites()[1], TRAINER_LR_SCHEDULERS_STEP),
                        (trainer_fit_loop(), TRAINER_FIT_RUN)):
        if not hasattr(owner, name):
            raise ImportError(
                f"lightning-fsdp needs `{getattr(owner, '__qualname__', owner.__name__)}.{name}`, which torch"
                f" {torch.__version__} / Lightning {lightning_version()} does not have. Supported: torch 2.13 to 2.15,"
                " Lightning 2.5 to 2.6. HINT: install a supported pair, e.g."
                " `pip install 'torch>=2.13,<2.16' 'lightning>=2.5,<2.7'`."
            )


_check_names()


__all__ = [
    "TRAINER_CKPT_PATH_PARSE",
    "trainer_checkpoint_connector",
    "TRAINER_OPTIMIZER_STEP",
    "TRAINER_LR_SCHEDULERS_STEP",
    "trainer_step_sites",
    "TRAINER_FIT_RUN",
    "trainer_fit_loop",
    "planner_tools",
    "FabricSubprocessScriptLauncher",
    "TrainerSubprocessScriptLauncher",
    "BackwardSyncControl",
    "Sharded",
    "WeightAveraging",
    "FABRIC_SETUP_TAKES_SCHEDULER",
    "FABRIC_LOAD_TAKES_WEIGHTS_ONLY",
    "weights_only_hint",
    "lightning_version",
    "lightning_at_least",
    "amp_unscale_and_check_",
    "get_layout",
    "IncompatibleKeys",
    "TORCH_SAVE_REBUILD_TENSOR",
    "DCP_READER_ITEM_VIEW",
    "checkpoint_wrapped_module",
    "averaged_model",
    "CONNECTOR_STRATEGY_CHECK",
    "CONNECTOR_PRECISION_CHOICE",
    "FABRIC_CONNECTOR_PRECISION_FLAGS",
    "TRAINER_CONNECTOR_PRECISION_FLAGS",
    "FABRIC_SETUP_CHECK",
    "THROUGHPUT_COMPUTE_DTYPE",
    "throughput_modules",
    "CheckpointImpl",
    "CheckpointWrapper",
    "checkpoint_wrapper",
    "OpOverload",
    "OpOverloadPacket",
    "convert_fp_tensor",
    "DtypeContextManager",
    "FabricConnector",
    "TrainerConnector",
    "legacy_storage_type",
    "meta_record_offset",
    "dtensor_around",
    "open_zipfile_writer",
    "rebuild_tensor",
    "rebuild_tensor_with_dtype",
    "DCPStorageInfo",
    "compute_local_shape_and_global_offset",
]
