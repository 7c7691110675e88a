"""Process groups and the DeviceMesh that ``fully_shard`` runs on.

The data-parallel part of the mesh always has one of two shapes:

- 1-D ``("shard",)`` for FULL_SHARD and SHARD_GRAD_OP;
- 2-D ``("replicate", "shard")`` for the hybrid strategies, and ``(world, 1)`` for NO_SHARD, which FSDP2 then
  treats as plain replication: every rank holds whole parameters and gradients are all-reduced.

With ``tensor_parallel_size=K`` a last axis ``("tp",)`` of size K follows (see :mod:`.tensor_parallel`): the ranks of
one tensor-parallel group are consecutive, and :func:`data_parallel_mesh` / :func:`tensor_parallel_mesh` give the two
parts. A rank's data-parallel rank is ``global_rank // K`` (the fronts' samplers use it): the K ranks of a group see
the same batch.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Optional, Protocol, Union

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from lightning_fsdp._base.errors import bad_argument
from lightning_fsdp._base.failures import remember_timeout
from lightning_fsdp._base.per_world import for_this_world
from lightning_fsdp._base.process_exit import register_exit_handler
from lightning_fsdp.engine.config import FSDPConfig, ShardingStrategy
from lightning_fsdp.engine.tensor_parallel import TP_AXIS

__all__ = [
    "ClusterInfo", "default_backend", "init_process_group", "build_mesh", "data_parallel_mesh", "tensor_parallel_mesh",
    "SHARD_AXIS", "REPLICATE_AXIS",
]

SHARD_AXIS = "shard"
REPLICATE_AXIS = "replicate"


class ClusterInfo(Protocol):
    """What the engine needs of a cluster environment (Lightning's ``ClusterEnvironment`` satisfies it)."""

    @property
    def main_address(self) -> str: ...

    @property
    def main_port(self) -> int: ...

    def global_rank(self) -> int: ...

    def world_size(self) -> int: ...


def default_backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


# The default process group this package created, if any: a later Fabric in the same process shares it and knows its
# timeout; a group the user created has a timeout this package never saw.
_created_group: Optional[dist.ProcessGroup] = None


def init_process_group(
    cluster: ClusterInfo, backend: str, device: torch.device, timeout: Optional[timedelta]
) -> None:
    """Join the default process group unless this process already has one (several Fabric objects in one process
    share it)."""
    global _created_group
    if dist.is_initialized():
        register_exit_handler()  # the user's group is theirs to destroy; the wait for gloo's workers still helps
        if dist.group.WORLD is not _created_group:
            remember_timeout(None)  # the user's group: its timeout is not this strategy's to name
        return
    remember_timeout(timeout)
    os.environ["MASTER_ADDR"] = cluster.main_address
    os.environ["MASTER_PORT"] = str(cluster.main_port)
    kwargs = {"timeout": timeout} if timeout is not None else {}
    if device.type == "cuda":
        # Binding the group to the device lets NCCL connect eagerly and avoids a device guess per collective.
        kwargs["device_id"] = device
    store = _restart_store(cluster, timeout)
    if store is not None:
        kwargs["store"] = store
    dist.init_process_group(backend, rank=cluster.global_rank(), world_size=cluster.world_size(), **kwargs)
    _created_group = dist.group.WORLD
    register_exit_handler(created=dist.group.WORLD)


def _restart_store(cluster: ClusterInfo, timeout: Optional[timedelta]) -> Optional[dist.Store]:
    """Under ``torchrun --max-restarts``, a store of this attempt's own, or None to let torch make the usual one.

    torchrun's agent hosts the store and keeps it across restarts, so a restarted group would find the first
    attempt's keys there: gloo then connects to the addresses of the dead workers and fails ("connectFullMesh failed
    ... Connection refused"). A prefix per restart gives every attempt fresh keys in the same store.
    """
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or attempt == "0":
        return None
    kwargs = {"timeout": timeout} if timeout is not None else {}
    agent_store = dist.TCPStore(cluster.main_address, cluster.main_port, cluster.world_size(), is_master=False,
                                **kwargs)
    return dist.PrefixStore(f"lightning_fsdp/attempt-{attempt}", agent_store)


def build_mesh(config: FSDPConfig, device: torch.device, world_size: int, num_nodes: int) -> DeviceMesh:
    """The mesh for ``config`` on ``world_size`` ranks. Raises ``ValueError`` when the user's mesh does not fit."""
    strategy = config.sharding_strategy
    if isinstance(config.device_mesh, DeviceMesh):
        if config.device_mesh.size() != world_size:
            raise ValueError(_mismatch(config.device_mesh, tuple(config.device_mesh.shape), world_size, num_nodes))
        return config.device_mesh
    tp = config.tensor_parallel.size
    if world_size % tp:
        divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
        raise ValueError(bad_argument(
            "tensor_parallel_size", tp, f"a divisor of the world size {world_size}: {divisors}",
            f"Use e.g. `tensor_parallel_size={divisors[-2] if len(divisors) > 1 else 1}`, or change `devices`.",
            problem=f"{world_size} processes cannot form groups of {tp}",
        ))
    data_parallel = world_size // tp
    tp_axis = ((tp,), (TP_AXIS,)) if tp > 1 else ((), ())
    if strategy.is_hybrid:
        shape = config.device_mesh or (num_nodes, data_parallel // num_nodes)
        if shape[0] * shape[1] != data_parallel:
            raise ValueError(_mismatch(config.device_mesh or shape, shape, data_parallel, num_nodes, tp))
        return _shared_mesh(device.type, (*shape, *tp_axis[0]), (REPLICATE_AXIS, SHARD_AXIS, *tp_axis[1]))
    if strategy is ShardingStrategy.NO_SHARD:
        return _shared_mesh(device.type, (data_parallel, 1, *tp_axis[0]), (REPLICATE_AXIS, SHARD_AXIS, *tp_axis[1]))
    return _shared_mesh(device.type, (data_parallel, *tp_axis[0]), (SHARD_AXIS, *tp_axis[1]))


def _shared_mesh(device_type: str, shape: tuple, names: tuple) -> DeviceMesh:
    """One mesh per shape on the default group, shared by every strategy set up on it: a mesh of two or more axes
    creates a process group per axis, which would otherwise pile up, setup after setup (``_base/per_world.py``)."""
    return for_this_world(("device mesh", device_type, shape, names),
                          lambda: init_device_mesh(device_type, shape, mesh_dim_names=names))


def data_parallel_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The axes ``fully_shard`` runs on: the whole mesh, or all but ``"tp"``."""
    names = mesh.mesh_dim_names or ()
    if TP_AXIS not in names:
        return mesh
    kept = tuple(n for n in names if n != TP_AXIS)
    return mesh[kept[0]] if len(kept) == 1 else mesh[kept]


def tensor_parallel_mesh(mesh: DeviceMesh) -> Optional[DeviceMesh]:
    """The ``"tp"`` axis, or None without tensor parallelism."""
    return mesh[TP_AXIS] if TP_AXIS in (mesh.mesh_dim_names or ()) else None


def _mismatch(value: Union[tuple, DeviceMesh], shape: tuple, world_size: int, num_nodes: int, tp: int = 1) -> str:
    sizes = " x ".join(str(s) for s in shape)
    target = (f"the world size, {world_size}" if tp == 1
              else f"the world size divided by tensor_parallel_size={tp}, {world_size}")
    return bad_argument(
        "device_mesh", value, f"a (replicate, shard) shape whose sizes multiply to {target}",
        f"Use e.g. `device_mesh=({num_nodes}, {max(world_size // max(num_nodes, 1), 1)})` for {num_nodes} node(s),"
        " or change `devices`/`num_nodes` to match the mesh.",
        problem=f"The mesh has {sizes} = {_product(shape)} ranks, but {world_size}"
        + (" processes are running" if tp == 1 else " data-parallel ranks are running"),
    )


def _product(shape: tuple) -> int:
    out = 1
    for s in shape:
        out *= s
    return out
