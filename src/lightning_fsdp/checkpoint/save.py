"""Writing checkpoints: sharded (DCP), full (one file from rank 0), and sharded in the background.

Every save writes to a staging path and commits it only when complete, through the store that keeps the target
(:mod:`~lightning_fsdp.checkpoint.io.store`: a rename beside a local target, :mod:`~lightning_fsdp.checkpoint.io.atomic`; a
commit object written last for a URL, :mod:`~lightning_fsdp.checkpoint.io.remote`), and every failure is raised on all ranks (:mod:`~lightning_fsdp.checkpoint.integrity.agreement`).
"""

from __future__ import annotations

import contextlib
import threading
import uuid
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.planner import SavePlanner
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
from torch.nn import Module
from torch.optim import Optimizer

from lightning_fsdp.checkpoint.formats.commit_order import commit_order_value, observe
from lightning_fsdp.checkpoint.formats.layout import METADATA_FILENAME
from lightning_fsdp.checkpoint.integrity.agreement import Communicator, together
from lightning_fsdp.checkpoint.integrity.digests import new_save_id
from lightning_fsdp.checkpoint.integrity.sharded_write import ChecksumWriter
from lightning_fsdp.checkpoint.integrity.streaming_write import StreamingWriter
from lightning_fsdp.checkpoint.io import in_flight, remote_clean, remote_upload
from lightning_fsdp.checkpoint.io.collector import collector_paused
from lightning_fsdp.checkpoint.io.full_writer import save_file, write_full_checkpoint
from lightning_fsdp.checkpoint.io.staging import ReusedStaging
from lightning_fsdp.checkpoint.io.store import Target, store_for
from lightning_fsdp.checkpoint.latest import commit_order_of
from lightning_fsdp.checkpoint.state import SplitState, split_state

__all__ = [
    "save_checkpoint",
    "write_sharded",
    "write_full",
    "sharded_model_state",
    "sharded_optimizer_state",
    "AsyncSaves",
]

Filter = Optional[dict[str, Callable[[str, Any], bool]]]


# The cyclic collector is paused while a save runs, as a load's is (io/collector.py): the save's short-lived objects
# (state dicts, DCP's plans, the write items) otherwise set off a full collection of the whole process every few
# saves, 0.24-0.34 s each in a sharded save to S3 of about 1.2 s (benchmarks/profile_checkpoint.py, 2026-11-29).
@collector_paused
def save_checkpoint(
    path: Union[str, Path],
    state: dict[str, Any],
    *,
    full: bool,
    comm: Communicator,
    filter: Filter = None,
    background: Optional[AsyncSaves] = None,
    storage_options: Optional[dict[str, Any]] = None,
) -> Target:
    """Write ``state`` (models, optimizers and plain values) to ``path``: a local path, or a URL (``s3://...``) whose
    filesystem gets ``storage_options``.

    With ``background`` (sharded only), the call returns once the tensors are staged in host memory; the write and
    the final rename happen in a background thread. ``background.wait()`` reports its outcome.
    """
    split = split_state(state, for_save=True)
    if not split.models:
        raise ValueError(
            "The checkpoint state holds no model. HINT: pass the model that the strategy set up, like so:"
            " `save(path, {'model': model, 'optimizer': optimizer})` (Fabric: `fabric.save`)."
        )
    if full:
        entries = {key: get_model_state_dict(module) for key, module in split.models.items()}
        entries.update({key: _optimizer_state(split, key) for key in split.optimizers})
        return write_full(path, {**_filtered(entries, filter), **_filtered(split.metadata, filter)}, comm,
                          storage_options=storage_options)
    tensors = {key: get_model_state_dict(module) for key, module in split.models.items()}
    tensors.update({key: _optimizer_state(split, key) for key in split.optimizers})
    return write_sharded(path, _filtered(tensors, filter), _filtered(split.metadata, filter), comm, background,
                         storage_options=storage_options)


@collector_paused  # also when a front calls it directly (see save_checkpoint)
def write_sharded(
    path: Union[str, Path],
    tensors: dict[str, Any],
    metadata: dict[str, Any],
    comm: Communicator,
    background: Optional[AsyncSaves] = None,
    storage_options: Optional[dict[str, Any]] = None,
) -> Target:
    """Write a sharded checkpoint: ``tensors`` (state dicts of DTensors) through DCP, ``metadata`` to ``meta.pt``.

    The building block of :func:`save_checkpoint`, also for fronts whose checkpoints have a layout of their own.
    """
    with comm.guard(f"saving the checkpoint {str(path)!r}"):
        return _write_sharded(path, tensors, metadata, comm, background, storage_options)


def _write_sharded(
    path: Union[str, Path], tensors: dict[str, Any], metadata: dict[str, Any], comm: Communicator,
    background: Optional[AsyncSaves], storage_options: Optional[dict[str, Any]],
) -> Target:
    store = store_for(path, storage_options)

    # `meta.pt` goes first, in both modes: the checksums DCP's last step records bind it to the save (:mod:`~lightning_fsdp.checkpoint.integrity.sharded_write`).
    def stage_metadata(staged: Path) -> None:
        staged.mkdir(parents=True)
        save_file(metadata, staged / METADATA_FILENAME)

    if background is not None:
        background.wait(comm)  # the previous background save first: its error is raised before anything is staged
        target, staged, save_id = _prepare(store, path, comm, "Preparing the background save of", storage_options,
                                           stage_metadata)
        background.start(tensors, staged, target, comm, writer=_sharded_writer(store, staged, target, save_id),
                         store=store)
        return target

    target, staged, save_id = _prepare(store, path, comm, "Creating the staging directory for", storage_options,
                                       stage_metadata)
    writer = _sharded_writer(store, staged, target, save_id)

    def write() -> None:
        dcp.save(tensors, checkpoint_id=staged, storage_writer=writer, planner=_CachedPlans())
        if comm.global_rank == 0:
            store.flush(staged)

    _write_then_commit(store, write, staged, target, comm)
    return target


def _sharded_writer(store: Any, staged: Path, target: Target, save_id: str) -> ChecksumWriter:
    """DCP's writer for a sharded save: to a local staging folder, renamed into place (``LocalStore``); or, to object
    storage, each rank's shard file streamed from memory into its object under the save's token prefix
    (:class:`StreamingWriter`), with only rank 0's small files (``meta.pt``, ``.metadata``, ``checksums.json``)
    staged locally and uploaded by the commit, which names the streamed objects by the sizes written."""
    if not getattr(store, "remote", False):
        return ChecksumWriter(staged, save_id=save_id)
    fs = store.fs

    def open_object(name: str, size_hint: Optional[int] = None) -> Any:
        return remote_upload.open_streamed(fs, staged, str(target), name, size_hint=size_hint)

    def on_written(name: str, size: int, digest: Optional[int]) -> None:
        remote_upload.note_streamed(staged, name, size, digest)

    return StreamingWriter(staged, save_id=save_id, open_object=open_object, on_written=on_written)


@collector_paused  # see save_checkpoint
def write_full(path: Union[str, Path], obj: Any, comm: Communicator,
               storage_options: Optional[dict[str, Any]] = None) -> Target:
    """Write ``obj`` as one ``torch.save`` file from rank 0, gathering DTensors one at a time as they are written,
    so rank 0 never holds the whole model (:mod:`~lightning_fsdp.checkpoint.io.full_writer`)."""
    with comm.guard(f"saving the checkpoint {str(path)!r}"):
        return _write_full(path, obj, comm, storage_options)


def _write_full(path: Union[str, Path], obj: Any, comm: Communicator,
                storage_options: Optional[dict[str, Any]]) -> Target:
    store = store_for(path, storage_options)
    target, staged, _ = _prepare(store, path, comm, "Checking the checkpoint path", storage_options)

    def write() -> None:
        if comm.global_rank == 0 and getattr(store, "remote", False):
            # Into its object under the save's token, straight from memory (issue 43): nothing on local disk. The
            # commit names it by the size written (`remote_upload.note_streamed`), and a failed write aborts it.
            sink = remote_upload.open_streamed(store.fs, staged, str(target), staged.name)
            write_full_checkpoint(str(target), obj, is_writer=True, sink=sink)
            remote_upload.note_streamed(staged, staged.name, sink.size, sink.digest)
            return
        write_full_checkpoint(staged, obj, is_writer=comm.global_rank == 0)
        if comm.global_rank == 0:
            store.flush(staged)

    _write_then_commit(store, write, staged, target, comm)
    return target


def _prepare(
    store: Any, path: Union[str, Path], comm: Communicator, what: str, storage_options: Optional[dict[str, Any]],
    on_rank_0: Optional[Callable[[Path], None]] = None,
) -> tuple[Target, Path, str]:
    """The target, its staging path and the save id, with the target's folder checked on every rank, and on rank 0
    the commit orders there observed (:func:`_count_above_the_directory`) and ``on_rank_0(staged)`` run, all in one
    agreed step.

    Rank 0 names everything, in one broadcast (each collective is a visible share of a background save's call): the
    target, the path as given (a symbolic link there is replaced by the new checkpoint, and what it pointed to is
    left alone, see `atomic`), the staging path's token, and the save id that the checksum of every item records
    (:mod:`~lightning_fsdp.checkpoint.integrity.sharded_write`).
    """
    named = (str(store.target(path)), uuid.uuid4().hex[:12], new_save_id()) if comm.global_rank == 0 else None
    resolved, token, save_id = comm.broadcast(named)
    target = store.target(resolved)
    staged = store.staging(target, token, comm.global_rank)

    def check() -> None:
        if comm.global_rank == 0 and getattr(store, "remote", False):
            # Rank 0's reads of a bucket, side by side: the target's checks and the commit orders of its directory
            # are a few round trips each, on the path of every save and of a background save's call.
            remote_clean.side_by_side(lambda read: read(), [lambda: store.check_target(target, 0),
                                      lambda: _count_above_the_directory(store, target, storage_options)], 2)
        else:
            store.check_target(target, comm.global_rank)
            if comm.global_rank == 0:
                _count_above_the_directory(store, target, storage_options)
        if comm.global_rank == 0 and on_rank_0 is not None:
            on_rank_0(staged)

    try:
        # Its own agreed step, not a barrier: a rank-0 failure here (a read-only filesystem, a full disk) reaches
        # the others now, not after they waited out the process group's timeout in the barrier.
        together(comm, f"{what} {str(target)!r}", check)
    except BaseException:
        store.discard(staged, comm.global_rank)  # e.g. a `meta.pt` that did not fit must not stay behind
        raise
    return target, staged, save_id


def _count_above_the_directory(store: Any, target: Target, storage_options: Optional[dict[str, Any]]) -> None:
    """Make this save's commit order count above every commit in the target's directory, whichever process or host
    made it and whatever its clock said (:mod:`~lightning_fsdp.checkpoint.formats.commit_order`, issue 42 item 3).

    Rank 0 alone: it is the rank that records the order (the manifest, the full file, the COMMIT object), also in
    the thread that commits a background save, which starts after this. Each checkpoint's order is read once per
    process while it is unchanged (:func:`~lightning_fsdp.checkpoint.latest.commit_order_of`); a remote listing
    already holds each COMMIT, so its order costs no second read.
    """
    for _, entry, record in store.checkpoints_in(store.parent(target)):
        order = commit_order_value(record)
        observe(order if order is not None else commit_order_of(entry, storage_options))


class _CachedPlans(dcp.DefaultSavePlanner):
    """DCP's planner with its plan cache on. Without it, every save gathers each rank's full plan (one entry per tensor
    chunk) to rank 0, which unpickles them all and scatters the finished plans back: about a quarter of a sharded
    save of a 17M-parameter GPT on 2 CPU ranks. With it, a rank whose plan is unchanged since the last save sends an
    empty one, and the cached plans are used. The cache is DCP's, per process and keyed by this class's name, so no
    other planner shares it; a changed state (another model, a filter) is sent in full and replaces it."""

    def __init__(self) -> None:
        super().__init__(enable_plan_caching=True)

    def create_local_plan(self) -> Any:
        # DCP decides that a plan is unchanged by names, offsets and sizes alone, not dtypes: a tensor that changed
        # dtype since the last save (a model cast to bf16, an optimizer state made fp32) would be written in its new
        # dtype under a `.metadata` that records the old one, and a reader that trusts `.metadata` (a resharded
        # load's partial reads) would load other numbers. Such a rank sends its plan again, and the coordinator
        # rebuilds the metadata from it.
        cached = SavePlanner._cached_save_plan.get(self._cached_plans_key)
        if cached is not None and _dtypes_changed(cached, self.state_dict):
            del SavePlanner._cached_save_plan[self._cached_plans_key]
        # Autograd off: DCP's write items of a DTensor call its `to_local`, an autograd Function per tensor with
        # grad mode on (the writers turn it off for their own reads, see integrity/streaming_write.py).
        with torch.no_grad():
            return super().create_local_plan()


def _dtypes_changed(plan: Any, state: dict[str, Any]) -> bool:
    for item in plan.items:
        if item.tensor_data is not None and getattr(state.get(item.index.fqn), "dtype", None) != \
                item.tensor_data.properties.dtype:
            return True
    return False


def _write_then_commit(
    store: Any, write: Callable[[], None], staged: Path, target: Target, comm: Communicator,
) -> None:
    try:
        try:
            together(comm, f"Writing the checkpoint {str(target)!r}", write)
        except BaseException:
            _remove_streamed(store, staged, target, comm.global_rank)
            raise
        store.commit(staged, target, comm)  # agreed on every rank: no rank returns as if saved when one failed
    except BaseException:
        store.discard(staged, comm.global_rank)
        raise
    finally:
        remote_upload.forget_streamed(staged)


def _remove_streamed(store: Any, staged: Path, target: Target, rank: int) -> None:
    """A failed write to object storage: rank 0 removes the objects the ranks streamed under this save's token (the
    ranks that finished completed theirs), best effort; what a killed rank left (an incomplete multipart upload)
    is aborted by ``clean`` and the next save's sweep once stale."""
    if rank != 0 or not getattr(store, "remote", False):
        return
    with contextlib.suppress(Exception):
        store._remove_uncommitted(str(target), remote_clean.token_of_staging(Path(staged).parent))


def _optimizer_state(split: SplitState, key: str) -> dict[str, Any]:
    return sharded_optimizer_state(split.owners[key], split.optimizers[key])


def sharded_model_state(module: Module) -> dict[str, Any]:
    """The model's state dict under clean parameter names, values still sharded (DTensors): the building block of
    :func:`save_checkpoint`, also for fronts whose checkpoints have a layout of their own."""
    return get_model_state_dict(split_state({"model": module}, for_save=True).models["model"])


def sharded_optimizer_state(module: Module, optimizer: Optimizer) -> dict[str, Any]:
    """The optimizer's state keyed by parameter names, values still sharded (a full save gathers them one at a time
    while writing). ``module`` is the model whose parameters the optimizer updates."""
    fresh = not optimizer.state
    state = get_optimizer_state_dict(module, optimizer, options=StateDictOptions(full_state_dict=False))
    if fresh:
        # The state-dict API fills missing state with a zero-gradient step; undo that on the live optimizer, so
        # saving before the first step does not change training, and save no state, as `optimizer.state_dict()`
        # would: that zero state has a step count of 1, and a run resumed from it would step differently.
        optimizer.state.clear()
        state["state"] = {}
    return state


def _filtered(entries: dict[str, Any], filter: Filter) -> dict[str, Any]:
    out = dict(entries)
    for key, keep in (filter or {}).items():
        if isinstance(out.get(key), dict):
            out[key] = {k: v for k, v in out[key].items() if keep(k, v)}
    return out


class AsyncSaves:
    """At most one sharded save in flight, written by DCP in a background thread.

    - ``start`` returns once the tensors are copied to host memory (DCP's staging), after waiting for the previous
      save, so saves never overlap.
    - The background collectives run on a gloo group of their own, so they cannot interleave with training's.
    - When the write finishes, rank 0 moves the checkpoint into place from the background thread.
    - ``wait`` (called by the next save, load and teardown, and at process exit) blocks until then and raises the
      background error, if any, on every rank: it is never swallowed (see `.in_flight`).
    - ``remove`` removes a checkpoint only once the save in flight is committed (see `.in_flight`), and
      ``after_commit`` runs retention's pruning then.
    """

    def __init__(self) -> None:
        self._future: Optional[Future] = None
        self._target: Optional[Target] = None
        self._group: Optional[dist.ProcessGroup] = None
        self._commit_error: Optional[BaseException] = None
        self._committed = threading.Event()
        # One stager for every save, so the host copies of the tensors are reused (see `.staging`).
        self._stager = ReusedStaging()
        self._removals = in_flight.DeferredRemovals()

    @property
    def in_flight(self) -> bool:
        return self._future is not None

    def start(self, tensors: dict[str, Any], staged: Path, target: Target, comm, writer: ChecksumWriter,
              store: Any) -> None:
        """Stage ``tensors`` and write them to ``staged`` (which rank 0 has created, with ``meta.pt`` in it) in the
        background; the store then commits it to ``target`` from the background thread (a rename by rank 0, or
        every rank's upload and then the commit object)."""
        self.wait(comm)
        if self._group is None and dist.is_initialized():
            self._group = dist.new_group(backend="gloo")
        try:
            future = dcp.async_save(tensors, checkpoint_id=staged, storage_writer=writer, process_group=self._group,
                                    planner=_CachedPlans(), async_stager=self._stager)
        except BaseException:
            store.discard(staged, comm.global_rank)
            raise
        self._future, self._target, self._commit_error = future, target, None
        self._committed = threading.Event()
        self._removals.hold()
        in_flight.track(self, comm, self._group)
        group_comm = in_flight.GroupComm(comm.global_rank, self._group)
        caller = threading.get_ident()

        def on_written(f: Future) -> None:
            args = (f, staged, target, store, group_comm)
            if threading.get_ident() == caller:
                # Written before the callback was added: `add_done_callback` runs it here, on the saving thread,
                # which would make this save synchronous (and its upload hold up training). Commit in the
                # background all the same.
                threading.Thread(target=self._commit_when_written, args=args, name="lightning-fsdp-commit").start()
            else:
                self._commit_when_written(*args)

        future.add_done_callback(on_written)

    def _commit_when_written(self, future: Future, staged: Path, target: Target, store: Any, comm: Any) -> None:
        try:
            store.commit_in_background(staged, target, comm, future.exception())
            self._removals.committed()
        except BaseException as err:  # noqa: BLE001 - surfaced by `wait`
            self._commit_error = err
            self._removals.failed()
            store.discard(staged, comm.global_rank)
        finally:
            remote_upload.forget_streamed(staged)
            # `Future.result()` can return before the callbacks have run; `wait` waits for this instead.
            self._committed.set()

    def wait(self, comm: Communicator) -> None:
        if self._future is None:
            return
        future, target = self._future, self._target
        self._future = self._target = None
        in_flight.untrack(self)

        def finish() -> None:
            self._committed.wait()
            removal_error = self._removals.settle()
            if self._commit_error is not None:
                raise self._commit_error
            future.result()  # raises the background write's error
            if removal_error is not None:
                raise removal_error

        together(comm, f"The background save of {str(target)!r}", finish)

    def remove(self, path: Target, store: Any = None) -> None:
        """Remove the checkpoint at ``path`` (on rank 0, where it is called), once the save in flight, if any, is
        committed; never if that save fails. A URL is removed through its store (its commit object first): pass the
        one with the strategy's ``storage_options`` (the default store reads the environment alone)."""
        store = store_for(path) if store is None else store
        self._removals.defer(lambda: store.remove(path), f"Removing the superseded checkpoint {str(path)!r}")

    def after_commit(self, action: Callable[[], Any], what: str) -> None:
        """Run ``action`` (on the rank that calls this) once the save in flight, if any, is committed: at once when
        none is, in the committing thread otherwise, never if that save fails. Its error is raised by ``wait``, on
        every rank, naming ``what``."""
        self._removals.defer(action, what)
