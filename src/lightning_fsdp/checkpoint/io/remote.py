"""Checkpoints on any fsspec filesystem (S3, GCS, Azure, ``memory://``), committed by one small object written last.

Object stores have no atomic rename, so the local design (write aside, then rename) does not carry over. What they
do have: a single-object PUT is atomic (a reader sees the old object or the new one), and S3 and moto honour
conditional writes (``If-None-Match: *`` creates only if absent, ``If-Match: <etag>`` replaces only the version read).

Layout of a checkpoint at ``U`` (either format)::

    U/.<token>/...       the save's objects, under a prefix of its own (the token: one per save, agreed by all ranks)
    U/COMMIT             json, written last: the token, every object with its size (small ones with an xxh3 digest),
                         the kind (full or sharded), the commit-order key, the time

A save (:meth:`FsspecStore.commit`): rank 0 notes COMMIT's version when the save begins (``check_target``); each rank
uploads its staged files under ``U/.<token>/`` (several in flight per rank); every rank's outcome is agreed; rank 0
checks that every object is there with its size, then writes ``COMMIT`` only if it is still the version noted (or
absent), so of two saves to one URL the later committer fails clearly; only then are the objects of the one token
the replaced COMMIT named deleted, and stale leftovers (:mod:`.remote_clean`: exact keys, never a pattern). A reader
(:meth:`FsspecStore.open_committed`) reads ``COMMIT`` and then only the objects it names, checks their sizes, and runs
the same integrity checks as for a local checkpoint. A save that dies before its ``COMMIT`` changes nothing a reader
sees: it can never produce a load that mixes two saves. Listings are used only to find candidates and leftovers,
never to decide what is committed.
"""

from __future__ import annotations

import contextlib
import errno
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Union

import torch.distributed as dist

from lightning_fsdp.checkpoint.formats.commit_order import COMMIT_ORDER_KEY, NEW, commit_order_value, order_to_record
from lightning_fsdp.checkpoint.formats.commit_record import COMMIT_NAME, build_record, encode_record, parse_record
from lightning_fsdp.checkpoint.integrity.agreement import CheckpointError, Communicator, together
from lightning_fsdp.checkpoint.integrity.digests import ChecksumError
from lightning_fsdp.checkpoint.integrity.stream_verify import verify_objects
from lightning_fsdp.checkpoint.io.conditional import lost_race, put_if, version_of
from lightning_fsdp.checkpoint.io.one_process import OneProcess
from lightning_fsdp.checkpoint.io import remote_clean, remote_download, remote_upload
from lightning_fsdp.checkpoint.io.remote_ops import RemoteOps
from lightning_fsdp.checkpoint.io.remote_clean import (Swept, changed_while_read, load_prefix, remove_token,
                                                       remove_stale_staging_once, side_by_side, staging_root,
                                                       token_of_staging)
from lightning_fsdp.checkpoint.io.remote_errors import renamed as _renamed, explain, one_budget, retrying
from lightning_fsdp.checkpoint.io.remote_windows import CommittedObjects
from lightning_fsdp.checkpoint.io.urls import EXTRAS, basename, filesystem, join, normalize, parent, split_url

__all__ = ["FsspecStore", "COMMIT_NAME", "clean"]

# COMMITs of a directory read at once: each read is one small GET that mostly waits on the store.
_COMMIT_READERS = 8
# Buckets this process has seen exist, per filesystem (its fsspec token) and bucket: a save checks once, not on every
# save. A bucket deleted later still fails the upload, which then names the missing bucket (`commit`).
_BUCKETS_SEEN: set[tuple[Any, ...]] = set()


class FsspecStore(RemoteOps):  # RemoteOps: the plain-file operations of the Store interface, and `clean`
    remote = True

    def __init__(self, protocol: str, storage_options: Optional[dict[str, Any]]) -> None:
        self.protocol, self.options = protocol, storage_options
        self._fs: Any = None
        # Per target, what its save in flight began from (rank 0): COMMIT's version then, and the token it named.
        self._saves: dict[str, dict[str, Any]] = {}

    @property
    def fs(self) -> Any:
        if self._fs is None:
            self._fs = filesystem(f"{self.protocol}://", self.options)
        return self._fs

    # --- naming ---------------------------------------------------------------------------------------------

    def target(self, path: Union[str, Path]) -> str:
        return normalize(str(path)).rstrip("/")  # `S3://b/x` is `s3://b/x`, not a bucket named `S3:`

    def display(self, path: Any) -> str:
        return str(path)

    def name(self, path: Any) -> str:
        return _leaf(str(path))

    def parent(self, path: Any) -> str:
        return parent(self.target(path))

    def child(self, directory: Any, name: str) -> str:
        return join(self.target(directory), name)

    def fingerprint(self, path: Any) -> tuple:
        """The save its COMMIT names: a new save there is a new token (one GET)."""
        try:
            record = self.read_commit(self.target(path))
        except ChecksumError as err:  # damaged: what is remembered about it holds until its COMMIT changes
            return ("damaged", str(err))
        return () if record is None else (record["token"], record.get(COMMIT_ORDER_KEY))

    def commit_order(self, path: Any) -> Optional[int]:
        try:
            return commit_order_value(self.read_commit(self.target(path)))
        except ChecksumError:  # a damaged COMMIT records no order it can be trusted for: it sorts first
            return None

    def verify(self, path: Any) -> bool:
        """Check the committed checkpoint at ``path`` against its checksums in one pass over its objects, streamed
        in windows with several in flight: no local copy, a few windows of memory (:mod:`.remote_windows`), the
        verdicts and messages of the local verification (:mod:`~lightning_fsdp.checkpoint.integrity.stream_verify`).
        Every request shares one bound (``LFSDP_STORE_TIMEOUT_S``), and a failed one is retried alone."""
        target = self.target(path)
        with one_budget():
            record = self.read_commit(target)
            if record is None:
                missing = self._retrying(target, "reading", lambda: self._missing_bucket(target))
                raise missing or FileNotFoundError(
                    errno.ENOENT, f"{target!r} holds no committed checkpoint (no {COMMIT_NAME} object there: nothing"
                    " was saved, or the save did not finish). HINT: pass the URL a save wrote, or an earlier"
                    " checkpoint.")
            if record.get("kind") == "sharded":
                remote_download.check_sharded(record, target)  # as a load refuses it, before anything is read
            objects = CommittedObjects(self.fs, target, record,
                                       retry=lambda step: self._retrying(target, "downloading", step))
            return verify_objects(objects)

    @contextlib.contextmanager
    def local_copy(self, path: Union[str, Path]) -> Iterator[Path]:
        with self.open_committed(path, OneProcess(), whole=True) as local:
            yield local

    def staging(self, target: Any, token: str, rank: int) -> Path:
        remove_stale_staging_once()  # what killed saves and loads of this host left (their process is gone)
        root = staging_root(token, rank)
        root.mkdir(parents=True, exist_ok=True)
        return root / (basename(str(target)) or "checkpoint")

    def flush(self, staged: Path) -> None:
        """Nothing: the upload reads the staged files, and the store keeps them once the commit is written."""

    # --- saving ---------------------------------------------------------------------------------------------

    def check_target(self, target: Any, rank: int) -> None:
        if rank != 0:
            return
        # The checks and COMMIT's version side by side (independent round trips); a failed check is raised first.
        _, self._saves[target] = side_by_side(lambda step: self._retrying(target, "checking", step),
                                              [lambda: self._check_target(target), lambda: self._begin(target)], 2)

    def _begin(self, target: str) -> dict[str, Any]:
        """What a save to ``target`` begins from: COMMIT's version now, the condition of its PUT (so a save committed
        there meanwhile makes this one fail, issue 42), and the token that version names (removed once replaced)."""
        version = version_of(self.fs, join(target, COMMIT_NAME))
        replaced = None
        if version is not None:
            with contextlib.suppress(CheckpointError, ValueError):  # a damaged COMMIT: its objects go once stale
                record = self.read_commit(target)
                replaced = None if record is None else record["token"]
        return {"version": version, "replaced": replaced}

    def _missing_bucket(self, target: str) -> Optional[FileNotFoundError]:
        """The error to raise when ``target``'s bucket does not exist, else None (also for stores without buckets).
        Not ``fs.exists``: it answers False for an unreachable endpoint too, which is no missing bucket."""
        if self.protocol not in EXTRAS:
            return None
        bucket = split_url(target)[1].split("/", 1)[0]
        try:
            self.fs.info(f"{self.protocol}://{bucket}")
        except FileNotFoundError:
            _BUCKETS_SEEN.discard(self._bucket_key(target))  # set.discard and set.add are atomic under the GIL
            return FileNotFoundError(errno.ENOENT, f"The bucket {bucket!r} of {target!r} does not exist (or these"
                                     " credentials cannot see it). HINT: create it (e.g. `aws s3 mb"
                                     f" {self.protocol}://{bucket}`), or fix the checkpoint URL.")
        _BUCKETS_SEEN.add(self._bucket_key(target))
        return None

    def _bucket_key(self, target: str) -> tuple[Any, ...]:
        """Which bucket of which store: the filesystem's fsspec token says protocol, endpoint and credentials."""
        return (self.protocol, getattr(self.fs, "_fs_token", None) or id(self.fs), split_url(target)[1].split("/")[0])

    def _check_target(self, target: str) -> None:
        fs = self.fs
        fs.invalidate_cache()
        if self.protocol in EXTRAS and self._bucket_key(target) not in _BUCKETS_SEEN:
            missing = self._missing_bucket(target)
            if missing is not None:
                raise missing
        try:  # "a file?" and "anything there?" in one answer: a HEAD and a LIST for a new target (was four requests)
            kind = fs.info(target).get("type")
        except FileNotFoundError:
            return
        if kind == "file":
            raise FileExistsError(errno.EEXIST, f"{target!r} is an existing object that is not a checkpoint, so it"
                                  " is left untouched. HINT: choose another path, or remove it yourself.")
        try:
            names = [_leaf(n) for n in fs.ls(target, detail=False)]
        except FileNotFoundError:
            return
        foreign = [n for n in names if n != COMMIT_NAME and not n.startswith(".")]
        if foreign:
            raise IsADirectoryError(errno.EISDIR, f"{target!r} holds objects no checkpoint save wrote"
                                    f" ({', '.join(sorted(foreign)[:5])}), and a checkpoint there would hide them."
                                    " HINT: choose another path, or move those objects elsewhere.")

    def commit(self, staged: Any, target: Any, comm: Communicator, group: Any = None,
               failure: Optional[BaseException] = None, commit_order: Union[int, None, str] = NEW) -> None:
        """Upload every rank's staged files, agree that all arrived, then rank 0 writes COMMIT. ``failure``: this
        rank's write failed (a background save); it still takes part, so no rank waits for it. ``commit_order``:
        what COMMIT records (a convert keeps its source's, see ``commit_order.NEW``)."""
        staged, target = Path(staged), str(target)
        token = _token_of(staged)

        def upload() -> dict[str, list]:
            if failure is not None:
                raise failure
            if comm.global_rank == 0 and target not in self._saves:  # a commit with no check_target before it
                self._saves[target] = self._retrying(target, "checking", lambda: self._begin(target))
            try:
                return self._retrying(target, "uploading to", lambda: self._upload(staged, target, token))
            except Exception as err:  # the bucket, checked once per process, may be gone since: say so
                missing = None
                with contextlib.suppress(Exception):
                    missing = self._missing_bucket(target)
                if missing is None:
                    raise
                raise missing from err

        try:
            mine = together(comm, f"Uploading the checkpoint to {target!r}", upload)
            objects: dict[str, list] = {}
            for part in _gather(mine, group):
                objects.update(part)
            kind = "sharded" if staged.is_dir() else "full"  # rank 0's staged save says (only rank 0 commits)
            together(comm, f"Committing the checkpoint {target!r}",
                     lambda: self._write_commit(target, token, objects, kind, commit_order)
                     if comm.global_rank == 0 else None)
        except BaseException:
            if comm.global_rank == 0:
                with contextlib.suppress(Exception):  # best effort: `clean` and later saves remove them once stale
                    self._remove_uncommitted(target, token)
            raise
        finally:
            self.discard(staged, comm.global_rank)
            begun = self._saves.pop(target, None) if comm.global_rank == 0 else None
        if comm.global_rank == 0:
            with contextlib.suppress(Exception):  # committed; leftovers are removed by the next save or `clean`
                self._after_commit(target, begun)

    def commit_in_background(self, staged: Path, target: Any, comm: Any, failure: Optional[BaseException]) -> None:
        self.commit(staged, target, comm, group=getattr(comm, "process_group", None), failure=failure)

    def _upload(self, staged: Path, target: str, token: str) -> dict[str, list]:
        return remote_upload.upload(self.fs, staged, target, token)

    def _write_commit(self, target: str, token: str, objects: dict[str, list], kind: str,
                      commit_order: Union[int, None, str] = NEW) -> None:
        payload = encode_record(build_record(token, kind, basename(target), objects, order_to_record(commit_order)))
        url = join(target, COMMIT_NAME)
        self._retrying(target, "committing", lambda: self._put_commit(url, payload))

    def _put_commit(self, url: str, payload: bytes) -> None:
        """PUT COMMIT only if it is still the version this save began with, and only once every object it names is
        there with its size: a COMMIT never names objects that are gone (issue 42)."""
        target = url.rsplit("/", 1)[0]
        begun = self._saves.get(target) or self._saves.setdefault(target, self._begin(target))
        record = json.loads(payload)
        remote_clean.check_uploaded(self.fs, target, record["token"], record["objects"])
        try:
            put_if(self.fs, url, payload, begun["version"])
        except FileExistsError as err:
            current = self._current(target)
            if current is not None and current["token"] == record["token"]:
                return  # an earlier attempt of this PUT landed, and its answer was lost
            raise lost_race(target, current) from err

    def _current(self, target: str) -> Optional[dict[str, Any]]:
        """The COMMIT there now, or None (none, or unreadable)."""
        with contextlib.suppress(Exception):
            return self.read_commit(target)
        return None

    def _remove_uncommitted(self, target: str, token: str) -> None:
        """A failed save's objects, unless the COMMIT there names them (a PUT that landed, answered by an error)."""
        current = self.read_commit(target)
        if current is None or current["token"] != token:
            remove_token(self.fs, target, token)

    def _after_commit(self, target: str, begun: Optional[dict[str, Any]]) -> None:
        """Remove the one token the COMMIT this save replaced named (a token is committed by one save only), then
        stale leftovers; never what the COMMIT there now names (re-read: another save may have committed since)."""
        current = self.read_commit(target)
        committed = None if current is None else current["token"]
        remote_clean.sweep(self.fs, target, committed, remote_clean.GRACE_S, replaced=(begun or {}).get("replaced"))

    def discard(self, staged: Path, rank: int) -> None:
        shutil.rmtree(Path(staged).parent, ignore_errors=True)

    # --- reading --------------------------------------------------------------------------------------------

    def read_commit(self, target: str) -> Optional[dict[str, Any]]:
        """What ``target``'s COMMIT records, checked field by field (:func:`parse_record`), or None when there is
        none (no checkpoint, or one never committed). A COMMIT that is not a record a save wrote (cut short, flipped,
        edited, crafted) is damage: a ``ChecksumError`` naming its URL, raised before anything it names is fetched,
        and never retried (retrying reads the same bytes)."""
        from lightning_fsdp.checkpoint.formats.commit_record import CommitRecordError
        from lightning_fsdp.checkpoint.integrity.agreement import CheckpointError
        from lightning_fsdp.checkpoint.integrity.digests import ChecksumError

        def read() -> Optional[dict[str, Any]]:
            url = join(target, COMMIT_NAME)
            try:
                payload = self.fs.cat_file(url)
            except FileNotFoundError:
                return None
            try:
                return parse_record(payload, url)
            except CommitRecordError as err:  # its message names the URL and the fix; a newer record is no damage
                if err.damage:
                    raise ChecksumError(str(err)) from err
                raise CheckpointError(str(err)) from err
        return self._retrying(target, "reading", read)

    @contextlib.contextmanager
    def open_committed(self, path: Union[str, Path], comm: Communicator, *, whole: bool = False) -> Iterator[Path]:
        """A local folder (or file) to read the committed checkpoint at ``path`` from, for the time of the block.

        A sharded checkpoint (issue 43): rank 0 reads COMMIT and the small objects (``.metadata``,
        ``checksums.json``, ``meta.pt``), checks them against COMMIT's sizes and digests, and broadcasts their bytes;
        every rank writes them into a new "skeleton" folder, so the checks that read a folder work as for a local
        checkpoint, and the shard files stay in the bucket: :mod:`.remote_source` says where, and the load reads
        each rank's own byte ranges of them. One GET per small object in all, whatever the world size.
        A full checkpoint: nothing is fetched here; ``local`` is the file's place (never written), registered the
        same way, and the one rank that reads the file reads it by ranges (:mod:`.remote_full`), the others nothing.
        ``whole=True`` (a local copy for inspect, convert and verify) downloads every object.

        One retry budget (:func:`.remote_errors.one_budget`) for all that the load asks of the store: COMMIT, the
        small objects and every ranged GET, those in flight on pool threads too (they run in a copy of this
        context), so an outage fails the load within ``LFSDP_STORE_TIMEOUT_S``, not once per request."""
        with one_budget(), self._open_committed(path, comm, whole) as local:
            yield local

    @contextlib.contextmanager
    def _open_committed(self, path: Union[str, Path], comm: Communicator, whole: bool) -> Iterator[Path]:
        from lightning_fsdp.checkpoint.io.remote_source import RemoteObjects, registered

        target = self.target(path)

        def read() -> Optional[tuple[dict[str, Any], Optional[dict[str, bytes]]]]:
            if comm.global_rank != 0:
                return None
            record = self.read_commit(target)
            missing = None if record is not None else self._retrying(target, "reading",
                                                                     lambda: self._missing_bucket(target))
            if missing is not None:
                raise missing
            if record is None:
                raise FileNotFoundError(errno.ENOENT, f"{target!r} holds no committed checkpoint (no"
                                        f" {COMMIT_NAME} object there: nothing was saved, or the save did not finish)."
                                        " HINT: pass the URL a save wrote, or an earlier checkpoint.")
            if record.get("kind") == "sharded":
                # Before anything is fetched, on rank 0: raised on every rank (`together`), so `latest` falls back
                # past a COMMIT that names what no save writes, or gives a small object more than any save writes.
                remote_download.check_sharded(record, target)
            if not whole and record.get("kind") == "full":
                return record, {}  # nothing fetched here: the reading rank reads the file by ranges (remote_full)
            # A sharded record naming no `.metadata` is no DCP checkpoint that ranges could be read from: fetched
            # whole, as before, so its load says what it is.
            if whole or record.get("kind") != "sharded" or ".metadata" not in record["objects"]:
                return record, None
            return record, self._retrying(target, "downloading",
                                          lambda: remote_download.fetch_small(self.fs, target, record))

        record, small = comm.broadcast(together(comm, f"Opening the checkpoint {target!r}", read))
        root = Path(tempfile.mkdtemp(prefix=load_prefix()))
        local = root / (record.get("name") or "checkpoint")
        try:
            if small is None:
                together(comm, f"Downloading the checkpoint {target!r}",
                         lambda: self._retrying(target, "downloading", lambda: self._download(target, record, local)))
                opened: Any = contextlib.nullcontext()
            else:
                if record["kind"] == "sharded":
                    together(comm, f"Opening the checkpoint {target!r}",
                             lambda: remote_download.write_skeleton(record, small, local, target))
                objects = {name: (size, digest) for name, (size, digest) in record["objects"].items()}
                opened = registered(RemoteObjects(
                    self.fs, target, join(target, "." + record["token"]), record["kind"], objects, local,
                    retry=lambda step: self._retrying(target, "downloading", step)))
            with opened:
                try:
                    yield local
                except Exception as err:
                    # The message names the URL, not the temporary copy: this rank's, and another rank's (an error
                    # agreed across ranks carries the words of the rank that failed, whose folder has another name).
                    import re

                    other = re.compile(r"(?:/[^/'\"\s]+)*/lightning-fsdp-load-h[0-9a-f]{8}-p\d+-[A-Za-z0-9_]+/"
                                       + re.escape(local.name))
                    err.args = tuple(other.sub(target, a) if isinstance(a, str) else a for a in err.args)
                    raise _renamed(err, str(local), target)
        finally:
            shutil.rmtree(root, ignore_errors=True)

    def _download(self, target: str, record: dict[str, Any], local: Path) -> None:
        remote_download.download(self.fs, target, record, local)

    # --- listing and removing -------------------------------------------------------------------------------

    def exists(self, path: Any) -> bool:
        return self.read_commit(self.target(path)) is not None

    def remove(self, target: Any) -> None:
        """Remove a checkpoint: its COMMIT first (it is then gone for every reader), then the objects of the save it
        named, then stale leftovers of other saves: exact keys, nothing else under it (:mod:`.remote_clean`)."""
        target, fs, record = self.target(target), self.fs, None
        url = join(target, COMMIT_NAME)
        version = version_of(fs, url)
        with contextlib.suppress(ChecksumError):  # damaged: its objects go once stale; a newer release's is raised
            record = self.read_commit(target)
        if version_of(fs, url) != version:  # another save committed here meanwhile: its checkpoint is not ours
            raise lost_race(target, self.read_commit(target))
        with contextlib.suppress(FileNotFoundError):
            fs.rm_file(url)
        remote_clean.remove_rest(fs, target, None if record is None else record["token"])

    def checkpoints_in(self, directory: Any) -> list[tuple[str, str, dict]]:
        """The committed checkpoints directly in ``directory``: the listing names candidates (a fresh one, not a
        cached one), and each one's COMMIT decides."""
        directory = self.target(directory)
        fs = self.fs
        fs.invalidate_cache()
        try:
            entries = self._retrying(directory, "listing", lambda: fs.ls(directory, detail=False))
        except FileNotFoundError:
            return []
        names = [name for name in map(_leaf, entries) if not name.startswith(".") and name != COMMIT_NAME]

        def record_of(url: str) -> Optional[dict[str, Any]]:
            try:
                return self.read_commit(url)
            except ChecksumError as err:  # damaged: still a candidate, which `latest` skips and names as damaged
                return {"damaged": str(err)}  # (a newer release's COMMIT is raised: this one cannot order it)

        urls = [join(directory, name) for name in names]
        # Side by side on a few threads (each a small GET that waits on the store), under one retry budget: every
        # thread runs in a copy of this context, so its retries spend the budget set here. Any error is raised for
        # the first checkpoint in listing order that failed, as reading them one after another would.
        with one_budget():
            records = side_by_side(record_of, urls, _COMMIT_READERS)
        return [(name, url, record) for name, url, record in zip(names, urls, records) if record is not None]

    # --- errors ---------------------------------------------------------------------------------------------

    def _retrying(self, target: str, what: str, step: Callable[[], Any]) -> Any:
        if what == "downloading":
            step = self._noticing_changes(target, step)
        return retrying(self.fs, target, what, step)

    def _noticing_changes(self, target: str, step: Callable[[], Any]) -> Callable[[], Any]:
        """``step``, where an object gone while a load fetched it is said for what it is (issue 45): the checkpoint
        was replaced or removed meanwhile (the COMMIT there now names objects that are all there, or there is none),
        or it is damaged (its own COMMIT names objects that are gone)."""
        def run() -> Any:
            try:
                return step()
            except FileNotFoundError as err:
                if err.errno is not None:
                    raise  # ours, already said
                raise changed_while_read(self.fs, target, self._current(target)) from err
        return run

    def explain(self, err: BaseException, target: str, what: str) -> BaseException:
        return explain(err, target, what)


def clean(url: str, storage_options: Optional[dict[str, Any]] = None, grace_s: Optional[float] = None) -> Swept:
    """Remove what saves that never committed left at the checkpoint ``url`` (``lightning-fsdp clean URL``): the
    token prefixes no COMMIT names whose newest object (and multipart upload) is older than ``grace_s`` (default
    :data:`.remote_clean.GRACE_S`) by the store's clock, with their incomplete multipart uploads. The committed
    checkpoint, younger tokens (a save may still be uploading) and every object no save of this project wrote stay.
    Returns what was removed (``.kept``: the younger tokens; ``.found``: whether any token was there)."""
    return FsspecStore(split_url(url)[0], storage_options).clean(url, grace_s)  # the Store method: remote_ops.py


def _leaf(listed: str) -> str:
    """The last name of a path a listing gave (with or without the protocol)."""
    return listed.rstrip("/").rsplit("/", 1)[-1]


def _token_of(staged: Path) -> str:
    return token_of_staging(staged.parent)


def _gather(mine: Any, group: Any) -> list[Any]:
    if not (dist.is_available() and dist.is_initialized()):
        return [mine]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, mine, group=group)
    return out
