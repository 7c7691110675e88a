"""What a failing object store means, said once: which failures are transient (retried within one bound, with
backoff), the one error that names the URL, the operation, the bound and the fix when retrying does not help, and
which failures say that a checkpoint could not be read (as opposed to read and found damaged).

The bound (issues 42 and 45): a store that stops answering is an error within ``LFSDP_STORE_TIMEOUT_S`` seconds
(default 60), never a hang and never a retry that outlives it. Our retries are the only ones: the filesystem is
built with the client's own retries off and its connect and read timeouts at a quarter of the bound
(:func:`client_options`), so one request that gets no answer fails after that quarter, where the client's retries
times ours once took 170 s. Each operation (:func:`retrying`) has a budget of the bound: every failed attempt spends
the time it waited for an answer (at most that quarter) and every backoff its wait, and no attempt starts that could
end past the budget. Requests that succeed spend nothing: a large download that makes progress is no outage. A caller
that makes many store calls for one answer shares one budget among them (:func:`one_budget`), so the whole answer
fails within the bound too: ``latest`` on rank 0 (while the other ranks wait), a verification, and a load (every
request of ``open_committed``, the ranged GETs on pool threads included: they run in a copy of the caller's
context). Time that several threads failed through together is spent once (:meth:`_Budget.spend`).

Damage is not decided here: a ``CheckpointError`` (bytes read and found wrong) passes through untouched, and is never
retried, since retrying reads the same bytes. :func:`could_not_read` says which errors are not damage.
"""

from __future__ import annotations

import contextlib
import contextvars
import errno
import math
import os
import threading
import time
from typing import Any, Callable, Iterator, Optional

from lightning_fsdp.checkpoint.integrity.agreement import CheckpointError

__all__ = ["retrying", "explain", "transient", "damaged", "could_not_read", "store_timeout_s", "request_timeout_s",
           "client_options", "bounded_filesystem", "one_budget", "TIMEOUT_VARIABLE", "DEFAULT_TIMEOUT_S"]

TIMEOUT_VARIABLE = "LFSDP_STORE_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 60.0
ATTEMPTS: Optional[int] = None  # a cap on attempts besides the bound (None: the bound alone); tests set it
BACKOFF_S = 0.25  # the first wait; each next one doubles, up to MAX_BACKOFF_S
MAX_BACKOFF_S = 4.0
# "reduce your request rate": S3's SlowDown (503) as s3fs raises it, an OSError(EBUSY) that keeps only the message.
_TRANSIENT = ("SlowDown", "ServiceUnavailable", "InternalError", "503", "500", "RequestTimeout", "reset by peer",
              "Connection", "timed out", "Timeout", "Disconnected", "reduce your request rate")
_SAVING = ("checking", "uploading to", "committing")
_STORE_ERROR = "_lfsdp_store_error"  # set on the errors :func:`explain` makes: the store, not the bytes, failed


def store_timeout_s() -> float:
    """The bound, in seconds, from ``LFSDP_STORE_TIMEOUT_S`` (default 60); a value that is not a positive number is
    refused with the fix."""
    text = os.environ.get(TIMEOUT_VARIABLE, "").strip()
    if not text:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{TIMEOUT_VARIABLE}={text!r} must be a positive number of seconds: how long an object store"
                         f" may fail to answer before an operation on it fails. HINT: unset it for the default"
                         f" ({DEFAULT_TIMEOUT_S:g}), or set e.g. {TIMEOUT_VARIABLE}=120.")
    return value


def request_timeout_s(bound: Optional[float] = None) -> float:
    """How long one request may wait for an answer: a quarter of the bound, at least 1 s."""
    return max(1.0, (store_timeout_s() if bound is None else bound) / 4)


def client_options(protocol: str, storage_options: Optional[dict[str, Any]]) -> dict[str, Any]:
    """``storage_options`` with the client's own retries off and its timeouts within the bound, where the user did
    not set them (S3, through s3fs and botocore; other stores keep their clients' defaults)."""
    options = dict(storage_options or {})
    if protocol not in ("s3", "s3a"):
        return options
    per_request = request_timeout_s()
    config = dict(options.get("config_kwargs") or {})
    config.setdefault("retries", {"total_max_attempts": 1})
    config.setdefault("connect_timeout", min(5.0, per_request))
    config.setdefault("read_timeout", per_request)
    options["config_kwargs"] = config
    return options


def bounded_filesystem(cls: Any, protocol: str, storage_options: Optional[dict[str, Any]]) -> Any:
    """A fresh instance of the filesystem class ``cls`` (fsspec caches instances per arguments, and a cached one's
    listings can be stale) whose client retries nothing and waits within the bound (:func:`client_options`)."""
    # The user's own `skip_instance_cache` (harmless to pass) is overridden, not passed twice (a TypeError).
    fs = cls(**{**client_options(protocol, storage_options), "skip_instance_cache": True})
    if protocol in ("s3", "s3a") and isinstance(getattr(fs, "retries", None), int):
        fs.retries = 1  # s3fs's own loop around each call (5 tries by default): ours is the one
    return fs


class _Budget:
    def __init__(self) -> None:
        self.bound = store_timeout_s()
        self.per_request = request_timeout_s(self.bound)
        self.spent = 0.0
        # The requests of one load run on several threads (ranged_read, remote_windows, remote_full) and share this
        # budget: the lock keeps their updates whole, and time that several of them failed through together counts
        # once (a window of 4 in one outage would otherwise spend the bound 4 times as fast as the clock).
        self._lock = threading.Lock()
        self._until = -math.inf

    def spend(self, start: float, end: float) -> None:
        """Count the failed time ``[start, end]``, less what an interval counted before already covered."""
        with self._lock:
            self.spent += max(0.0, end - max(start, self._until))
            self._until = max(self._until, end)


_SHARED: contextvars.ContextVar[Optional[_Budget]] = contextvars.ContextVar("lfsdp_store_budget", default=None)


@contextlib.contextmanager
def one_budget() -> Iterator[None]:
    """Every :func:`retrying` call in the block (in this thread) shares one budget of the bound."""
    token = _SHARED.set(_SHARED.get() or _Budget())
    try:
        yield
    finally:
        _SHARED.reset(token)


def retrying(fs: Any, target: str, what: str, step: Callable[[], Any]) -> Any:
    """``step()``, again after a transient failure (with backoff, within the bound), then one error naming the URL."""
    budget = _SHARED.get() or _Budget()
    attempt, first, failed = 0, time.monotonic(), None
    while True:
        attempt += 1
        started = time.monotonic()
        try:
            return step()
        except CheckpointError:
            raise  # damage, said with the object's URL: retrying reads the same bytes
        except (FileNotFoundError, FileExistsError, IsADirectoryError, ValueError) as err:
            if getattr(err, "errno", None) is not None or isinstance(err, ValueError):
                raise  # ours, already said with the URL and the fix
            raise explain(err, target, what) from err
        except Exception as err:  # noqa: BLE001
            # A request that got no answer waited at most `per_request` for it; one that failed at once spent nothing.
            now = time.monotonic()
            unanswered = min(now - started, budget.per_request)
            budget.spend(now - unanswered, now)
            failed = now - unanswered if failed is None else failed  # when the store stopped answering, at the latest
            # The next attempt may wait `per_request` in vain; the wall clock since the first failure also counts,
            # for failures that cost no time at all.
            left = min(budget.bound - budget.spent, budget.bound - (now - failed)) - budget.per_request
            if transient(err) and left >= 0 and (ATTEMPTS is None or attempt < ATTEMPTS):
                wait = min(BACKOFF_S * 2 ** (attempt - 1), MAX_BACKOFF_S, left)
                slept = time.monotonic()
                time.sleep(wait)
                budget.spend(slept, time.monotonic())
                fs.invalidate_cache()
                continue
            raise explain(err, target, what, attempts=attempt, seconds=time.monotonic() - first,
                          bound=budget.bound) from err


def explain(err: BaseException, target: str, what: str, attempts: int = 1, seconds: float = 0.0,
            bound: Optional[float] = None) -> BaseException:
    cause = f"{type(err).__name__}: {str(err).strip().splitlines()[0][:300] if str(err).strip() else ''}"
    saving = what in _SAVING
    if isinstance(err, PermissionError) or "AccessDenied" in cause or "Credentials" in cause \
            or "InvalidAccessKeyId" in cause or "SignatureDoesNotMatch" in cause or "Forbidden" in cause:
        made: BaseException = PermissionError(
            errno.EACCES, f"Access to {target!r} was refused while {what} it ({cause}). HINT: check the credentials"
            " (for S3: AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or `storage_options={'key': ..., 'secret':"
            " ...}`) and that they may read and write that bucket.")
    elif isinstance(err, FileNotFoundError):
        made = FileNotFoundError(errno.ENOENT, f"{target!r} was not found while {what} it ({cause}). HINT: check"
                                 " the URL and that its bucket exists.")
    elif transient(err) or isinstance(err, (ConnectionError, TimeoutError, OSError)):
        bound = store_timeout_s() if bound is None else bound
        after = ("then save again; the previous checkpoint there is unchanged." if saving else
                 "then run again: a store that could not be read is never taken for a damaged checkpoint, and"
                 " nothing was skipped or deleted because of it.")
        made = ConnectionError(
            f"The store at {target!r} failed while {what} it, after {attempts} attempts in {seconds:.1f} s (an"
            f" unreachable store is retried for at most {bound:g} s, {TIMEOUT_VARIABLE}) ({cause}). HINT: check the"
            " endpoint (AWS_ENDPOINT_URL or `storage_options={'endpoint_url': ...}`) and the network, or set"
            f" {TIMEOUT_VARIABLE} to wait longer for the store; {after}")
    else:
        made = RuntimeError(f"The store failed while {what} {target!r} ({cause}). HINT: "
                            + ("the previous checkpoint there is unchanged; fix the cause and save again." if saving
                               else "fix the cause and run again; the checkpoint was not taken for damaged."))
    setattr(made, _STORE_ERROR, True)
    return made


def transient(err: BaseException) -> bool:
    text = f"{type(err).__name__} {err}"
    return isinstance(err, (ConnectionError, TimeoutError)) or any(word in text for word in _TRANSIENT)


def could_not_read(err: BaseException) -> bool:
    """Whether ``err`` says that a checkpoint could not be read (its store failed: a network error, a timeout,
    refused access, an object that is gone), which says nothing of its bytes; else it is damage (bytes read and
    found wrong, a reader's refusal). Looks through the causes, where an agreement across ranks wraps the error."""
    seen: set[int] = set()
    current: Optional[BaseException] = err
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if getattr(current, _STORE_ERROR, False):
            return True
        current = current.__cause__
    # Not any OSError: a local checkpoint with a shard missing (FileNotFoundError) or unreadable is damage, skipped
    # by `latest` for the one before it, as it always was; only a network's own errors count without the mark.
    return isinstance(err, (ConnectionError, TimeoutError))


def damaged(url: str, why: str) -> Exception:
    from lightning_fsdp.checkpoint.integrity.digests import ChecksumError

    return ChecksumError(f"The object {url!r} is damaged: {why}. HINT: load an earlier checkpoint, or save this one"
                         " again.")


def lost_write(url: str) -> FileExistsError:
    """The error of a conditional write of ``url`` that the store refused: another writer got there first."""
    return FileExistsError(errno.EEXIST, f"Another save committed {url.rsplit('/', 1)[0]!r} while this one was"
                           " uploading, so this one was not committed (the other one stands). HINT: give each writer"
                           " its own checkpoint path.")


def renamed(err: BaseException, local: str, target: str) -> BaseException:
    """``err`` with the temporary local copy's path replaced by the URL it came from, in its message."""
    err.args = tuple(a.replace(local, target) if isinstance(a, str) else a for a in err.args)
    if isinstance(err, OSError) and isinstance(err.strerror, str):
        err.strerror = err.strerror.replace(local, target)
    return err
