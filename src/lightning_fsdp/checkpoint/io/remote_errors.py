"""What a failing object store means, said once: which failures are transient (retried, bounded, with backoff), and
the one error that names the URL, the operation and the fix when retrying does not help.

Damage is not decided here: a ``CheckpointError`` (bytes read and found wrong) passes through untouched, and is never
retried, since retrying reads the same bytes.
"""

from __future__ import annotations

import errno
import time
from typing import Any, Callable

from lightning_fsdp.checkpoint.integrity.agreement import CheckpointError

__all__ = ["retrying", "explain", "transient", "damaged", "ATTEMPTS"]

ATTEMPTS = 4  # our own retries of a transient failure, on top of the filesystem's (s3fs: 5), with backoff
BACKOFF_S = 0.25
_TRANSIENT = ("SlowDown", "ServiceUnavailable", "InternalError", "503", "500", "RequestTimeout", "reset by peer",
              "Connection", "timed out", "Timeout")


def retrying(fs: Any, target: str, what: str, step: Callable[[], Any]) -> Any:
    """``step()``, again after a transient failure (bounded, with backoff), then one error naming the URL."""
    attempt = 0
    while True:
        attempt += 1
        try:
            return step()
        except CheckpointError:
            raise  # damage, said with the object's URL: retrying reads the same bytes
        except (FileNotFoundError, FileExistsError, IsADirectoryError, ValueError) as err:
            if getattr(err, "errno", None) is not None or isinstance(err, ValueError):
                raise  # ours, already said with the URL and the fix
            raise explain(err, target, what) from err
        except Exception as err:  # noqa: BLE001
            if attempt < ATTEMPTS and transient(err):
                time.sleep(BACKOFF_S * 2 ** (attempt - 1))
                fs.invalidate_cache()
                continue
            raise explain(err, target, what) from err


def explain(err: BaseException, target: str, what: str) -> BaseException:
    cause = f"{type(err).__name__}: {str(err).strip().splitlines()[0][:300] if str(err).strip() else ''}"
    if isinstance(err, PermissionError) or "AccessDenied" in cause or "Credentials" in cause \
            or "InvalidAccessKeyId" in cause or "SignatureDoesNotMatch" in cause or "Forbidden" in cause:
        return PermissionError(errno.EACCES, f"Access to {target!r} was refused while {what} it ({cause})."
                               " HINT: check the credentials (for S3: AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY,"
                               " or `storage_options={'key': ..., 'secret': ...}`) and that they may read and"
                               " write that bucket.")
    if isinstance(err, FileNotFoundError):
        return FileNotFoundError(errno.ENOENT, f"{target!r} was not found while {what} it ({cause}). HINT: check"
                                 " the URL and that its bucket exists.")
    if transient(err) or isinstance(err, (ConnectionError, TimeoutError, OSError)):
        return ConnectionError(f"The store at {target!r} failed while {what} it, after {ATTEMPTS} attempts"
                               f" ({cause}). HINT: check the endpoint (AWS_ENDPOINT_URL or"
                               " `storage_options={'endpoint_url': ...}`) and the network, then save again; the"
                               " previous checkpoint there is unchanged.")
    return RuntimeError(f"The store failed while {what} {target!r} ({cause}). HINT: the previous checkpoint there"
                        " is unchanged; fix the cause and save again.")


def transient(err: BaseException) -> bool:
    text = f"{type(err).__name__} {err}"
    return isinstance(err, (ConnectionError, TimeoutError)) or any(word in text for word in _TRANSIENT)


def damaged(url: str, why: str) -> Exception:
    from lightning_fsdp.checkpoint.integrity.digests import ChecksumError

    return ChecksumError(f"The object {url!r} is damaged: {why}. HINT: load an earlier checkpoint, or save this one"
                         " again.")
