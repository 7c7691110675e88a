"""Where the shard files of a load from object storage are: a load from a URL reads its shards by ranges, straight
from the bucket (issue 43), but every check and reader above this module works on a local folder. So
``FsspecStore.open_committed`` gives a local "skeleton" folder holding only the small objects (``.metadata``,
``checksums.json``, ``meta.pt``, fetched once by rank 0 and broadcast), and registers here what the folder stands
for: the store's filesystem, the checkpoint's URL, its token prefix, and COMMIT's record of every object (size,
digest). Readers ask :func:`remote_objects` with the local path they were given; a local checkpoint gives None and is
read from its files as always.

The registry is per process and keyed by the skeleton's resolved path, which is new for every load
(``tempfile.mkdtemp``), so two loads in one process never see each other's objects.
"""

from __future__ import annotations

import contextlib
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Union

from lightning_fsdp.checkpoint.io.urls import join

__all__ = ["RemoteObjects", "remote_objects", "registered"]


@dataclass(frozen=True)
class RemoteObjects:
    """The committed objects a skeleton folder stands for.

    - ``fs``: the fsspec filesystem they are read with (the store's own: its retries and timeouts).
    - ``target``: the checkpoint's URL (what errors name).
    - ``prefix``: the URL of the save's objects, ``<target>/.<token>``.
    - ``kind``: ``"sharded"`` or ``"full"``, as COMMIT records it.
    - ``objects``: ``{name: (size, digest or None)}``, as COMMIT records them (digests only for small objects).
    - ``local``: the skeleton folder (a sharded checkpoint) or file path (a full one) on this host.
    - ``retry``: ``retry(step)`` runs one request's ``step`` with the store's retries within its one bound, and says
      an object gone meanwhile for what it is (the checkpoint changed while read); None: plain
      :func:`.remote_errors.retrying`.
    """

    fs: Any
    target: str
    prefix: str
    kind: str
    objects: dict[str, tuple[int, Optional[int]]]
    local: Path = field(default_factory=Path)
    retry: Optional[Callable[[Callable[[], Any]], Any]] = None

    def url(self, name: str) -> str:
        """The URL of the object ``name`` (one COMMIT names); ``KeyError`` for any other."""
        if name not in self.objects:
            raise KeyError(f"{name!r} is not an object of the checkpoint {self.target!r} (its COMMIT names"
                           f" {sorted(self.objects)[:8]}). HINT: its .metadata names a file its COMMIT does not: the"
                           " checkpoint is damaged; load an earlier one.")
        return join(self.prefix, name)

    def size(self, name: str) -> int:
        return self.objects[name][0]


_LOCK = threading.Lock()
_REGISTRY: dict[str, RemoteObjects] = {}


def _key(path: Union[str, Path]) -> str:
    return os.path.realpath(os.fspath(path))


def remote_objects(local_path: Union[str, Path, None]) -> Optional[RemoteObjects]:
    """The remote objects the skeleton ``local_path`` stands for, or None (a local checkpoint, or no load open).
    A path inside the skeleton (a shard file's place) finds its skeleton too."""
    if local_path is None:
        return None
    key = _key(local_path)
    with _LOCK:
        if key in _REGISTRY:
            return _REGISTRY[key]
        parent = os.path.dirname(key)
        found = _REGISTRY.get(parent)
    return found if found is not None and found.kind == "sharded" else None


@contextlib.contextmanager
def registered(source: RemoteObjects) -> Iterator[RemoteObjects]:
    """Register ``source`` under its ``local`` path for the time of the block (the load)."""
    key = _key(source.local)
    with _LOCK:
        _REGISTRY[key] = source
    try:
        yield source
    finally:
        with _LOCK:
            if _REGISTRY.get(key) is source:
                del _REGISTRY[key]
