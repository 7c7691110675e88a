"""Where checkpoints are kept: one interface for a local filesystem and for any fsspec URL.

Every operation (save, load, ``latest``, retention, convert, verify) reaches its store through :func:`store_for`, and
no code above this module asks whether a path is remote. The seam keeps every format writer and reader as it is:

- ``staging(target, token, rank)``: a local path the existing writers fill (local: the hidden staging path beside
  the target; remote: a temporary folder on the rank's host);
- ``commit(staged, target, comm)``: make it the checkpoint at ``target``, whole or not at all, on every rank
  together (local: one rename by rank 0; remote: see :mod:`~lightning_fsdp.checkpoint.io.remote`);
- ``open_committed(path, comm)``: a local path to read a committed checkpoint from, for the time of a load (local:
  the path itself; remote: the objects its commit names, fetched and size-checked, removed after the load).

The integrity checks run on what ``open_committed`` gives, so they are the same on every store.

Plain files beside checkpoints (Hugging Face weights, read by ranges) go through the same interface: ``listing``,
``size``, ``read`` and ``read_ranges`` (one request each on a remote store: one LIST, one HEAD, one GET, several GETs
in flight), and ``index_entries`` (the files an index names, each checked to stay inside its directory). Only
:func:`store_for` asks whether a path is a URL.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import zipfile
from pathlib import Path
from typing import Any, Iterator, Mapping, Optional, Protocol, Sequence, Union

from lightning_fsdp.checkpoint.formats import hf_checks
from lightning_fsdp.checkpoint.formats.commit_order import commit_order_value
from lightning_fsdp.checkpoint.formats.layout import CHECKSUMS_FILENAME, is_full_checkpoint, is_sharded_checkpoint
from lightning_fsdp.checkpoint.integrity.digests import ZIP_CHECKSUMS_RECORD
from lightning_fsdp.checkpoint.integrity.verify import verify_checkpoint
from lightning_fsdp.checkpoint.integrity.agreement import Communicator, together
from lightning_fsdp.checkpoint.io import atomic, in_flight
from lightning_fsdp.checkpoint.io.one_process import OneProcess
from lightning_fsdp.checkpoint.io.readers import UsageError
from lightning_fsdp.checkpoint.io.urls import check_storage_options, is_url, local_path

__all__ = ["Store", "LocalStore", "OneProcess", "store_for", "Target"]

Target = Union[Path, str]  # a local Path, or a URL string (never a Path: it would fold "s3://" into "s3:/")


class Store(Protocol):
    """What the checkpoint operations need from a place that keeps checkpoints."""

    remote: bool  # False for the local disk: Lightning's own code handles its paths (``last``, ``ModelCheckpoint``)

    def target(self, path: Union[str, Path]) -> Target:
        """The normalized checkpoint path a save writes to (a link is replaced, not followed; see ``atomic``)."""

    def staging(self, target: Target, token: str, rank: int) -> Path:
        """The local path this rank's writers fill for the save ``token``."""

    def check_target(self, target: Target, rank: int) -> None:
        """Refuse a target that holds something other than a checkpoint; create what the save writes into."""

    def flush(self, staged: Path) -> None:
        """Make the staged bytes durable before the commit (rank 0)."""

    def commit(self, staged: Target, target: Target, comm: Communicator, commit_order: Any = None) -> None:
        """Collective: make the staged save the checkpoint at ``target``; raises on every rank when any failed.
        ``commit_order``: what a convert records (a remote store writes it into its COMMIT)."""

    def discard(self, staged: Path, rank: int) -> None:
        """Remove what a failed save staged on this rank."""

    def open_committed(self, path: Union[str, Path], comm: Communicator) -> contextlib.AbstractContextManager[Path]:
        """Collective: a local path holding the committed checkpoint at ``path`` for the time of the block."""

    def exists(self, path: Target) -> bool: ...

    def remove(self, target: Target) -> None:
        """Remove a checkpoint (retention, ``ModelCheckpoint``): a link alone, never what it points to."""

    def checkpoints_in(self, directory: Target) -> list[tuple[str, Target, dict]]:
        """The committed checkpoints directly in ``directory``: (name, path, what the commit recorded)."""

    def display(self, path: Target) -> str: ...

    def name(self, path: Target) -> str:
        """The last component of ``path``."""

    def parent(self, path: Target) -> Target: ...

    def child(self, directory: Target, name: str) -> Target: ...

    def fingerprint(self, path: Target) -> tuple:
        """What changes when the checkpoint at ``path`` changes (what is learnt about it stays valid until then)."""

    def commit_order(self, path: Target) -> Optional[int]:
        """The commit order the checkpoint records (:mod:`~lightning_fsdp.checkpoint.formats.commit_order`)."""

    def verify(self, path: Target) -> bool:
        """Check the committed checkpoint at ``path`` against its checksums (False: it records none)."""

    def local_copy(self, path: Union[str, Path]) -> contextlib.AbstractContextManager[Path]:
        """In this process alone: a local path to read the committed checkpoint at ``path`` from (a local path is
        itself, as given; a URL's objects are fetched and checked, and removed after the block)."""

    def clean(self, path: Target, grace_s: Optional[float] = None) -> Any:
        """Remove what saves that never committed left at ``path`` (``lightning-fsdp clean``)."""

    # --- plain files (Hugging Face weights), read in place -------------------------------------------------------

    def listing(self, directory: Target) -> Optional[dict[str, int]]:
        """The files directly in ``directory``, name -> size; None when it is no directory (absent, or a file)."""

    def size(self, path: Target) -> Optional[int]:
        """The size of the file at ``path``; None when there is none."""

    def read(self, path: Target, start: int = 0, end: Optional[int] = None) -> bytes:
        """Bytes ``[start, end)`` of the file at ``path`` (``end=None``: to its end), in one request."""

    def read_ranges(self, paths: Sequence[Target], starts: Sequence[int], ends: Sequence[int]) -> list[bytes]:
        """Several ranges, as :meth:`read` reads one; a remote store keeps them in flight together."""

    def index_entries(self, directory: Target, index: Target, weight_map: Mapping[str, Any]) -> list[Target]:
        """The files an index at ``index`` names (``weight_map``: tensor -> file name relative to ``directory``),
        each checked to stay inside ``directory``; sorted, each once. ``ValueError`` names the entries that do not."""


class LocalStore:
    """Today's local behaviour, byte for byte: staging beside the target, one rename (``atomic``)."""

    remote = False

    def target(self, path: Union[str, Path]) -> Path:
        return local_path(path)

    def staging(self, target: Target, token: str, rank: int) -> Path:
        return atomic.staging_path(Path(target), token)

    def check_target(self, target: Target, rank: int) -> None:
        target = Path(target)
        atomic.check_replaceable(target)
        # Like torch.save through Lightning's CheckpointIO, a save creates the folder it writes into.
        target.parent.mkdir(parents=True, exist_ok=True)

    def flush(self, staged: Path) -> None:
        atomic.fsync_tree(staged)

    def commit(self, staged: Target, target: Target, comm: Communicator, commit_order: Any = None) -> None:
        # `commit_order`: a local checkpoint records it in its own files alone (the writers put it there).
        # Rank 0 alone moves the checkpoint into place; its failure is agreed, so no rank returns as if saved.
        together(comm, f"Moving the checkpoint into place at {str(target)!r}",
                 lambda: atomic.commit(Path(staged), Path(target)) if comm.global_rank == 0 else None)

    def commit_in_background(self, staged: Path, target: Target, comm: Any, failure: Optional[BaseException]) -> None:
        """The commit of a background save, from the thread that finished writing it (on every rank; ``failure``:
        the write's error). Rank 0 alone renames here."""
        if failure is not None:
            raise failure
        if comm.global_rank == 0:
            self.flush(staged)
            atomic.commit(staged, Path(target))

    def discard(self, staged: Path, rank: int) -> None:
        if rank == 0:
            atomic.discard(staged)

    @contextlib.contextmanager
    def open_committed(self, path: Union[str, Path], comm: Communicator) -> Iterator[Path]:
        source = Path(comm.broadcast(str(atomic.resolve(local_path(path)))))
        if comm.global_rank == 0:
            atomic.recover(source)  # a save that died between its two renames left the old checkpoint aside
        comm.barrier()
        yield source

    def exists(self, path: Target) -> bool:
        path = Path(path)
        return path.exists() or path.is_symlink()

    def remove(self, target: Target) -> None:
        in_flight.remove_checkpoint(Path(target))

    def checkpoints_in(self, directory: Target) -> list[tuple[str, Target, dict]]:
        directory = Path(directory)
        if not directory.is_dir():
            return []
        found = []
        for entry in directory.iterdir():
            if entry.name.startswith("."):  # staging copies of saves in flight or killed, and backups
                continue
            if is_sharded_checkpoint(entry) or is_full_checkpoint(entry):
                found.append((entry.name, entry, {"mtime_ns": entry.stat().st_mtime_ns}))
        return found

    def display(self, path: Target) -> str:
        return str(path)

    def name(self, path: Target) -> str:
        return Path(path).name

    def parent(self, path: Target) -> Path:
        return Path(path).parent

    def child(self, directory: Target, name: str) -> Path:
        return Path(directory) / name

    def fingerprint(self, path: Target) -> tuple:
        path = Path(path)
        entries = [path] if not path.is_dir() else sorted(p for p in path.iterdir())
        out = []
        for entry in entries:
            st = entry.stat()
            out.append((entry.name, st.st_ino, st.st_size, st.st_mtime_ns))
        return tuple(out)

    def commit_order(self, path: Target) -> Optional[int]:
        """Read from the record each format writes last: a sharded checkpoint's manifest, a full file's checksums."""
        path = Path(path)
        try:
            if path.is_dir():
                record = json.loads((path / CHECKSUMS_FILENAME).read_bytes())
            else:
                with zipfile.ZipFile(path) as archive:
                    names = [n for n in archive.namelist() if n.rsplit("/", 1)[-1] == ZIP_CHECKSUMS_RECORD]
                    if len(names) != 1:
                        return None
                    record = json.loads(archive.read(names[0]))
        except (OSError, ValueError, zipfile.BadZipFile, EOFError, NotImplementedError):  # none, or unreadable
            return None
        return commit_order_value(record)

    def verify(self, path: Target) -> bool:
        return verify_checkpoint(Path(path))

    @contextlib.contextmanager
    def local_copy(self, path: Union[str, Path]) -> Iterator[Path]:
        yield local_path(path)

    def clean(self, path: Target, grace_s: Optional[float] = None) -> Any:
        raise UsageError(f"`clean` takes a checkpoint URL, got {str(path)!r}. HINT: e.g. `lightning-fsdp clean"
                         " s3://bucket/run/step-3`; a local save leaves nothing to clean (its staging copy is"
                         " removed by the next save).")

    def listing(self, directory: Target) -> Optional[dict[str, int]]:
        directory = local_path(directory)
        if not directory.is_dir():
            return None
        return {entry.name: entry.stat().st_size for entry in directory.iterdir() if entry.is_file()}

    def size(self, path: Target) -> Optional[int]:
        path = local_path(path)
        return path.stat().st_size if path.is_file() else None

    def read(self, path: Target, start: int = 0, end: Optional[int] = None) -> bytes:
        with open(local_path(path), "rb") as file:
            file.seek(start)
            return file.read(-1 if end is None else max(0, end - start))

    def read_ranges(self, paths: Sequence[Target], starts: Sequence[int], ends: Sequence[int]) -> list[bytes]:
        return [self.read(path, start, end) for path, start, end in zip(paths, starts, ends)]

    def index_entries(self, directory: Target, index: Target, weight_map: Mapping[str, Any]) -> list[Target]:
        # Also after symlinks (a Hugging Face hub snapshot's links into its own blobs excepted): `hf_checks`.
        return list(hf_checks.index_files(local_path(directory), local_path(index), weight_map))


_LOCAL = LocalStore()
_remote_stores: dict[tuple, Any] = {}
_lock = threading.Lock()


def store_for(path: Union[str, Path, Any], storage_options: Optional[dict[str, Any]] = None) -> Any:
    """The store that keeps ``path``: :class:`LocalStore` for a local path or ``file://``, an ``FsspecStore`` for any
    other URL (one per filesystem and options in each process)."""
    if not is_url(path):
        return _LOCAL
    from lightning_fsdp.checkpoint.io.remote import FsspecStore
    from lightning_fsdp.checkpoint.io.urls import split_url

    options = check_storage_options(storage_options)
    key = (os.getpid(), split_url(str(path))[0], repr(sorted((options or {}).items())))
    with _lock:
        store = _remote_stores.get(key)
        if store is None:
            store = _remote_stores[key] = FsspecStore(split_url(str(path))[0], options)
    return store

