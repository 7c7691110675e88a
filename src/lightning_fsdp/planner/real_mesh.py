"""Keep a DeviceMesh's rank table real while the planner runs on fake tensors, so tensor parallelism can be planned.

Why: a ``DeviceMesh`` holds its ranks in a small int tensor (the root mesh's ``_rank_map``, shared by every mesh sliced,
flattened or concatenated from it), and every new mesh finds this rank's coordinates in it:
``DeviceMesh.__init__`` -> ``_compute_coordinate_on_dim`` -> ``_compute_coordinates_from_mesh``, which runs
``(mesh_tensor == rank).nonzero()`` and then reads the result's length and values (torch 2.13,
``torch/distributed/device_mesh.py``, lines 340, 376 and 362-371). Under ``FakeTensorMode`` the real rank table is
turned into a fake tensor (``allow_non_fake_inputs``), and fake tensors cannot run ``nonzero``: its output shape
depends on values they do not have (``DynamicOutputShapeException``). With tensor parallelism FSDP builds such a mesh
for every split parameter: ``fully_shard`` -> ``FSDPParam._init_sharding_spec_tp`` ->
``DeviceMesh._concatenate([dp_mesh, tp_mesh])`` (``torch/distributed/fsdp/_fully_shard/_fsdp_param.py``, line 501);
``DeviceMesh._flatten`` fails the same way. A ``ShapeEnv`` with dynamic output shapes does not help: the length of
the ``nonzero`` result becomes an unbacked symbol, and ``rank_coords.size(0) not in (0, 1)`` (line 363) cannot be
decided on it (``GuardOnDataDependentSymNode``); the coordinates decide which shard a rank holds, so they must be the
real numbers.

How: :class:`RealMeshIndices`, a dispatch mode active while the planner runs, runs for real every op whose tensor
inputs are all the mesh's rank table or results computed from it alone, and leaves every other op (the model's
parameters, activations, FSDP's buffers: all fake) to ``FakeTensorMode``. These ops touch a few integers per mesh;
no tensor of the model is ever real.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.weak import WeakIdKeyDictionary

from lightning_fsdp._base.compat import real_mesh_dispatch

__all__ = ["RealMeshIndices"]

_DispatchMode, _unset_fake, _rank_map = real_mesh_dispatch()


class RealMeshIndices(_DispatchMode):
    """Within the ``with`` block, ops on ``mesh``'s rank table (and on what was computed from it alone) run on real
    values; all others pass on unchanged."""

    def __init__(self, mesh: DeviceMesh) -> None:
        super().__init__()
        self._real = WeakIdKeyDictionary()
        self._real[_rank_map(mesh)] = True

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        tensors = [t for t in _leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if not tensors or not all(t in self._real for t in tensors):
            return func(*args, **kwargs)
        with _unset_fake():
            out = func(*args, **kwargs)
        for t in _leaves(out):
            if isinstance(t, torch.Tensor):
                self._real[t] = True
        return out


def _leaves(obj: Any) -> list[Any]:
    if isinstance(obj, (list, tuple)):
        return [leaf for item in obj for leaf in _leaves(item)]
    if isinstance(obj, dict):
        return [leaf for item in obj.values() for leaf in _leaves(item)]
    return [obj]
