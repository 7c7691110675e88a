"""Objects that belong to the default process group: built once for it, shared while it lasts.

A 2-D or 3-D ``DeviceMesh`` creates a process group per axis. Each such group keeps its own threads and sockets (for
gloo: a transport loop thread, worker threads, a connection to every peer) until the default group is destroyed. A
process that sets up strategy after strategy on one default group (a hyperparameter sweep, a notebook, a test pool)
kept a new set of them for every setup, most of the process groups that one process of this project's test pool held.
A mesh is now built once per shape and default group and shared (``engine/mesh.py``); a new default group (after
``destroy_process_group``) starts afresh.
"""

from __future__ import annotations

from typing import Any, Callable, Hashable

import torch.distributed as dist

__all__ = ["for_this_world"]

# The default group the shared objects were built on (held, so that its identity cannot be taken by a new group),
# and the objects, by key.
_world: Any = None
_shared: dict[Hashable, Any] = {}


def for_this_world(key: Hashable, build: Callable[[], Any]) -> Any:
    """``build()``'s result for ``key``, built the first time it is asked for on the current default process group
    and returned to every later caller on the same group. Every rank must ask for the same keys in the same order, as
    for any call that creates a process group."""
    global _world
    world = dist.group.WORLD if dist.is_initialized() else None
    if world is not _world:
        _shared.clear()
        _world = world
    if key not in _shared:
        _shared[key] = build()
    return _shared[key]
