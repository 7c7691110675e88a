"""The newest good checkpoint in a directory of step checkpoints, and the one order every reader of such a directory
uses: the order the checkpoints were **committed** in.

A training job that saves every K steps into one directory (``step-00000100``, ``step-00000200``, ... or any names
ending in the step number) resumes from the checkpoint committed last that is complete and passes verification. A
save that was killed never shows up here (it lives under a hidden staging name until its commit, see
:mod:`~lightning_fsdp.checkpoint.io.atomic`); a committed checkpoint damaged afterwards (a truncated shard, flipped
bits) fails its checksums and is skipped with a warning that names it, and the one committed before it is used.

Commit order, not step order (:mod:`~lightning_fsdp.checkpoint.formats.commit_order` says why and where each save
records it): after a rollback (load step 100 by path, train on, save step 110) the run goes on from 110, not from
the abandoned 200; in a run that never rolls back the two orders agree. :func:`step_checkpoints` is the one place
that orders a directory, for ``latest``, ``resume`` and retention (:mod:`.retention`) alike, and
:func:`verification_failure` the one place that says whether a checkpoint is good.

``fabric.load("<dir>/latest", state)`` and ``trainer.fit(..., ckpt_path="<dir>/latest")`` use this when ``latest``
does not exist in ``<dir>`` (a real file or link named ``latest`` is loaded as it is).

In a bucket (issue 43), verifying the newest checkpoint before loading it would move its bytes twice. So a load of
``<dir>/latest`` there takes the candidates from the COMMITs alone, newest first (:func:`load_candidates`), and the
load itself verifies every item it reads; damage found then is warned about, remembered, and the one committed before
it is loaded instead (:func:`fall_back`); ``StepCheckpoints.resume`` does the same (:func:`step_candidates`). The
newest good checkpoint is moved once, and a load that verified every item leaves it known good for retention
(:func:`trusted_when_verified`). On the local disk the newest is verified first (a second read there comes from the
page cache). Verification on its own (retention, ``inspect --verify``) streams a bucket's objects: no local copy.

Damaged is not unreadable (issues 42 and 45). Only bytes that were read and found wrong (a checksum that does not
match, a reader's refusal) make a checkpoint damaged, skipped and remembered. A store that could not be read (a
network error, a timeout, refused access, an object gone while it was read:
:func:`~lightning_fsdp.checkpoint.io.remote_errors.could_not_read`) says nothing of the checkpoint: the search stops
with an error naming the URL, within the store's bound (``LFSDP_STORE_TIMEOUT_S``, default 60 s, one budget for the
whole search), nothing is remembered, and retention in that directory is off in this process until a search of it
succeeds (:func:`unread_directory`), since deleting then could remove the checkpoint the run should have resumed
from. The other ranks wait for rank 0's answer in one agreement, so they raise the same error, within the same bound.
"""

from __future__ import annotations

import contextlib
import json
import re
import threading
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Iterator, Optional, Union

import torch
import torch.distributed as dist

from lightning_fsdp.checkpoint.formats.commit_order import order_key
from lightning_fsdp.checkpoint.formats.layout import CHECKSUMS_FILENAME
from lightning_fsdp.checkpoint.integrity.agreement import together
from lightning_fsdp.checkpoint.integrity.digests import ChecksumError
from lightning_fsdp.checkpoint.integrity.streaming_read import verified_items
from lightning_fsdp.checkpoint.integrity.stream_verify import entry_names
from lightning_fsdp.checkpoint.io.remote_errors import (TIMEOUT_VARIABLE, could_not_read, one_budget, retrying,
                                                        store_timeout_s)
from lightning_fsdp.checkpoint.io.remote_source import remote_objects
from lightning_fsdp.checkpoint.io.remote_windows import CommittedObjects
from lightning_fsdp.checkpoint.io.store import Target, store_for

__all__ = [
    "LATEST", "step_of", "commit_order_of", "step_checkpoints", "verification_failure", "trust",
    "newest_good_checkpoint", "find_newest_on_rank_zero", "resolve_latest", "unread_directories", "unread_directory",
    "load_candidates", "step_candidates", "fall_back", "Candidates", "trusted_when_verified",
]

LATEST = "latest"
# The number a name ends in, before Lightning's version counter (`-v1`, when `ModelCheckpoint` saves a name that exists).
_TRAILING_NUMBER = re.compile(r"(\d+)(?:-v\d+)?(?:\.[A-Za-z]+)?$")


def step_of(path: Union[str, Path]) -> Optional[int]:
    """The step a checkpoint's name ends in (``step-00000100``, ``epoch=0-step=100.ckpt`` and Lightning's second
    ``step=100-v1.ckpt`` give 100), else None. ``path`` may be a URL."""
    name = path.name if isinstance(path, Path) else str(path).rstrip("/").rsplit("/", 1)[-1]
    match = _TRAILING_NUMBER.search(name)
    return int(match.group(1)) if match else None


# What this process has learned about each checkpoint, valid while it is unchanged (its store's `fingerprint`: a
# local checkpoint's files' sizes and mtimes, a remote one's commit): its commit order, and whether it verified. A
# checkpoint is read once per process, not at every save's retention; a write into it (damage) changes a file's size
# or mtime, and it is read again. Rank 0 alone uses this (the commit thread of a background save too, hence the lock).
_KNOWN: dict[str, dict[str, Any]] = {}
_KNOWN_LOCK = threading.Lock()


def _known(path: Target, fact: str, learn, storage_options: Optional[dict] = None) -> Any:
    key = str(path)
    try:
        fingerprint = store_for(path, storage_options).fingerprint(path)
    except FileNotFoundError:
        return learn(path)  # a local checkpoint went away while we looked: nothing worth remembering
    # Any other failure to fingerprint (the store did not answer) is raised: learning without it would remember
    # nothing anyway, and asking the store again would double the wait.
    with _KNOWN_LOCK:
        facts = _facts(key, fingerprint)
        if fact in facts:
            return facts[fact]
    value = learn(path)
    with _KNOWN_LOCK:
        if _KNOWN.get(key, {}).get("fingerprint") == fingerprint:
            _KNOWN[key][fact] = value
    return value


def _facts(key: str, fingerprint: tuple) -> dict[str, Any]:
    """(Under the lock.) What is known of the checkpoint ``key`` as ``fingerprint`` shows it; a new record when it
    changed. A bucket's save that a load verified whole (``"loaded"``: its token) is good as long as COMMIT names it."""
    facts = _KNOWN.get(key)
    if facts is None or facts["fingerprint"] != fingerprint:
        loaded = None if facts is None else facts.get("loaded")
        facts = _KNOWN[key] = {"fingerprint": fingerprint}
        if loaded is not None and tuple(fingerprint[:1]) == (loaded,):
            facts["failure"], facts["loaded"] = None, loaded
    return facts


def commit_order_of(path: Union[str, Path], storage_options: Optional[dict] = None) -> Optional[int]:
    """The commit order ``path`` records (:mod:`~lightning_fsdp.checkpoint.formats.commit_order`), None when it
    records none (a checkpoint written before lightning-fsdp recorded it, or one whose record is unreadable)."""
    store = store_for(path, storage_options)
    return _known(store.target(path), "commit_order", store.commit_order, storage_options)


def step_checkpoints(directory: Union[str, Path], storage_options: Optional[dict] = None) -> list[Target]:
    """The committed checkpoints in ``directory`` (a folder, or a URL) whose names end in a step number, in the
    order they were committed, oldest first (:func:`~lightning_fsdp.checkpoint.formats.commit_order.order_key`: step
    order for checkpoints that record no commit order, and before those that do).

    Only committed checkpoints are listed (:meth:`~lightning_fsdp.checkpoint.io.store.Store.checkpoints_in`): no
    staging copy of a save in flight or killed, no backup, no object of a save without its commit.
    Only the format is checked here (cheap); contents are verified by :func:`verification_failure`.
    """
    store = store_for(directory, storage_options)
    found = []
    for name, entry, _ in store.checkpoints_in(store.target(directory)):
        step = step_of(name)
        if step is None:
            continue
        found.append((order_key(step, commit_order_of(entry, storage_options), name), entry))
    return [entry for _, entry in sorted(found, key=lambda item: item[0])]


def verification_failure(path: Union[str, Path], storage_options: Optional[dict] = None) -> Optional[BaseException]:
    """None when the checkpoint at ``path`` passes verification (every checksum), else the error that says how it
    is damaged. Reads the checkpoint in full the first time this process asks (and again once it changes).

    Raises, and remembers nothing, when the checkpoint could not be read (its store failed within its bound, access
    was refused, it went away while being read): that says nothing of its bytes."""
    store = store_for(path, storage_options)

    def verify(target: Target) -> Optional[BaseException]:
        try:
            store.verify(target)  # False (no checksums, an old checkpoint) still loads: the load notes it
        except Exception as err:  # noqa: BLE001 - damage is returned (and remembered), a failed read is raised
            if could_not_read(err):
                raise
            return err
        return None

    try:
        return _known(store.target(path), "failure", verify, storage_options)
    except Exception as err:  # noqa: BLE001 - damage found while fingerprinting (a COMMIT that does not parse)
        if could_not_read(err):
            raise
        return err  # damage all the same, not remembered: the next look reads it again


def trust(path: Union[str, Path], storage_options: Optional[dict] = None) -> None:
    """Record that the checkpoint at ``path``, as it is now, is good without reading it back: for the one this
    process has just committed (verified as it was written), so that retention right after does not read it again."""
    _learnt(path, None, storage_options)


def _learnt(path: Union[str, Path], failure: Optional[BaseException], storage_options: Optional[dict]) -> None:
    """Remember what this process found out about the checkpoint at ``path`` as it is now: good (``failure``
    None), or damaged. Best effort: a store that does not answer now leaves nothing remembered."""
    store = store_for(path, storage_options)
    try:
        fingerprint = store.fingerprint(target := store.target(path))
    except Exception:  # noqa: BLE001 - an OSError, or damage of the COMMIT itself: nothing to attach it to
        return
    with _KNOWN_LOCK:
        _facts(str(target), fingerprint)["failure"] = failure


_UNKNOWN = object()


def _known_failure(path: Target, storage_options: Optional[dict]) -> Any:
    """What this process remembers of the checkpoint's verification (None: good, an error: damaged), without
    reading it: ``_UNKNOWN`` when nothing is remembered of it as it is now. One COMMIT read for a URL."""
    fingerprint = store_for(path, storage_options).fingerprint(path)
    with _KNOWN_LOCK:
        return _facts(str(path), fingerprint).get("failure", _UNKNOWN)


# The directories whose search for the newest good checkpoint could not read their store, in this process: what is
# there is unknown, so retention (:func:`~lightning_fsdp.checkpoint.retention.prune`) refuses to delete anything until
# a search of that directory succeeds.
_UNREAD: dict[str, str] = {}


def _directory_key(directory: Union[str, Path], storage_options: Optional[dict]) -> str:
    return str(store_for(directory, storage_options).target(directory))


def unread_directory(directory: Union[str, Path], storage_options: Optional[dict] = None) -> Optional[str]:
    """Why the last search of ``directory`` for its newest good checkpoint, in this process, could not read the store
    (None when it could, or there was none): retention there must not delete anything until a search succeeds."""
    key = _directory_key(directory, storage_options)
    with _KNOWN_LOCK:
        return _UNREAD.get(key)


def unread_directories() -> dict[str, str]:
    """The directories (and why) whose last search for their newest good checkpoint here could not read the store."""
    with _KNOWN_LOCK:
        return dict(_UNREAD)


def newest_good_checkpoint(directory: Union[str, Path], storage_options: Optional[dict] = None) -> Optional[Target]:
    """The checkpoint committed last in ``directory`` that passes verification (every checksum), or None.

    Each one committed later that is damaged (bytes read and found wrong) is skipped with a warning naming it and
    the reason. A store that could not be read is no damage: the search raises (``ConnectionError``, or the
    ``PermissionError`` of refused access), naming the URL, within the store's bound for the whole search, and
    retention in ``directory`` is off in this process until a search of it succeeds. Reads each checked checkpoint in
    full (once per process), so call it on one rank and share the answer (:func:`find_newest_on_rank_zero`).
    """
    with _search(_directory_key(directory, storage_options)) as at:
        for at.candidate in reversed(step_checkpoints(directory, storage_options)):
            err = verification_failure(at.candidate, storage_options)
            if err is None:
                return at.candidate
            _warn_skipped(at.candidate, err)
    return None


@contextlib.contextmanager
def _search(key: str) -> Iterator[Any]:
    """One search of the directory ``key`` (``at.candidate``: what it reads now), under one bound for every store
    call: a store that could not be read is raised as such and turns retention there off; damage goes on up."""
    at = SimpleNamespace(candidate=None)
    try:
        with one_budget():
            yield at
    except Exception as err:  # noqa: BLE001 - a failed read of the store is raised as such; damage goes on up
        if not could_not_read(err):
            raise
        raise _unread(key, at.candidate, err) from err
    with _KNOWN_LOCK:
        _UNREAD.pop(key, None)


def _warn_skipped(candidate: Target, err: BaseException) -> None:
    warnings.warn(
        f"Skipping the checkpoint {str(candidate)!r}: it fails verification ({type(err).__name__}: {err}). Resuming"
        " from the one committed before it. HINT: delete or move it once you have looked at it.",
        stacklevel=3,
    )


def _unread(directory: str, candidate: Optional[Target], err: BaseException) -> BaseException:
    """The error of a search whose store could not be read; records that retention must not run."""
    where = f"the checkpoint {str(candidate)!r}" if candidate is not None else f"the directory {directory!r}"
    cause = f"{type(err).__name__}: {err}"
    with _KNOWN_LOCK:
        _UNREAD[directory] = cause
    hint = "" if "HINT" in cause else (f" HINT: run again once the store answers (an unreachable store is retried"
                                       f" for at most {_bound()} s in all; {TIMEOUT_VARIABLE} sets it).")
    text = (f"Could not read {where} while finding the newest good checkpoint in {directory!r}: it was not taken for"
            " damaged, nothing older was chosen instead, and retention there is off in this process until a search of"
            f" that directory succeeds; do not start the run from scratch. ({cause}){hint}")
    return PermissionError(err.errno, text) if isinstance(err, PermissionError) else ConnectionError(text)


def _bound() -> str:
    try:
        return f"{store_timeout_s():g}"
    except ValueError:
        return "?"


def find_newest_on_rank_zero(directory: Union[str, Path], comm, storage_options: Optional[dict] = None,
                             check_first: Optional[Target] = None) -> Optional[str]:
    """:func:`newest_good_checkpoint` on rank 0, as a string (None when there is none), the same on every rank. Its
    error, too, is raised on every rank: the others wait in one agreement while rank 0 searches, and rank 0's search
    fails within the store's bound when the store does not answer, so no rank waits into the process group's
    timeout. ``check_first``: a path returned as it is when it exists (``<dir>/latest`` written by the user)."""
    def search() -> Optional[str]:
        found = newest_good_checkpoint(directory, storage_options)
        return None if found is None else str(found)

    return _on_rank_zero(directory, comm, storage_options, check_first, search, lambda found: str(found))


def _on_rank_zero(directory: Union[str, Path], comm, storage_options: Optional[dict], check_first: Optional[Target],
                  search: Any, as_found: Any) -> Any:
    """``search()`` on rank 0 (or ``as_found(check_first)`` when that exists), agreed and broadcast."""
    store = store_for(directory, storage_options)

    def find() -> Any:
        if comm.global_rank != 0:
            return None
        if check_first is not None:
            try:
                if store.exists(check_first):
                    return as_found(check_first)
            except Exception as err:  # noqa: BLE001 - as the search's own failures
                if not could_not_read(err):
                    raise
                raise _unread(str(directory), None, err) from err
        return search()

    mine = together(comm, f"Finding the newest good checkpoint in {str(directory)!r}", find)
    return comm.broadcast(mine)


def resolve_latest(path: Union[str, Path], comm, storage_options: Optional[dict] = None) -> Target:
    """``path`` itself, unless it is ``<dir>/latest`` and no such entry exists: then the newest good checkpoint in
    ``<dir>``, found by rank 0 and broadcast, so every rank loads the same one. Raises ``FileNotFoundError`` on
    every rank when ``<dir>`` holds none. ``<dir>`` may be a URL: its commits decide."""
    store = store_for(path, storage_options)
    path = store.target(path)
    if store.name(path) != LATEST:
        return path
    directory = store.parent(path)
    found = find_newest_on_rank_zero(directory, comm, storage_options, check_first=path)
    if found is None:
        raise _none_to_resume(directory, path)
    return store.target(found)


def _none_to_resume(directory: Target, path: Target) -> FileNotFoundError:
    return FileNotFoundError(
        f"No complete checkpoint to resume from in {str(directory)!r} (asked for {str(path)!r}): it holds no"
        " checkpoint whose name ends in a step number, or none passes verification. HINT: save into that"
        " directory with step numbers in the names, like `fabric.save(f'{dir}/step-{step:08d}', state)`, or start"
        " from scratch when nothing is there yet (`StepCheckpoints.resume` returns None then)."
    )


# --- `<dir>/latest` for a load from object storage: verified by the load itself (issue 43) ---------------------------


def load_candidates(path: Union[str, Path], comm, storage_options: Optional[dict] = None) -> list[Target]:
    """What a load of ``path`` tries, in order, the same on every rank: ``[path]`` itself, unless it is
    ``<dir>/latest`` and no such entry exists. Then, for a directory on the local disk, the newest good checkpoint
    there (:func:`resolve_latest`: verified before the load, as always); for a directory of object storage, every
    committed step checkpoint there, newest (by commit) first, found from their COMMITs alone, less those this process
    already knows to be damaged. None of those is read first: verifying the newest and then loading it would move its
    bytes twice. The load verifies every item it reads, and damage found there makes it go on to the next one
    (:func:`fall_back`), so ``latest`` is still the newest checkpoint that verifies."""
    store = store_for(path, storage_options)
    path = store.target(path)
    if store.name(path) != LATEST:
        return Candidates([path])
    if not store.remote:
        return Candidates([resolve_latest(path, comm, storage_options)])
    directory = store.parent(path)
    found = _on_rank_zero(directory, comm, storage_options, path, lambda: _newest_first(directory, storage_options),
                          lambda found: None)
    if found is None:  # `<dir>/latest` itself is a checkpoint
        return Candidates([path])
    if not found:
        raise _none_to_resume(directory, path)
    return Candidates([store.target(entry) for entry in found], latest=path)


def step_candidates(directory: Union[str, Path], comm, storage_options: Optional[dict] = None) -> "Candidates":
    """The committed step checkpoints in a bucket's ``directory``, newest first, as a load of ``<dir>/latest`` tries
    them (whatever ``<dir>/latest`` holds): the same on every rank, empty when none (``StepCheckpoints.resume``)."""
    store, key = store_for(directory, storage_options), store_for(directory, storage_options).target(directory)
    found = _on_rank_zero(key, comm, storage_options, None, lambda: _newest_first(key, storage_options), None)
    return Candidates([store.target(entry) for entry in found], latest=store.child(key, LATEST))


class Candidates(list):
    """The checkpoints a load tries, in order; ``latest``: the ``<dir>/latest`` they stand for (None: a path)."""

    def __init__(self, entries: list[Target], latest: Optional[Target] = None) -> None:
        super().__init__(entries)
        self.latest = latest


def _newest_first(directory: Target, storage_options: Optional[dict]) -> list[str]:
    """The committed step checkpoints in ``directory``, newest first, skipping (with the warning) those known to be
    damaged until the first one not known so; a store that cannot be read fails as :func:`newest_good_checkpoint`
    does, and turns retention there off."""
    found: list[str] = []
    with _search(_directory_key(directory, storage_options)) as at:
        for at.candidate in reversed(step_checkpoints(directory, storage_options)):
            if not found:
                failure = _known_failure(at.candidate, storage_options)
                if failure is not _UNKNOWN and failure is not None:
                    _warn_skipped(at.candidate, failure)
                    continue
            found.append(str(at.candidate))
    return found


def fall_back(candidates: list[Target], err: BaseException, comm, storage_options: Optional[dict] = None) -> Target:
    """After the load of ``candidates[0]`` (:func:`load_candidates`, :func:`step_candidates`) failed on every rank
    with ``err``: the next candidate (the failed one is popped from the list), or an error raised.

    Only the candidates of ``<dir>/latest`` fall back, and only for damage (a :class:`ChecksumError`): the damaged one
    is warned about (rank 0) and remembered; none left: the ``FileNotFoundError`` of a ``latest`` with none that
    verifies. A store that could not be read is raised as the search raises it (retention there off meanwhile). The
    failed attempt may have written part of the damaged checkpoint into the live tensors, so the next one is taken
    only when it holds every tensor entry the damaged one holds (their ``.metadata`` or zip index: no tensor is
    read); otherwise the damage is raised with a HINT to load a checkpoint by its path."""
    latest = getattr(candidates, "latest", None)
    if latest is not None and could_not_read(err):  # as the search says it: retention there stays off meanwhile
        key = _directory_key(store_for(candidates[0], storage_options).parent(candidates[0]), storage_options)
        raise _unread(key, candidates[0], err) from err
    if latest is None or not isinstance(err, ChecksumError):
        raise err
    failed = candidates.pop(0)
    directory = store_for(failed, storage_options).parent(failed)
    if comm.global_rank == 0:
        _warn_skipped(failed, err)
        _learnt(failed, err, storage_options)
    if not candidates:  # every one is damaged: as when the search before a load found none that verifies
        raise _none_to_resume(directory, latest) from err

    def check() -> list[str]:
        if comm.global_rank != 0:
            return []
        with one_budget():
            needed = _entries(failed, storage_options)
            held = _entries(candidates[0], storage_options) if needed else None
        # Unreadable entries of the damaged one: its load stopped before it wrote any tensor. Of the next one: its
        # load stops so too, and is damage in turn.
        return [] if needed is None or held is None else sorted(needed - held)

    missing = comm.broadcast(together(comm, f"Falling back from the damaged checkpoint {str(failed)!r}", check))
    if missing:
        raise ChecksumError(
            f"The newest checkpoint in {str(directory)!r}, {str(failed)!r}, is damaged ({err}), found while loading it"
            f" for `latest`; the one committed before it, {str(candidates[0])!r}, lacks entries the failed load may"
            f" already have written into the state ({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}),"
            " so falling back to it would leave damaged values there. HINT: load a checkpoint by its path, e.g."
            f" {str(candidates[0])!r}, into a freshly built model and optimizer; and delete or move the damaged one."
        ) from err
    return candidates[0]


def _entries(path: Target, storage_options: Optional[dict]) -> Optional[set[str]]:
    """The tensor entries the committed checkpoint at ``path`` holds, from its small records alone; None when they
    cannot be read as a load would (damaged)."""
    store = store_for(path, storage_options)
    target = str(store.target(path))
    try:
        record = store.read_commit(target)
    except ChecksumError:
        return None
    if record is None:
        return None
    objects = CommittedObjects(store.fs, target, record, retry=lambda step: retrying(store.fs, target, "reading", step))
    with contextlib.suppress(ChecksumError):
        return entry_names(objects)
    return None


@contextlib.contextmanager
def trusted_when_verified(path: Target, source: Any, comm, storage_options: Optional[dict] = None) -> Iterator[None]:
    """Around the load of ``path`` (opened at the local ``source``, a sharded checkpoint in a bucket): when it succeeds
    and the ranks' readers together checked every item ``checksums.json`` lists against its digest (one all-reduce MAX
    of one byte per item; items read in part do not count), rank 0 remembers it as good, by its save's token, so that
    retention does not read it back."""
    remote = remote_objects(source)
    try:
        yield
        if remote is None or remote.kind != "sharded" or not (Path(source) / CHECKSUMS_FILENAME).is_file():
            return  # the same on every rank: the small objects were broadcast
        noted = verified_items(source)  # None on a rank that read nothing: the keys from the file, none checked
        keys, mine = noted or (sorted((i[0], i[1]) for i in json.loads((Path(source) / CHECKSUMS_FILENAME)
                                                                          .read_bytes())["items"]), set())
        grouped = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        nccl = grouped and dist.get_backend() == "nccl"
        seen = torch.tensor([key in mine for key in keys], dtype=torch.uint8,
                            device=torch.device("cuda", torch.cuda.current_device()) if nccl else "cpu")
        if grouped:
            dist.all_reduce(seen, op=dist.ReduceOp.MAX)
        if comm.global_rank == 0 and keys and bool(seen.all()):
            # Remembered without a request: the next look at it reads its COMMIT anyway (its fingerprint), and finds
            # it good while that COMMIT names this save.
            with _KNOWN_LOCK:
                facts = _KNOWN.setdefault(str(store_for(path, storage_options).target(path)), {"fingerprint": None})
                facts["loaded"] = remote.prefix.rsplit("/.", 1)[-1]
                if tuple(facts["fingerprint"] or ())[:1] == (facts["loaded"],):
                    facts.setdefault("failure", None)  # damage found otherwise (its COMMIT's digests) still counts
    finally:
        verified_items(source)  # forgotten, however the load ended
