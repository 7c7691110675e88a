"""Every user-facing strategy argument, validated and turned into torch objects in one place.

Both fronts (Fabric and Trainer) build an :class:`FSDPConfig` from their constructor arguments, so the two accept
the same values and raise the same errors. Nothing here needs a process group: checks that depend on the world size
live in :mod:`lightning_fsdp.engine.mesh` and run at setup.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from datetime import timedelta
from enum import Enum
from typing import Any, Literal, Optional, Union

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

from lightning_fsdp._base.errors import bad_argument
from lightning_fsdp._base.names import import_module_of
from lightning_fsdp._base.secrets import StorageOptions, hidden, refuse_masked
from lightning_fsdp.engine.activation_checkpointing import parse_checkpointing_policy
from lightning_fsdp.engine.fault_tolerance.config import FaultTolerance, FaultToleranceInput, parse_fault_tolerance
from lightning_fsdp.engine.meta_init import SKIP, ParamInitFn
from lightning_fsdp.engine.policy import Policy, PolicyInput, parse_policy
from lightning_fsdp.engine.prefetch import parse_backward_prefetch, parse_forward_prefetch
from lightning_fsdp.engine.tensor_parallel import PlanInput, TensorParallel, parse_tensor_parallel
from lightning_fsdp.engine.resharding import ReshardPlan, parse_reshard_after_forward

__all__ = [
    "FSDPConfig",
    "ShardingStrategy",
    "ShardingInput",
    "MeshInput",
    "HybridNoSync",
    "StateDictType",
    "check_fsdp1_kwargs",
    "check_transfer",
    "TRANSFER_LIMITS",
]


class ShardingStrategy(str, Enum):
    """The sharding strategies of Lightning's FSDP, with their FSDP2 meaning.

    ============================ ===================== ===============================
    strategy                     mesh                  parameters after forward
    ============================ ===================== ===============================
    ``FULL_SHARD``               1-D shard             resharded (the root keeps them)
    ``SHARD_GRAD_OP``            1-D shard             kept until backward
    ``NO_SHARD``                 (world, 1)            replicated everywhere (like DDP)
    ``HYBRID_SHARD``             (replicate, shard)    resharded
    ``_HYBRID_SHARD_ZERO2``      (replicate, shard)    kept until backward
    ============================ ===================== ===============================
    """

    FULL_SHARD = "FULL_SHARD"
    SHARD_GRAD_OP = "SHARD_GRAD_OP"
    NO_SHARD = "NO_SHARD"
    HYBRID_SHARD = "HYBRID_SHARD"
    _HYBRID_SHARD_ZERO2 = "_HYBRID_SHARD_ZERO2"

    @property
    def is_hybrid(self) -> bool:
        return self in (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2)

    @property
    def default_reshard_after_forward(self) -> Optional[bool]:
        # None lets FSDP2 choose: reshard every unit except the root, whose parameters backward needs at once.
        if self in (ShardingStrategy.FULL_SHARD, ShardingStrategy.HYBRID_SHARD):
            return None
        return False


ShardingInput = Union[str, ShardingStrategy, Enum]
MeshInput = Union[tuple[int, int], list[int], DeviceMesh]
HybridNoSync = Literal["skip_all", "reduce_scatter_only"]
StateDictType = Literal["sharded", "full"]

_SHARDING_ALLOWED = ", ".join(repr(s.value) for s in ShardingStrategy) + " (any case) or torch's ShardingStrategy enum"
_HYBRID_NO_SYNC_ALLOWED = ("skip_all", "reduce_scatter_only")
_STATE_DICT_ALLOWED = ("sharded", "full")


@dataclass(frozen=True)
class FSDPConfig:
    """The validated strategy configuration. Build it with :meth:`from_arguments`."""

    sharding_strategy: ShardingStrategy
    reshard_after_forward: Optional[Union[bool, int, ReshardPlan]]  # a ReshardPlan: per-unit choices
    offload_policy: OffloadPolicy
    mixed_precision: Optional[MixedPrecisionPolicy]
    auto_wrap_policy: Policy
    activation_checkpointing_policy: Optional[Policy]
    state_dict_type: StateDictType
    device_mesh: Optional[Union[tuple[int, int], DeviceMesh]]
    hybrid_no_sync: HybridNoSync
    async_save: bool
    sync_module_states: bool = True
    timeout: Optional[timedelta] = None  # None: the backend's default
    param_init_fn: ParamInitFn = None
    forward_prefetch: int = 0  # units ahead; 0: FSDP2's default (see `prefetch.py`)
    backward_prefetch: int = 1  # units ahead; 1: FSDP2's default
    tensor_parallel: TensorParallel = TensorParallel(1, None)  # see `tensor_parallel.py`
    # keyword arguments of the fsspec filesystem of checkpoint URLs (see `checkpoint/io/urls.py`); a StorageOptions,
    # whose repr masks credentials, so printing the config never shows them; out of the hash (a dict is not hashable)
    storage_options: Optional[StorageOptions] = field(default=None, hash=False)
    # sizes and windows of streamed transfers to and from object storage (see `checkpoint/io/transfers.py`);
    # None: the default there
    part_size: Optional[int] = None
    parts_in_flight: Optional[int] = None
    ranges_in_flight: Optional[int] = None
    range_size: Optional[int] = None
    fault_tolerance: Optional[FaultTolerance] = None  # see `fault_tolerance/config.py`; None: off

    @property
    def transfer_arguments(self) -> dict[str, int]:
        """The transfer settings the user gave (the others stay at their defaults)."""
        return {name: getattr(self, name) for name in TRANSFER_LIMITS if getattr(self, name) is not None}

    @property
    def storage_options_dict(self) -> Optional[dict[str, Any]]:
        """A plain copy for fsspec (which must get the real values, not a masking type)."""
        return None if self.storage_options is None else dict(self.storage_options)

    @property
    def cpu_offload(self) -> bool:
        return isinstance(self.offload_policy, CPUOffloadPolicy)

    @classmethod
    def from_arguments(
        cls,
        *,
        sharding_strategy: ShardingInput = "FULL_SHARD",
        reshard_after_forward: Optional[Union[bool, int, dict[Any, Union[bool, int]]]] = None,
        cpu_offload: Union[bool, CPUOffloadPolicy, None] = None,
        mixed_precision: Optional[MixedPrecisionPolicy] = None,
        auto_wrap_policy: Optional[PolicyInput] = None,
        activation_checkpointing_policy: Optional[PolicyInput] = None,
        activation_checkpointing: Optional[Any] = None,
        state_dict_type: str = "sharded",
        device_mesh: Optional[MeshInput] = None,
        hybrid_no_sync: str = "skip_all",
        async_save: bool = False,
        sync_module_states: Optional[bool] = None,
        timeout: Union[timedelta, float, None] = None,
        param_init_fn: Any = None,
        forward_prefetch: Union[int, bool, None] = 0,
        backward_prefetch: Any = 1,
        tensor_parallel_size: int = 1,
        tensor_parallel_plan: PlanInput = None,
        storage_options: Optional[dict[str, Any]] = None,
        part_size: Optional[int] = None,
        parts_in_flight: Optional[int] = None,
        ranges_in_flight: Optional[int] = None,
        range_size: Optional[int] = None,
        fault_tolerance: FaultToleranceInput = None,
    ) -> FSDPConfig:
        strategy = parse_sharding_strategy(sharding_strategy)
        tensor_parallel = parse_tensor_parallel(tensor_parallel_size, tensor_parallel_plan)
        if tensor_parallel.enabled and isinstance(device_mesh, DeviceMesh):
            raise ValueError(bad_argument(
                "device_mesh", device_mesh, "a (replicate, shard) shape when tensor_parallel_size is set",
                "Pass the data-parallel shape, e.g. `device_mesh=(2, 2)`, and `tensor_parallel_size`: the strategy"
                " builds the (replicate, shard, tp) mesh itself.",
                problem="A DeviceMesh object cannot be combined with tensor_parallel_size",
            ))
        return cls(
            sharding_strategy=strategy,
            reshard_after_forward=parse_reshard_after_forward(reshard_after_forward),
            offload_policy=_parse_cpu_offload(cpu_offload),
            mixed_precision=_parse_mixed_precision(mixed_precision),
            auto_wrap_policy=parse_policy("auto" if auto_wrap_policy is None else auto_wrap_policy, "auto_wrap_policy"),
            activation_checkpointing_policy=_parse_activation_checkpointing(
                activation_checkpointing_policy, activation_checkpointing
            ),
            state_dict_type=_parse_choice("state_dict_type", state_dict_type, _STATE_DICT_ALLOWED),
            device_mesh=_parse_device_mesh(device_mesh, strategy),
            hybrid_no_sync=_parse_hybrid_no_sync(hybrid_no_sync, strategy),
            async_save=_parse_async_save(async_save, state_dict_type),
            sync_module_states=_parse_sync_module_states(sync_module_states),
            timeout=parse_timeout(timeout),
            param_init_fn=_parse_param_init_fn(param_init_fn),
            forward_prefetch=parse_forward_prefetch(forward_prefetch),
            backward_prefetch=parse_backward_prefetch(backward_prefetch),
            tensor_parallel=tensor_parallel,
            storage_options=_parse_storage_options(storage_options),
            part_size=check_transfer("part_size", part_size),
            parts_in_flight=check_transfer("parts_in_flight", parts_in_flight),
            ranges_in_flight=check_transfer("ranges_in_flight", ranges_in_flight),
            range_size=check_transfer("range_size", range_size),
            fault_tolerance=parse_fault_tolerance(fault_tolerance, sharding_strategy=strategy),
        )


# Keyword arguments Lightning's FSDP1 strategy forwards to `FullyShardedDataParallel`. They have no FSDP2
# counterpart, or FSDP2 always behaves as they ask, so they are accepted (configs keep working) and ignored with a
# warning that says why.
_FSDP1_KWARGS = {
    "use_orig_params": "FSDP2 always keeps the original parameters",
    "limit_all_gathers": "FSDP2 bounds in-flight all-gathers by itself",
    "device_id": "the device comes from the accelerator",
    "ignored_states": "not supported by this strategy",
    "ignored_modules": "not supported by this strategy",
}


def check_fsdp1_kwargs(kwargs: dict[str, Any]) -> None:
    """Warn about FSDP1-only keyword arguments and refuse anything else unknown."""
    for key in kwargs:
        if key not in _FSDP1_KWARGS:
            raise TypeError(
                bad_argument(
                    key, kwargs[key],
                    "the documented arguments, plus these FSDP1 keywords (accepted and ignored): "
                    + ", ".join(sorted(_FSDP1_KWARGS)),
                    "Check the spelling against `help(FSDPStrategy)`.",
                    problem=f"`{key}` is not an argument of this strategy",
                )
            )
        warnings.warn(
            f"`{key}={kwargs[key]!r}` is an FSDP1 argument and is ignored: {_FSDP1_KWARGS[key]}.",
            UserWarning,
            stacklevel=4,
        )


def parse_sharding_strategy(value: Any) -> ShardingStrategy:
    if isinstance(value, ShardingStrategy):
        return value
    # torch's FSDP1 `ShardingStrategy` enum and any other enum are matched by member name.
    name = value.name if isinstance(value, Enum) else value
    if isinstance(name, str):
        for member in ShardingStrategy:
            if member.value.lower() == name.strip().lower():
                return member
        raise ValueError(
            bad_argument(
                "sharding_strategy", value, _SHARDING_ALLOWED,
                "Use one of the names above, e.g. `sharding_strategy='FULL_SHARD'`.",
            )
        )
    raise TypeError(
        bad_argument(
            "sharding_strategy", value, _SHARDING_ALLOWED,
            "Pass the strategy's name as a string, e.g. `sharding_strategy='HYBRID_SHARD'`.",
            problem=f"A value of type {type(value).__name__} is not a sharding strategy",
        )
    )


def parse_timeout(value: Any) -> Optional[timedelta]:
    """``timeout``: a ``timedelta`` or a number of seconds, checked here rather than when the process group is
    created at launch, where a wrong type fails far from the line that set it."""
    if value is None or (isinstance(value, timedelta) and value > timedelta(0)):
        return value
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if is_number and math.isfinite(value) and value > 0:
        return timedelta(seconds=value)
    error = ValueError if is_number or isinstance(value, timedelta) else TypeError
    raise error(
        bad_argument(
            "timeout", value, "a datetime.timedelta or a number of seconds (int or float), greater than 0",
            "Pass e.g. `timeout=1800` or `timeout=datetime.timedelta(minutes=30)`.",
        )
    )


def _parse_cpu_offload(value: Any) -> OffloadPolicy:
    if value is None or value is False:
        return OffloadPolicy()
    if value is True:
        # Pinned memory makes host<->device copies asynchronous; it is decided per device in `sharding.py`.
        return CPUOffloadPolicy()
    if isinstance(value, CPUOffloadPolicy):
        return value
    if type(value).__name__ == "CPUOffload" and hasattr(value, "offload_params"):
        # Lightning's FSDP1 argument: `torch.distributed.fsdp.CPUOffload(offload_params=True)`.
        return CPUOffloadPolicy() if value.offload_params else OffloadPolicy()
    raise TypeError(
        bad_argument(
            "cpu_offload", value, "True, False, a torch.distributed.fsdp.CPUOffloadPolicy, or None",
            "Use `cpu_offload=True`, or `cpu_offload=CPUOffloadPolicy(pin_memory=False)` for finer control.",
        )
    )


def _parse_mixed_precision(value: Any) -> Optional[MixedPrecisionPolicy]:
    if value is None or isinstance(value, MixedPrecisionPolicy):
        return value
    raise TypeError(
        bad_argument(
            "mixed_precision", value, "a torch.distributed.fsdp.MixedPrecisionPolicy or None",
            "Prefer the precision setting, e.g. `Fabric(precision='bf16-mixed')`; use `mixed_precision="
            "MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)` only to override it.",
            problem="FSDP1's `MixedPrecision` does not apply to FSDP2" if type(value).__name__ == "MixedPrecision" else "",
        )
    )


def _parse_activation_checkpointing(policy: Any, legacy: Any) -> Optional[Policy]:
    if legacy is not None:
        if policy is not None:
            raise ValueError(
                bad_argument(
                    "activation_checkpointing", legacy,
                    "only one of `activation_checkpointing` (deprecated) and `activation_checkpointing_policy`",
                    "Drop `activation_checkpointing` and keep `activation_checkpointing_policy`.",
                    problem="Both `activation_checkpointing` and `activation_checkpointing_policy` are set",
                )
            )
        warnings.warn(
            "`activation_checkpointing` is deprecated; use `activation_checkpointing_policy` with the same value"
            " instead, e.g. `activation_checkpointing_policy={Block}`.",
            DeprecationWarning,
            stacklevel=4,
        )
        return parse_checkpointing_policy(legacy, "activation_checkpointing")
    return parse_checkpointing_policy(policy, "activation_checkpointing_policy")


def _parse_choice(argument: str, value: Any, allowed: tuple[str, ...]) -> Any:
    if isinstance(value, str) and value.lower() in allowed:
        return value.lower()
    raise ValueError(
        bad_argument(argument, value, ", ".join(repr(a) for a in allowed), f"Use e.g. `{argument}={allowed[0]!r}`.")
    )


def _parse_storage_options(value: Any) -> Optional[StorageOptions]:
    if value is None:
        return None
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        # `hidden`: the message masks credentials (a str value is not shown at all: it may be "key=...,secret=...").
        raise TypeError(bad_argument(
            "storage_options", hidden(value), "None or a dict of keyword arguments for the fsspec filesystem of"
            " checkpoint URLs",
            "Pass e.g. `storage_options={'endpoint_url': 'http://host:9000'}` (YAML: a mapping), and keep credentials"
            " in the environment (AWS_ACCESS_KEY_ID, ...) or a profile (`storage_options={'profile': 'name'}`).",
        ))
    refuse_masked(value, "storage_options")
    return StorageOptions(value)


MiB = 2**20
# Streamed transfers to and from object storage, per rank (`checkpoint/io/transfers.py` holds the values in force):
# argument -> (smallest, largest, default, what it is).
TRANSFER_LIMITS = {
    "part_size": (5 * MiB, 5 * 2**30, 8 * MiB, "bytes per upload part (S3 accepts 5 MiB to 5 GiB)"),
    "parts_in_flight": (1, 64, 4, "upload parts in flight per object"),
    "ranges_in_flight": (1, 64, 4, "ranged reads in flight per rank"),
    "range_size": (MiB, 2**30, 8 * MiB, "bytes per ranged read"),
}


def check_transfer(name: str, value: Any) -> Optional[int]:
    """``value`` of the transfer argument ``name`` (None: its default), or ``ValueError`` naming the argument, the
    value, the allowed range and the fix."""
    if value is None:
        return None
    low, high, default, what = TRANSFER_LIMITS[name]
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(bad_argument(
            name, value, f"an integer from {low} to {high} ({what})",
            f"leave it out for the default ({default}), or pass a value in that range"
            + (", e.g. `part_size=16 * 2**20`." if name == "part_size" else "."),
        ))
    return value


def _parse_async_save(value: Any, state_dict_type: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(
            bad_argument("async_save", value, "True or False", "Use `async_save=True` to write sharded saves in the background.")
        )
    if value and isinstance(state_dict_type, str) and state_dict_type.lower() == "full":
        warnings.warn(
            "`async_save=True` applies to sharded checkpoints only; with `state_dict_type='full'` saves stay"
            " synchronous, since rank 0 gathers and writes the whole file.",
            UserWarning,
            stacklevel=4,
        )
    return value


def _parse_sync_module_states(value: Any) -> bool:
    # Unlike Lightning's FSDP1 default, on unless switched off: a model built differently on each rank (another seed,
    # or none) would otherwise train a different function on every rank, with no error.
    if value is None or isinstance(value, bool):
        return value is not False
    raise TypeError(
        bad_argument(
            "sync_module_states", value, "True, False or None (the default, same as True)",
            "Leave it unset: every rank then starts from rank 0's parameters and buffers. Use False only when every"
            " rank builds identical weights itself (a saving of one broadcast of the model at setup).",
        )
    )


_PARAM_INIT_ALLOWED = (
    "None (each module's own initializer: `reset_parameters()`, Hugging Face's `_init_weights`), a callable"
    " `fn(module)`, the dotted path of one as a string, or 'skip' (leave the memory uninitialized: weights are loaded"
    " right after setup)"
)


def _parse_param_init_fn(value: Any) -> ParamInitFn:
    if value is None or callable(value):
        return value
    if not isinstance(value, str):
        raise TypeError(
            bad_argument("param_init_fn", value, _PARAM_INIT_ALLOWED,
                         "Pass a function that fills one module's tensors in place, e.g. `param_init_fn=my_init`.")
        )
    if value.strip().lower() == SKIP:
        return SKIP
    # A YAML config can only name a function: import it from its dotted path, as the policies import classes.
    module_name, _, attribute = value.strip().rpartition(".")
    problem = ""
    try:
        found = getattr(import_module_of(module_name), attribute) if module_name else None
    except (ImportError, AttributeError) as err:
        found, problem = None, f"`{value}` could not be imported ({err})"
    if callable(found):
        return found
    raise ValueError(
        bad_argument("param_init_fn", value, _PARAM_INIT_ALLOWED,
                     "Name a function by its full dotted path, e.g. `param_init_fn='my_package.init.init_module'`,"
                     " or use 'skip' only if every weight is loaded right after setup.",
                     problem=problem or f"`{value}` names no callable")
    )


def _parse_hybrid_no_sync(value: Any, strategy: ShardingStrategy) -> HybridNoSync:
    choice = _parse_choice("hybrid_no_sync", value, _HYBRID_NO_SYNC_ALLOWED)
    if choice == "reduce_scatter_only" and not strategy.is_hybrid:
        warnings.warn(
            f"`hybrid_no_sync='reduce_scatter_only'` only changes hybrid sharding, but `sharding_strategy` is"
            f" {strategy.value!r}; `no_backward_sync` will skip all gradient communication.",
            UserWarning,
            stacklevel=4,
        )
    return choice


def _parse_device_mesh(value: Any, strategy: ShardingStrategy) -> Optional[Union[tuple[int, int], DeviceMesh]]:
    if value is None:
        return None
    allowed = "a (replicate, shard) tuple or list of two positive ints, or a torch DeviceMesh"
    if isinstance(value, DeviceMesh):
        if strategy.is_hybrid and value.ndim != 2:
            raise ValueError(
                bad_argument(
                    "device_mesh", value, "a 2-D DeviceMesh (replicate, shard) for hybrid sharding",
                    "Build it with `init_device_mesh(device, (num_nodes, devices), mesh_dim_names=('replicate',"
                    " 'shard'))`, or pass the tuple `(num_nodes, devices)`.",
                )
            )
        if strategy is ShardingStrategy.NO_SHARD:
            if value.ndim != 2 or value.size(1) != 1:
                raise ValueError(
                    bad_argument(
                        "device_mesh", value, "for NO_SHARD, a 2-D DeviceMesh of shape (world_size, 1), or None",
                        "Drop `device_mesh`: NO_SHARD replicates over every rank by itself.",
                        problem="Any other mesh would shard parameters, which NO_SHARD must not do",
                    )
                )
        elif not strategy.is_hybrid and value.ndim != 1:
            raise ValueError(_mesh_needs_hybrid(value, strategy))
        return value
    if isinstance(value, (tuple, list)) and len(value) == 2 and all(_is_int(v) for v in value):
        if any(v <= 0 for v in value):
            raise ValueError(
                bad_argument(
                    "device_mesh", value, allowed,
                    "Use positive sizes, e.g. `device_mesh=(num_nodes, devices_per_node)`.",
                    problem="Mesh sizes must be at least 1",
                )
            )
        if not strategy.is_hybrid:
            raise ValueError(_mesh_needs_hybrid(value, strategy))
        return (int(value[0]), int(value[1]))
    raise TypeError(
        bad_argument("device_mesh", value, allowed, "Use e.g. `device_mesh=(2, 8)` for 2 nodes of 8 devices.")
    )


def _mesh_needs_hybrid(value: Any, strategy: ShardingStrategy) -> str:
    return bad_argument(
        "device_mesh", value, "a 2-D (replicate, shard) mesh only together with hybrid sharding",
        "Add `sharding_strategy='HYBRID_SHARD'`, or drop `device_mesh` to shard over all ranks.",
        problem=f"`sharding_strategy={strategy.value!r}` does not use a (replicate, shard) mesh",
    )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
