"""The ranged GETs of a load from S3 through obstore (Rust, outside the GIL) instead of s3fs, when obstore is
installed and the user's s3fs filesystem translates to it without guessing (issue 43 item 6).

Why: a load's ranged GETs cost the rank's Python time in s3fs: botocore builds and signs each request and aiohttp
hands the body over in small chunks, on the one event-loop thread, holding the GIL that the reader's checks and
copies need (``benchmarks/profile_s3.py``: 2.55 client CPU seconds per GB for s3fs, 0.89 for obstore; on the
sharded load of ``benchmarks/object_storage.py`` botocore's request path alone was 0.3 s of a 1.0 s load).

What is taken from the filesystem, never guessed: :func:`client_for` connects the s3fs filesystem and reads what its
botocore client resolved (endpoint, region, addressing style, signing off for ``anon``) and the credentials its
signer holds (whatever their source: arguments, environment, profile, instance role), handed to obstore through a
provider that asks botocore again when they expire. Anything this module does not translate keeps the whole load on
s3fs: an asynchronous filesystem, ``version_aware``, ``requester_pays``, ``s3_additional_kwargs`` (SSE-C keys and
the like), ``client_kwargs`` or ``config_kwargs`` beyond the endpoint, region, timeouts, retries and addressing
style, a ``verify``, proxy or client-certificate setting (``AWS_CA_BUNDLE`` is passed on as a root certificate).
``LFSDP_S3_CLIENT=s3fs`` turns it off.

Retries stay ours: obstore retries nothing (``max_retries=0``); each request is one attempt under
:func:`.remote_errors.retrying`'s one bound, with the filesystem's own connect and read timeouts (a quarter of the
bound, :func:`.remote_errors.client_options`). Errors are said as s3fs's are: a missing object is
``FileNotFoundError``, a refusal ``PermissionError``, a 5xx or a broken connection ``ConnectionError`` (transient), a
range past the object's end (416) or a size other than COMMIT's is the caller's damage. An answer obstore cannot
place (a redirect to another region, say) turns the fast path off for that filesystem and the request goes to s3fs.
obstore puts the error body in its message, and an S3 error body can echo what the request was signed with (AWS's
``SignatureDoesNotMatch`` names the access key id, the string to sign and the signature): those elements are masked
in what is said, and obstore's own exception is not chained to ours (botocore, behind s3fs, never shows the body).
"""

from __future__ import annotations

import datetime
import errno
import os
import re
import threading
import weakref
from typing import Any, Optional

__all__ = ["client_for", "FastRanges", "Short", "Unplaced", "VARIABLE", "masked_body", "said_as_s3fs"]

VARIABLE = "LFSDP_S3_CLIENT"  # "s3fs": never use obstore
# A body is copied as it arrives, at least this much at a time (obstore holds back smaller pieces): a failure costs
# at most the bytes not yet copied, which a retry fetches from there.
_CHUNK = 64 * 2**10
# The s3fs settings that translate (anything else keeps s3fs). The timeouts and retries are ours
# (remote_errors.client_options); the checksum settings change nothing on a GET of bytes we check ourselves.
_CLIENT_KWARGS = {"endpoint_url", "region_name", "aws_access_key_id", "aws_secret_access_key", "aws_session_token",
                  "use_ssl"}
_CONFIG_KWARGS = {"retries", "connect_timeout", "read_timeout", "max_pool_connections", "s3",
                  "request_checksum_calculation", "response_checksum_validation"}
_S3_CONFIG = {"addressing_style", "payload_signing_enabled"}
_SESSION_KWARGS = {"profile"}  # what the profile selects is read back from the client
# By the filesystem's identity, not its equality: fsspec filesystems compare equal by their arguments alone, so one
# made later for another endpoint (the environment's, read when it is made) would get the first one's client.
_CLIENTS: "dict[int, tuple[weakref.ref, Optional[FastRanges]]]" = {}
_LOCK = threading.Lock()


class Unplaced(Exception):
    """obstore could not place the answer (neither data nor one of the errors :func:`said_as_s3fs` knows): the caller
    repeats the request through s3fs, which can (and which is used for this filesystem from now on)."""


def client_for(fs: Any) -> Optional["FastRanges"]:
    """The obstore reader for the s3fs filesystem ``fs``, made once per filesystem; None: keep s3fs (obstore not
    installed, turned off, or ``fs`` has a setting this module does not translate)."""
    if os.environ.get(VARIABLE, "").strip().lower() == "s3fs":
        return None
    with _LOCK:
        known = _CLIENTS.get(id(fs))
        if known is not None and known[0]() is fs:
            return known[1]
        try:
            made = _make(fs)
        except Exception:  # noqa: BLE001 (s3fs could not connect, say: it says why itself on the first request)
            made = None
        try:
            _CLIENTS[id(fs)] = (weakref.ref(fs), made)
        except TypeError:  # not weakly referable: made again each time, which costs one connect
            pass
        return made


def _translatable(fs: Any) -> bool:
    if getattr(fs, "asynchronous", False) or getattr(fs, "version_aware", False) \
            or getattr(fs, "requester_pays", False) or getattr(fs, "s3_additional_kwargs", None):
        return False
    if set(getattr(fs, "client_kwargs", None) or {}) - _CLIENT_KWARGS:
        return False
    config = dict(getattr(fs, "config_kwargs", None) or {})
    if set(config) - _CONFIG_KWARGS or set(config.get("s3") or {}) - _S3_CONFIG:
        return False
    return not set(getattr(fs, "kwargs", None) or {}) - _SESSION_KWARGS


def _plain_aws_or_custom(endpoint: Optional[str], region: Optional[str]) -> bool:
    """Whether obstore reaches the same place botocore would: any endpoint outside AWS (given to obstore as it is),
    or AWS's own public S3 endpoint, which obstore builds from the region. Any other ``amazonaws.com`` host (FIPS,
    dualstack, a PrivateLink ``vpce`` endpoint, chosen by the user or by botocore from the environment) stays with
    s3fs: obstore would drop it and send signed requests to the public endpoint instead."""
    host = (endpoint or "").split("://", 1)[-1].split("/", 1)[0].lower()
    if not host.endswith(".amazonaws.com"):
        return True
    return host in ("s3.amazonaws.com", f"s3.{region}.amazonaws.com") if region else host == "s3.amazonaws.com"


def _make(fs: Any) -> Optional["FastRanges"]:
    if not (hasattr(fs, "_call_s3") and hasattr(fs, "split_path") and hasattr(fs, "connect")):
        return None
    try:
        import obstore  # noqa: F401
    except ImportError:
        return None
    if not _translatable(fs):
        return None
    client = fs.connect()  # the botocore client s3fs would send with: what it resolved is what we use
    meta = client.meta
    config = meta.config
    if getattr(config, "proxies", None) or getattr(config, "client_cert", None):
        return None
    endpoint = meta.endpoint_url
    if not _plain_aws_or_custom(endpoint, meta.region_name):
        return None  # FIPS, dualstack, PrivateLink (vpce) or another AWS host: obstore would send to its own default
    signed = not (getattr(fs, "anon", False) or _unsigned(config))
    credentials = client._get_credentials() if signed else None
    if signed and credentials is None:
        return None  # botocore found none: s3fs says so with its own error
    roots = None
    bundle = os.environ.get("AWS_CA_BUNDLE", "").strip()
    if bundle and (endpoint or "").startswith("https://"):
        try:  # botocore verifies against this bundle; obstore adds it to its trusted roots
            roots = open(bundle, "rb").read()
        except OSError:
            return None
    return FastRanges(fs, endpoint=endpoint, region=meta.region_name, roots=roots,
                      virtual=((config.s3 or {}).get("addressing_style") == "virtual"),
                      credentials=credentials, connect_timeout=float(config.connect_timeout),
                      read_timeout=float(config.read_timeout))


def _unsigned(config: Any) -> bool:
    from botocore import UNSIGNED

    return getattr(config, "signature_version", None) is UNSIGNED


class _Credentials:
    """obstore's credential provider over botocore's credentials object: static ones never expire; refreshable ones
    (an instance role, an assumed role) are asked again, through botocore, when obstore's copy is due."""

    def __init__(self, fs: Any, credentials: Any) -> None:
        self.fs, self.credentials = fs, credentials

    def __call__(self) -> dict[str, Any]:
        from fsspec.asyn import sync

        frozen = self.credentials.get_frozen_credentials()
        if hasattr(frozen, "__await__"):
            frozen = sync(self.fs.loop, lambda: frozen)
        expiry = getattr(self.credentials, "_expiry_time", None)
        if isinstance(expiry, datetime.datetime) and expiry.tzinfo is None:
            expiry = expiry.replace(tzinfo=datetime.timezone.utc)
        return {"access_key_id": frozen.access_key, "secret_access_key": frozen.secret_key, "token": frozen.token,
                "expires_at": expiry if isinstance(expiry, datetime.datetime) else None}


class FastRanges:
    """Ranged GETs of one s3fs filesystem's objects through obstore, one ``S3Store`` per bucket."""

    def __init__(self, fs: Any, *, endpoint: Optional[str], region: Optional[str], virtual: bool, credentials: Any,
                 connect_timeout: float, read_timeout: float, roots: Optional[bytes] = None) -> None:
        from lightning_fsdp.checkpoint.io.remote_errors import store_timeout_s

        self.fs = fs
        self.on = True  # off once an answer could not be placed (Unplaced): the rest goes to s3fs
        self._stores: dict[str, Any] = {}
        self._lock = threading.Lock()
        host = (endpoint or "").split("://", 1)[-1].split("/", 1)[0].lower()
        aws = host.endswith(".amazonaws.com")
        options: dict[str, Any] = {
            "connect_timeout": datetime.timedelta(seconds=connect_timeout),
            "read_timeout": datetime.timedelta(seconds=read_timeout),
            # Only against a request that keeps trickling: the bound is ours, and a request is one attempt of it.
            "timeout": datetime.timedelta(seconds=store_timeout_s()),
            "allow_http": (endpoint or "").startswith("http://"),
        }
        if roots:
            options["root_certificate"] = roots
        self._kwargs: dict[str, Any] = {
            "client_options": options,
            "retry_config": {"max_retries": 0, "retry_timeout": datetime.timedelta(seconds=store_timeout_s())},
            "virtual_hosted_style_request": virtual or aws,
        }
        if region:
            self._kwargs["region"] = region
        if endpoint and not aws:  # AWS itself: obstore builds the regional endpoint from the region, as botocore does
            self._kwargs["endpoint"] = endpoint
        if credentials is None:
            self._kwargs["skip_signature"] = True
        else:
            self._kwargs["credential_provider"] = _Credentials(fs, credentials)

    def _store(self, bucket: str) -> Any:
        with self._lock:
            if bucket not in self._stores:
                from obstore.store import S3Store

                kwargs = dict(self._kwargs)
                if "." in bucket and "endpoint" not in kwargs:
                    # AWS's certificate covers one level below s3.<region>.amazonaws.com: a dotted bucket name in the
                    # host fails TLS, so such a bucket is addressed by path (as botocore does).
                    kwargs["virtual_hosted_style_request"] = False
                self._stores[bucket] = S3Store(bucket, **kwargs)
            return self._stores[bucket]

    def read(self, url: str, start: int, end: int, view: memoryview, reached: list[int], committed: int) -> None:
        """Read ``[start, end)`` of ``url`` into ``view``, adding each chunk's length to ``reached[0]`` (a retry goes
        on from there). :class:`Short`: the object is shorter (or longer) than ``committed``."""
        import obstore

        bucket, key, version = self.fs.split_path(url)
        if version:
            raise Unplaced(f"{url!r} names an object version. HINT: read through s3fs, which sends it")
        try:
            result = obstore.get(self._store(bucket), key, options={"range": (start, end)})
        except Exception as err:  # noqa: BLE001
            raise said_as_s3fs(err) from None  # obstore's text holds the body unmasked: not shown in a traceback
        total = (result.meta or {}).get("size")
        if total is not None and int(total) != committed:
            raise Short(f"{url!r} has {total} bytes, its commit records {committed}. HINT: the checkpoint is damaged;"
                        " load an earlier one", int(total))
        count = 0
        try:
            for chunk in result.stream(min_chunk_size=_CHUNK):
                size = min(len(chunk), len(view) - count)
                view[count:count + size] = memoryview(chunk)[:size]
                count += size
                reached[0] += size
                if count >= len(view):
                    break
        except Exception as err:  # noqa: BLE001 (the connection broke mid-body)
            raise ConnectionError(errno.ECONNRESET, f"the body of {url!r} broke off at byte {start + count} of a range"
                                  f" to {end} ({type(err).__name__}: {str(err).splitlines()[0][:200]}). HINT: a"
                                  " transient failure, retried from that byte within LFSDP_STORE_TIMEOUT_S") from err
        if count < len(view):
            raise ConnectionError(errno.ECONNRESET, f"the body of {url!r} ended at byte {start + count} of a range to"
                                  f" {end}. HINT: a transient failure, retried from that byte within"
                                  " LFSDP_STORE_TIMEOUT_S")


class Short(Exception):
    """The object is shorter (or longer) than its COMMIT records: damage, which the caller says as such (``size``:
    the object's real size when the answer gave it)."""

    def __init__(self, message: str, size: Optional[int] = None) -> None:
        super().__init__(message)
        self.size = size


def said_as_s3fs(err: BaseException) -> BaseException:
    """obstore's error as s3fs says it (the same classes), so that the store's retry and its messages treat both
    alike: they wrap it with the URL, the operation and their own HINT."""
    text = masked_body(str(err))
    first = text.strip().splitlines()[0][:300] if text.strip() else type(err).__name__
    status = _status(text)
    if status == 416 or "InvalidRange" in text:
        return Short(f"{first}. HINT: the object is shorter than its commit records: the checkpoint is damaged")
    if isinstance(err, PermissionError) or status in (401, 403) \
            or type(err).__name__ in ("PermissionDeniedError", "UnauthenticatedError"):
        return PermissionError(f"AccessDenied: {first}. HINT: check the credentials")
    if isinstance(err, FileNotFoundError) or status == 404:
        # No errno: as s3fs says it (the store takes an errno for its own, already explained, error).
        return FileNotFoundError(f"{first}. HINT: check the URL")
    if isinstance(err, (ConnectionError, TimeoutError)) or (status is not None and (status >= 500 or status in
                                                                                     (408, 429))) \
            or "error sending request" in text or "timed out" in text.lower() or "connection" in text.lower():
        return ConnectionError(f"{first}. HINT: a transient failure, retried within LFSDP_STORE_TIMEOUT_S")
    return Unplaced(f"{first}. HINT: read through s3fs, which may place it")


# Elements of an S3 error body that repeat what the request was signed with: the access key id counts as a secret
# here (``_base.secrets`` masks the ``key`` option), the session token is one (AWS's ExpiredToken and InvalidToken
# bodies repeat it as <Token-0>), and the string to sign and signature help nobody but an attacker. By name, so a
# server's variant (<SessionToken>, <X-Amz-Security-Token>) is masked too; an element a cut body leaves unclosed is
# masked to the end of the text.
_ECHOED = re.compile(r"<([\w-]*(?:KeyId|Token|Signature|StringToSign|CanonicalRequest|Secret)[\w-]*)>.*?(?:</\1>|$)",
                     re.S)


def masked_body(text: str) -> str:
    """``text`` with the signing inputs an S3 error body echoes masked (the elements kept, their values not)."""
    return _ECHOED.sub(lambda m: f"<{m.group(1)}>***</{m.group(1)}>", text)


def _status(text: str) -> Optional[int]:
    marker = "status code: "
    if marker not in text:
        return None
    digits = text.split(marker, 1)[1][:3]
    return int(digits) if digits.isdigit() else None
