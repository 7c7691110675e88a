"""Removing what saves to object storage left behind, and nothing else.

Every removal here deletes exact keys: the ones a listing of one exact prefix (``<checkpoint>/.<token>/``) returned,
key by key or in batches of exact keys. Never a pattern: fsspec's ``rm(path, recursive=True)`` expands ``[``, ``*``
and ``?`` in ``path`` as a glob, so a run named ``exp[1]`` would delete ``exp1``'s checkpoint (issue 45).

What a save of this project writes under a checkpoint ``U`` is ``U/COMMIT`` and ``U/.<token>/...``, where the token
is lowercase hex of exactly the lengths saves make (:data:`TOKEN`). Any other name under ``U`` (``.env``, ``.dvc/``,
``.hydra/``, ``.gitkeep``) is the user's and is never touched.

Which tokens go:

- the one the COMMIT a save replaced named, right after that save committed (it is no longer committed by anyone:
  a token is named by at most one COMMIT), and a removed checkpoint's own token (:func:`remove_token`);
- any other token not named by the current COMMIT only once it is **stale**: its newest object (and newest incomplete
  multipart upload) is older than ``grace_s`` by the store's own clock (the listing's ``Date`` header on S3; this
  host's clock on stores that give none). A younger one may be a save still uploading: deleting it would make that
  save commit objects that are gone, so it stays (:func:`sweep`). A save that takes longer than the grace period can
  still lose objects this way; it then fails before its COMMIT (the store checks every object it names first), and
  the checkpoint there is unchanged.

And on this host, the local staging folders of saves and loads whose process is gone (:func:`remove_stale_staging`):
their names carry the host and the process id, so another live job's folder is never removed.
"""

from __future__ import annotations

import contextlib
import contextvars
import datetime
import email.utils
import errno
import os
import re
import shutil
import socket
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, TypeVar

import xxhash

from lightning_fsdp.checkpoint.io.remote_errors import damaged
from lightning_fsdp.checkpoint.io.urls import fresh_info, join, split_url

T = TypeVar("T")

__all__ = ["TOKEN", "GRACE_S", "is_token", "Swept", "remove_token", "remove_rest", "sweep", "staging_root",
           "token_of_staging", "load_prefix", "remove_stale_staging", "remove_stale_staging_once", "side_by_side",
           "objects_under", "check_uploaded",
           "changed_while_read"]

# Exactly the tokens saves make: uuid4().hex[:12] (save, convert) and [:16] (the command line's convert).
TOKEN = re.compile(r"[0-9a-f]{12}|[0-9a-f]{16}")
GRACE_S = 3600.0  # a token younger than this may be a save still uploading; `clean --grace` changes it

_BATCH = 1000  # S3's limit of keys per DeleteObjects request


def is_token(name: str) -> bool:
    return TOKEN.fullmatch(name) is not None


class Swept(list):
    """What a removal removed (token prefixes, multipart uploads), with ``kept`` (token prefixes too young to be known
    abandoned), ``found`` (whether any token was there) and ``checkpoint`` (whether a COMMIT was)."""

    def __init__(self) -> None:
        super().__init__()
        self.kept: list[str] = []
        self.found = False
        self.checkpoint = False


@dataclass
class _Listed:
    paths: list[str]  # as the filesystem names them (no protocol)
    sizes: dict[str, int]
    newest: Optional[float]  # the newest modification time (epoch seconds), None when none is known for some
    now: float  # the store's clock when it listed


def _is_s3(fs: Any) -> bool:
    return getattr(fs, "call_s3", None) is not None


def _stamp(value: Any) -> Optional[float]:
    """Epoch seconds from a listing's time field, whatever type the filesystem gives it."""
    if isinstance(value, datetime.datetime):
        return value.replace(tzinfo=value.tzinfo or datetime.timezone.utc).timestamp()
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str):
        with contextlib.suppress(ValueError):
            return _stamp(datetime.datetime.fromisoformat(value.replace("Z", "+00:00")))
    return None


def _modified(info: dict[str, Any]) -> Optional[float]:
    for key in ("LastModified", "last_modified", "updated", "mtime", "created"):
        if info.get(key) is not None:
            return _stamp(info[key])
    return None


def _date(response: dict[str, Any]) -> Optional[float]:
    text = response.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("date")
    with contextlib.suppress(TypeError, ValueError):
        return email.utils.parsedate_to_datetime(text).timestamp()
    return None


def _newest(stamps: list[Optional[float]]) -> Optional[float]:
    return None if any(s is None for s in stamps) else max(stamps, default=None)  # type: ignore[type-var]


def objects_under(fs: Any, prefix: str) -> _Listed:
    """Every object whose key starts with exactly ``prefix + "/"`` (a fresh listing: ``step-1`` never lists
    ``step-10``, and ``[``, ``*``, ``?`` are plain characters)."""
    fs.invalidate_cache()
    if _is_s3(fs):
        bucket, key, _ = fs.split_path(prefix)
        paths, sizes, stamps, now = [], {}, [], None
        args: dict[str, Any] = {"Bucket": bucket, "Prefix": key.rstrip("/") + "/"}
        while True:
            page = fs.call_s3("list_objects_v2", **args)
            now = now or _date(page)
            for item in page.get("Contents", []):
                path = f"{bucket}/{item['Key']}"
                paths.append(path)
                sizes[path] = item.get("Size", -1)
                stamps.append(_stamp(item.get("LastModified")))
            if not page.get("IsTruncated"):
                break
            args["ContinuationToken"] = page["NextContinuationToken"]
        return _Listed(paths, sizes, _newest(stamps), now or time.time())
    root = fs._strip_protocol(prefix).rstrip("/") + "/"
    try:
        found = fs.find(prefix, detail=True)
    except FileNotFoundError:
        found = {}
    exact = {p: info for p, info in found.items() if p.startswith(root)}  # what a find around the prefix added
    return _Listed(sorted(exact), {p: i.get("size", -1) for p, i in exact.items()},
                   _newest([_modified(i) for i in exact.values()]), time.time())


def _delete(fs: Any, paths: list[str], prefix: str) -> None:
    """Delete exactly ``paths`` (all under ``prefix``): S3 in batches of exact keys (a failed key raises), anything
    else key by key, then the folders that held them, deepest first (``memory://`` keeps emptied ones)."""
    if not paths:
        return
    if _is_s3(fs):
        bucket = fs.split_path(paths[0])[0]
        for start in range(0, len(paths), _BATCH):
            keys = [{"Key": fs.split_path(p)[1]} for p in paths[start:start + _BATCH]]
            out = fs.call_s3("delete_objects", Bucket=bucket, Delete={"Objects": keys, "Quiet": True})
            errors = out.get("Errors") or []
            if errors:
                first = errors[0]
                raise PermissionError(f"The store refused to delete {len(errors)} object(s), e.g."
                                      f" {bucket}/{first.get('Key')} ({first.get('Code')}: {first.get('Message')})."
                                      " HINT: check that these credentials may delete objects in that bucket"
                                      " (s3:DeleteObject), then run `lightning-fsdp clean URL`.")
    else:
        for path in paths:
            with contextlib.suppress(FileNotFoundError):
                fs.rm_file(path)
        root = fs._strip_protocol(prefix).rstrip("/")
        folders = {root} | {p.rsplit("/", i)[0] for p in paths for i in range(1, p[len(root):].count("/") + 1)}
        for folder in sorted(folders, key=lambda f: f.count("/"), reverse=True):
            with contextlib.suppress(OSError):  # not empty (something new), or no such folder
                fs.rmdir(folder)
    fs.invalidate_cache()


def _uploads(fs: Any, target: str) -> dict[str, list[dict[str, Any]]]:
    """The incomplete multipart uploads under ``target``'s token prefixes, by token."""
    if not _is_s3(fs):
        return {}
    bucket, key, _ = fs.split_path(target)
    base = f"{key}/" if key else ""
    args: dict[str, Any] = {"Bucket": bucket, "Prefix": base + "."}
    found: dict[str, list[dict[str, Any]]] = {}
    while True:
        page = fs.call_s3("list_multipart_uploads", **args)
        for upload in page.get("Uploads", []):
            first, sep, _ = upload["Key"][len(base):].partition("/")
            if sep and first.startswith(".") and is_token(first[1:]):
                found.setdefault(first[1:], []).append(upload)
        if not page.get("IsTruncated"):
            return found
        args["KeyMarker"], args["UploadIdMarker"] = page.get("NextKeyMarker"), page.get("NextUploadIdMarker")


def _abort(fs: Any, target: str, uploads: list[dict[str, Any]]) -> list[str]:
    if not uploads:
        return []
    bucket = fs.split_path(target)[0]
    for upload in uploads:
        with contextlib.suppress(FileNotFoundError):  # completed or aborted meanwhile
            fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"])
    return [f"{split_url(target)[0]}://{bucket}/{u['Key']} (multipart upload)" for u in uploads]


def _tokens(fs: Any, target: str) -> list[str]:
    """The token prefixes directly under ``target`` (only names of the exact token form)."""
    fs.invalidate_cache()
    if _is_s3(fs):
        bucket, key, _ = fs.split_path(target)
        base = f"{key}/" if key else ""
        args: dict[str, Any] = {"Bucket": bucket, "Prefix": base + ".", "Delimiter": "/"}
        names = []
        while True:
            page = fs.call_s3("list_objects_v2", **args)
            names += [p["Prefix"][len(base):].rstrip("/") for p in page.get("CommonPrefixes", [])]
            if not page.get("IsTruncated"):
                break
            args["ContinuationToken"] = page["NextContinuationToken"]
    else:
        try:
            names = [p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(target, detail=False)]
        except FileNotFoundError:
            names = []
    return sorted({n[1:] for n in names if n.startswith(".") and is_token(n[1:])})


def remove_token(fs: Any, target: str, token: str) -> list[str]:
    """Remove every object under ``target/.<token>/`` and abort its incomplete multipart uploads."""
    prefix = join(target, "." + token)
    listed = objects_under(fs, prefix)
    _delete(fs, listed.paths, prefix)
    aborted = _abort(fs, target, _uploads(fs, target).get(token, [])) + _discard_unfinished(fs, prefix)
    return ([prefix] if listed.paths else []) + aborted


def _discard_unfinished(fs: Any, prefix: str) -> list[str]:
    """Azure: the uncommitted blocks a killed upload left under the token ``prefix`` being removed (no listing of
    blobs shows them; S3's incomplete multipart uploads are :func:`_abort`'s). A token with nothing but such blocks
    is not found by a listing, so it waits for Azure's own expiry of a week."""
    from lightning_fsdp.checkpoint.io import conditional, conditional_azure

    if conditional.store_of(fs) is not conditional_azure:
        return []
    found = conditional_azure.uncommitted_blobs(fs, prefix)
    return [f"{url} (uncommitted blocks)" for url in conditional_azure.discard_uncommitted(fs, found)]


def remove_rest(fs: Any, target: str, token: Optional[str]) -> None:
    """What follows the removal of a checkpoint's COMMIT: the objects of the save it named (``token``), the stale
    leftovers of others, and on stores with folders the checkpoint's folder, if nothing else is left in it."""
    sweep(fs, target, None, GRACE_S, replaced=token)
    # Never a bucket or container itself (no "/" below it): adlfs's rmdir of a bare container deletes the container
    # with every blob in it.
    if not _is_s3(fs) and "/" in fs._strip_protocol(target).strip("/"):
        with contextlib.suppress(OSError):  # not empty: the user's files, or a young save's, stay
            fs.rmdir(fs._strip_protocol(target))
        fs.invalidate_cache()


def sweep(fs: Any, target: str, committed: Optional[str], grace_s: float, replaced: Optional[str] = None) -> Swept:
    """Remove the stale tokens under ``target``: not ``committed``, and nothing of theirs (objects, multipart
    uploads) newer than ``grace_s`` seconds by the store's clock; and ``replaced`` (a token no COMMIT names any
    more: a removed checkpoint's, or the one a save just replaced) whatever its age. Younger ones are in ``kept``."""
    out = Swept()
    uploads = _uploads(fs, target)
    for token in sorted(set(_tokens(fs, target)) | set(uploads)):
        out.found = True
        if token == committed:
            continue
        prefix = join(target, "." + token)
        listed = objects_under(fs, prefix)
        started = [_stamp(u.get("Initiated")) for u in uploads.get(token, [])]
        newest = _newest([listed.newest, *started]) if listed.paths else _newest(started)
        # Whole seconds: the store's clock (an HTTP Date) has no finer ones, and its listings may.
        if token != replaced and (newest is None or int(newest) > listed.now - grace_s):
            out.kept.append(prefix)
            continue
        _delete(fs, listed.paths, prefix)
        out += ([prefix] if listed.paths else []) + _abort(fs, target, uploads.get(token, []))
        out += _discard_unfinished(fs, prefix)
    return out


def check_uploaded(fs: Any, target: str, token: str, objects: dict[str, list]) -> None:
    """Every object of ``objects`` (a COMMIT's) is under ``target/.<token>/`` with its size (one listing), or
    ``FileNotFoundError``: a COMMIT must never name objects that are gone (issue 42)."""
    prefix = join(target, "." + token)
    sizes = objects_under(fs, prefix).sizes
    wrong = [n for n, (size, _) in objects.items() if sizes.get(fs._strip_protocol(join(prefix, n))) != size]
    # A listing may lag behind objects just completed (streamed saves complete theirs moments before the commit):
    # what it lacks is asked for by name (a HEAD sees a completed object at once).
    wrong = [n for n in wrong if (fresh_info(fs, join(prefix, n)) or {}).get("size") != objects[n][0]]
    if wrong:
        raise FileNotFoundError(errno.ENOENT, f"{len(wrong)} of the {len(objects)} objects this save uploaded to"
                                f" {prefix!r} are gone or changed (e.g. {wrong[0]!r}) before its commit: something"
                                " removed them (`lightning-fsdp clean` with a --grace shorter than this save took, or"
                                " another process). This save was not committed, and the checkpoint there is"
                                " unchanged. HINT: save again; give `clean` a --grace longer than a save takes.")


def changed_while_read(fs: Any, target: str, current: Optional[dict[str, Any]]) -> Exception:
    """The error for an object gone while a load fetched it, given the COMMIT there now (``current``): the checkpoint
    was replaced or removed meanwhile (another save, retention), or, when the COMMIT there now names objects that are
    gone too, it is damaged."""
    if current is not None:
        try:
            check_uploaded(fs, target, current["token"], current["objects"])
        except FileNotFoundError:
            return damaged(join(target, "." + current["token"]), "objects its COMMIT names are gone")
    now = "it holds no checkpoint now" if current is None else "it now holds a newer one"
    return FileNotFoundError(errno.ENOENT, f"The checkpoint {target!r} changed while it was being read: another save"
                             " replaced it, or retention removed it, and the objects this load was fetching are gone"
                             f" ({now}). HINT: load it again; a job should not load a URL that another job saves to"
                             " or prunes at the same time.")


# --- local staging folders ----------------------------------------------------------------------------------------

_HOST = xxhash.xxh3_64_hexdigest(socket.gethostname().encode())[:8]
_STAGING = re.compile(r"lightning-fsdp-(?P<token>[0-9a-f]+)-r(?P<rank>\d+)-h(?P<host>[0-9a-f]{8})-p(?P<pid>\d+)")
_LOAD = re.compile(r"lightning-fsdp-load-h(?P<host>[0-9a-f]{8})-p(?P<pid>\d+)-[A-Za-z0-9_]+")


def staging_root(token: str, rank: int) -> Path:
    """The folder a rank stages a save in; its name says which host and process own it."""
    return Path(tempfile.gettempdir()) / f"lightning-fsdp-{token}-r{rank}-h{_HOST}-p{os.getpid()}"


def token_of_staging(root: Path) -> str:
    match = _STAGING.fullmatch(root.name)
    if match is None:
        raise ValueError(f"{str(root)!r} is not a staging folder of lightning-fsdp (internal error: please report it)")
    return match["token"]


def load_prefix() -> str:
    """The name prefix of a load's temporary folder (``tempfile.mkdtemp(prefix=...)``), with host and process."""
    return f"lightning-fsdp-load-h{_HOST}-p{os.getpid()}-"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # PermissionError: another user's live process
        return True
    return True


def remove_stale_staging(directory: Optional[Path] = None) -> list[str]:
    """Remove the staging and load folders in ``directory`` (the temporary folder) that a process of this host left
    when it died. A folder of a live process, of another host (a shared temporary folder), or named otherwise
    (an older release's, whose owner cannot be told) stays."""
    directory = Path(directory or tempfile.gettempdir())
    removed = []
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    for name in names:
        if not name.startswith("lightning-fsdp-"):
            continue
        match = _STAGING.fullmatch(name) or _LOAD.fullmatch(name)
        if match is None or match["host"] != _HOST or _alive(int(match["pid"])):
            continue
        shutil.rmtree(directory / name, ignore_errors=True)
        if not (directory / name).exists():
            removed.append(str(directory / name))
    return removed


# Temporary folders this process already swept: a folder of a process that died since is removed by the next
# process's first save, or by `clean` (listing a /tmp of many thousand entries costs milliseconds per save).
_SWEPT: set[str] = set()
_SWEPT_LOCK = threading.Lock()


def remove_stale_staging_once() -> list[str]:
    """:func:`remove_stale_staging` of the temporary folder, the first time this process asks for that folder."""
    directory = tempfile.gettempdir()
    with _SWEPT_LOCK:
        if directory in _SWEPT:
            return []
        _SWEPT.add(directory)
    return remove_stale_staging(Path(directory))


def side_by_side(step: Callable[[Any], T], items: list[Any], threads: int) -> list[T]:
    """``step`` of each item, on up to ``threads`` threads, each in a copy of the caller's context (so its retries
    spend the caller's :func:`~.remote_errors.one_budget`); the answers in the items' order. The error raised is the
    first item's in that order that failed, as one call after another would raise, once every call has ended."""
    def run(item: Any) -> tuple[Any, Optional[BaseException]]:
        try:
            return step(item), None
        except Exception as err:  # noqa: BLE001 - raised below, in the items' order
            return None, err

    if len(items) < 2:
        outcomes = [run(item) for item in items]
    else:
        contexts = [contextvars.copy_context() for _ in items]
        with ThreadPoolExecutor(min(threads, len(items)), "lightning-fsdp-commits") as pool:
            outcomes = list(pool.map(lambda item, ctx: ctx.run(run, item), items, contexts))
    for _, err in outcomes:
        if err is not None:
            raise err
    return [answer for answer, _ in outcomes]
