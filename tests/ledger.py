"""An S3 endpoint that counts: moto's S3 app behind a WSGI middleware that records every request, and injects faults.

moto's app (the one ``ThreadedMotoServer`` wraps, ``DomainDispatcherApplication(create_backend_app)``) is served by
our own threaded werkzeug server on 127.0.0.1 and a port the system chose. Every request gets one :class:`Record`:
the access key that signed it (the ``Credential=<key>/...`` of its Authorization header, or of a presigned URL's
``X-Amz-Credential``), method, bucket, key, query, Range header, status, the request body bytes the server actually
read from ``wsgi.input`` and the response body bytes the app actually yielded (both as they go, so a record is up to
date by the time its client has the response). Counts are wire bytes: a body framed as ``aws-chunked`` counts its
framing too (botocore frames only over https; the suite's endpoints are http).

Who is who: moto accepts any access key, so each process that the tests want to tell apart signs with its own
(:func:`rank_key`). A worker script sets ``os.environ["AWS_ACCESS_KEY_ID"] = rank_key(rank)`` at import, before any
filesystem or client exists (s3fs and boto3 read the key when they are created); ``Ledger.rank_env(rank)`` gives
the whole environment for a process started by hand.

Workers read the records of their own launch over HTTP: ``GET <endpoint>/_ledger/records?since=<n>`` answers
``{"next": m, "records": [...]}`` (the records numbered n..m-1, as :meth:`Record.as_dict`); the control path is
never recorded (no bucket may be named ``_ledger``).

Faults, each a :class:`Rule` kept until :meth:`Ledger.reset`; ``match`` is a callable taking a :class:`Record`, or a
string ``"[METHOD ]<bucket/key glob>[?name&name=value]"`` (``"PUT */*.distcp?partNumber=3"``, ``"GET b/COMMIT"``,
``"* *"``), the glob matched with :func:`fnmatch.fnmatchcase` against ``"<bucket>/<key>"`` (``"<bucket>"`` alone for a
request on the bucket itself):

- :meth:`Ledger.fail`: the nth matching request and the ``times - 1`` after it are answered with ``status`` and an S3
  error body (503: ``SlowDown``), after the request body was read (a client sends it before it sees the answer);
- :meth:`Ledger.delay`: matching requests wait ``seconds`` before moto sees them;
- :meth:`Ledger.hide_from_listings`: bucket listings leave out the objects matching ``match`` whose last write
  through this server completed less than ``younger_than_s`` ago (a listing that lags behind writes);
- :meth:`Ledger.drop_connection`: the connection is cut after ``after_bytes`` bytes of the body: of the request body
  when the request has one (the server reads that much, then closes the socket without answering), else of the
  response body (headers and ``after_bytes`` bytes are sent, then the socket is shut);
- :meth:`Ledger.lose_reply`: the request is applied (moto sees it whole and answers it: an object is written, a
  multipart upload completed), then the connection is cut before any byte of the answer is sent: the client sees a
  server that disconnected, as when a reply is lost on the way back. The record keeps moto's status, and its fault
  says the reply was lost.

One ledger serves the whole session (fixtures ``ledger_server`` and ``ledger`` in ``conftest.py``).
"""

from __future__ import annotations

import fnmatch
import json
import re
import socket
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Callable, Iterable, Union
from urllib.parse import parse_qsl

CONTROL = "/_ledger/"
_CREDENTIAL = re.compile(r"Credential=([^/,\s]+)/")
_ERRORS = {400: "BadRequest", 403: "AccessDenied", 404: "NoSuchKey", 412: "PreconditionFailed",
           500: "InternalError", 503: "SlowDown"}
# The real services' words where clients look for them (s3fs and the package retry on "reduce your request rate").
_MESSAGES = {503: "Please reduce your request rate. ", 500: "We encountered an internal error. Please try again. "}
_REASONS = {400: "Bad Request", 403: "Forbidden", 404: "Not Found", 412: "Precondition Failed",
            500: "Internal Server Error", 503: "Slow Down"}


def rank_key(rank: int) -> str:
    """The access key rank ``rank`` signs with, so that the ledger tells ranks apart."""
    return f"r{rank}"


@dataclass
class Record:
    seq: int
    access_key: str
    method: str
    bucket: str
    key: str
    query: dict
    range: Union[str, None]
    status: Union[int, None] = None
    bytes_in: int = 0
    bytes_out: int = 0
    started: float = field(default_factory=time.monotonic)
    done: bool = False
    fault: str = ""

    @property
    def path(self) -> str:
        return f"{self.bucket}/{self.key}" if self.key else self.bucket

    def as_dict(self) -> dict:
        return asdict(self)


Match = Union[str, Callable[[Record], bool]]


def matcher(match: Match) -> Callable[[Record], bool]:
    """The predicate a match spec stands for (see the module's docstring)."""
    if callable(match):
        return match
    spec = match.strip()
    method, _, rest = spec.partition(" ") if " " in spec else ("*", "", spec)
    pattern, _, query = rest.partition("?")
    wanted = parse_qsl(query, keep_blank_values=True)

    def predicate(record: Record) -> bool:
        if method not in ("*", record.method) or not fnmatch.fnmatchcase(record.path, pattern or "*"):
            return False
        return all(name in record.query and (not value or record.query[name] == value) for name, value in wanted)

    return predicate


@dataclass
class Rule:
    kind: str  # "fail", "delay", "hide", "drop", "lose_reply"
    match: Callable[[Record], bool]
    status: int = 503
    times: Union[int, None] = 1  # None: every matching request
    nth: int = 1
    seconds: float = 0.0
    younger_than_s: float = 0.0
    after_bytes: int = 0
    seen: int = 0  # matching requests so far
    fired: int = 0  # requests this rule acted on

    def take(self, record: Record) -> bool:
        """Whether this rule acts on ``record`` (counting it as seen when it matches)."""
        if not self.match(record):
            return False
        self.seen += 1
        if self.seen < self.nth or (self.times is not None and self.seen >= self.nth + self.times):
            return False
        self.fired += 1
        return True


class _CountingInput:
    """``wsgi.input`` that counts the bytes read through it into a record."""

    def __init__(self, stream, record: Record):
        self._stream, self._record = stream, record

    def _count(self, data):
        self._record.bytes_in += len(data)
        return data

    def read(self, *args):
        return self._count(self._stream.read(*args))

    def read1(self, *args):
        return self._count(self._stream.read1(*args) if hasattr(self._stream, "read1") else self._stream.read(*args))

    def readline(self, *args):
        return self._count(self._stream.readline(*args))

    def readlines(self, *args):
        return [self._count(line) for line in self._stream.readlines(*args)]

    def readinto(self, buffer):
        n = self._stream.readinto(buffer)
        self._record.bytes_in += n or 0
        return n

    def __iter__(self):
        return (self._count(line) for line in self._stream)


def _drain(environ) -> None:
    """Read the request body: exactly Content-Length bytes (``wsgi.input`` is the socket itself: reading past the
    body would wait for the client, who waits for the answer), or a chunked body to its end."""
    length = int(environ.get("CONTENT_LENGTH") or 0)
    while length > 0:
        data = environ["wsgi.input"].read(min(length, 1 << 20))
        if not data:
            break
        length -= len(data)
    if environ.get("wsgi.input_terminated"):
        environ["wsgi.input"].read()


def _cut(environ) -> None:
    sock = environ.get("werkzeug.socket")
    if sock is not None:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


class _Middleware:
    def __init__(self, app, ledger: Ledger):
        self.app, self.ledger = app, ledger

    def __call__(self, environ, start_response):
        path = environ.get("PATH_INFO", "")
        if path.startswith(CONTROL):
            return self.ledger._control(environ, start_response)
        record = self.ledger._open(environ)
        fail, drop, lose, hide = None, None, None, []
        for rule in self.ledger._rules_now():
            if rule.kind == "hide":
                hide.append(rule)
            elif rule.take(record):
                if rule.kind == "delay":
                    time.sleep(rule.seconds)
                elif rule.kind == "fail" and fail is None:
                    fail = rule
                elif rule.kind == "drop" and drop is None:
                    drop = rule
                elif rule.kind == "lose_reply" and lose is None:
                    lose = rule
        environ["wsgi.input"] = _CountingInput(environ["wsgi.input"], record)

        def recording_start(status, headers, exc_info=None):
            record.status = int(status.split(None, 1)[0])
            return start_response(status, headers, exc_info)

        has_body = int(environ.get("CONTENT_LENGTH") or 0) > 0 or "chunked" in environ.get("HTTP_TRANSFER_ENCODING", "")
        if drop is not None and has_body:
            record.fault = f"connection dropped after {drop.after_bytes} request bytes"
            environ["wsgi.input"].read(drop.after_bytes)
            _cut(environ)
            record.done = True
            start_response("500 Internal Server Error", [("Content-Length", "0")])
            return []
        if fail is not None:
            _drain(environ)  # the client sent its body before it could see the answer
            record.fault = f"failed with {fail.status}"
            body = (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{_ERRORS.get(fail.status, "InjectedFault")}'
                    f"</Code><Message>{_MESSAGES.get(fail.status, '')}Injected by tests/ledger.py (request {fail.seen} that"
                    f" matched the rule)</Message>"
                    f"<RequestId>{uuid.uuid4().hex}</RequestId></Error>").encode()
            recording_start(f"{fail.status} {_REASONS.get(fail.status, 'Injected')}",
                            [("Content-Type", "application/xml"), ("Content-Length", str(len(body)))])
            body = b"" if record.method == "HEAD" else body  # a HEAD answer has headers only
            record.bytes_out += len(body)
            record.done = True
            return [body]
        if lose is not None:
            return self._reply_lost(environ, record, start_response)
        body = self.app(environ, recording_start)
        listing = record.method == "GET" and not record.key and any(q in record.query for q in ("list-type", "prefix"))
        if hide and listing:
            return self._hidden(body, record, hide)
        return self._counted(body, record, environ, drop)

    def _counted(self, body: Iterable[bytes], record: Record, environ, drop: Union[Rule, None]):
        try:
            for chunk in body:
                if drop is not None and record.bytes_out + len(chunk) >= drop.after_bytes:
                    chunk = chunk[:drop.after_bytes - record.bytes_out]
                    record.bytes_out += len(chunk)
                    record.fault = f"connection dropped after {drop.after_bytes} response bytes"
                    yield chunk
                    _cut(environ)
                    return
                record.bytes_out += len(chunk)
                yield chunk
        finally:
            if hasattr(body, "close"):
                body.close()
            record.done = True
            self.ledger._written(record)

    def _reply_lost(self, environ, record: Record, start_response):
        """Let moto apply the request and build its whole answer, then cut the connection before sending any of it."""
        def keeping(status, headers, exc_info=None):
            record.status = int(status.split(None, 1)[0])
            return lambda data: None  # moto never uses write()

        body = self.app(environ, keeping)
        try:
            for _ in body:  # moto's side effects are done when its answer is built; nothing of it is sent
                pass
        finally:
            if hasattr(body, "close"):
                body.close()
        record.fault = f"applied (moto answered {record.status}), then the connection was cut before the reply"
        record.done = True
        self.ledger._written(record)
        _cut(environ)
        # Werkzeug must be given a status; writing it to the shut socket fails, and werkzeug drops the connection.
        start_response("500 Internal Server Error", [("Content-Length", "0")])
        return []

    def _hidden(self, body: Iterable[bytes], record: Record, rules: list[Rule]):
        try:
            xml = b"".join(body).decode()
        finally:
            if hasattr(body, "close"):
                body.close()
        now, hidden = time.monotonic(), 0

        def keep(found: re.Match) -> str:
            nonlocal hidden
            key = re.search(r"<Key>(.*?)</Key>", found.group(0))
            probe = Record(0, record.access_key, "GET", record.bucket, key.group(1) if key else "", {}, None)
            written = self.ledger._written_at.get(probe.path)
            if written is not None and any(rule.match(probe) and now - written < rule.younger_than_s
                                           for rule in rules):
                hidden += 1
                return ""
            return found.group(0)

        xml = re.sub(r"<Contents>.*?</Contents>", keep, xml, flags=re.S)
        if hidden:
            xml = re.sub(r"<KeyCount>(\d+)</KeyCount>", lambda m: f"<KeyCount>{int(m.group(1)) - hidden}</KeyCount>", xml)
            record.fault = f"{hidden} objects hidden from the listing"
            for rule in rules:
                rule.fired += 1
        data = xml.encode()
        record.bytes_out += len(data)
        record.done = True
        # moto set Content-Length for the body it built; a shorter body with the old length would hang the client.
        return _Resized(data)


class _Resized(list):
    """A WSGI body whose length differs from what moto declared: :func:`_fix_length` sends its real length."""

    def __init__(self, data: bytes):
        super().__init__([data])
        self.length = len(data)


class Ledger:
    """moto's S3 server behind the counting, fault-injecting middleware (see the module's docstring)."""

    def __init__(self):
        from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
        from werkzeug.serving import make_server

        self._lock = threading.Lock()
        self._records: list[Record] = []
        self._rules: list[Rule] = []
        self._written_at: dict[str, float] = {}
        class QuietHandler(MotoRequestHandler):
            def log_request(self, *args, **kwargs):  # one line per request on stderr: the ledger records them
                pass

        app = _Middleware(DomainDispatcherApplication(create_backend_app), self)
        self._server = make_server("127.0.0.1", 0, _fix_length(app), threaded=True, request_handler=QuietHandler)
        self._thread = threading.Thread(target=self._server.serve_forever, name="ledger", daemon=True)
        self._thread.start()
        host, port = self._server.server_address[:2]
        self.endpoint = f"http://{host}:{port}"
        # As tests/s3server.py's: any key is accepted; no instance-metadata lookups off EC2.
        self.env = {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_EC2_METADATA_DISABLED": "true",
        }

    # ------------------------------------------------------------------------------------------------- clients
    def rank_env(self, rank: int) -> dict[str, str]:
        """:attr:`env` for a process that signs as rank ``rank`` (:func:`rank_key`)."""
        return {**self.env, "AWS_ACCESS_KEY_ID": rank_key(rank)}

    def bucket(self, name: Union[str, None] = None) -> str:
        name = name or f"test-{uuid.uuid4().hex[:12]}"
        self.client(key="setup").create_bucket(Bucket=name)
        return name

    def client(self, key: Union[str, None] = None):
        """A boto3 S3 client signing with access key ``key`` (default: :attr:`env`'s)."""
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=key or self.env["AWS_ACCESS_KEY_ID"],
                            aws_secret_access_key=self.env["AWS_SECRET_ACCESS_KEY"],
                            region_name=self.env["AWS_DEFAULT_REGION"])

    def filesystem(self, key: Union[str, None] = None, **options):
        """A new s3fs filesystem signing with access key ``key``, with no cached instance or listings."""
        import s3fs

        return s3fs.S3FileSystem(endpoint_url=self.endpoint, key=key or self.env["AWS_ACCESS_KEY_ID"],
                                 secret=self.env["AWS_SECRET_ACCESS_KEY"], skip_instance_cache=True,
                                 use_listings_cache=False,
                                 client_kwargs={"region_name": self.env["AWS_DEFAULT_REGION"]}, **options)

    # ------------------------------------------------------------------------------------------------- records
    def records(self, key: Union[str, None] = None, *, prefix: Union[str, None] = None,
                method: Union[str, None] = None, match: Union[Match, None] = None) -> list[Record]:
        """The records so far, filtered by access key ``key``, object-path prefix (``"<bucket>/<key prefix>"``),
        method and a match spec."""
        test = matcher(match) if match is not None else None
        with self._lock:
            found = list(self._records)
        return [r for r in found if (key is None or r.access_key == key) and (prefix is None or r.path.startswith(prefix))
                and (method is None or r.method == method) and (test is None or test(r))]

    def bytes_in(self, key: Union[str, None] = None, **filters) -> int:
        """Request body bytes the server read, over :meth:`records` ``(key, **filters)``."""
        return sum(r.bytes_in for r in self.records(key, **filters))

    def bytes_out(self, key: Union[str, None] = None, **filters) -> int:
        """Response body bytes the server sent, over :meth:`records` ``(key, **filters)``."""
        return sum(r.bytes_out for r in self.records(key, **filters))

    def reset(self) -> None:
        """Forget every record and rule (the objects stay in moto)."""
        with self._lock:
            self._records.clear()
            self._rules.clear()

    # ------------------------------------------------------------------------------------------------- faults
    def _add(self, rule: Rule) -> Rule:
        with self._lock:
            self._rules.append(rule)
        return rule

    def fail(self, match: Match, status: int = 503, times: Union[int, None] = 1, nth: int = 1) -> Rule:
        """Answer the ``nth`` matching request and the ``times - 1`` after it (every one from the nth on when
        ``times`` is None) with ``status``."""
        return self._add(Rule("fail", matcher(match), status=status, times=times, nth=nth))

    def delay(self, match: Match, seconds: float, times: Union[int, None] = None) -> Rule:
        return self._add(Rule("delay", matcher(match), seconds=seconds, times=times))

    def hide_from_listings(self, match: Match, younger_than_s: float) -> Rule:
        return self._add(Rule("hide", matcher(match), younger_than_s=younger_than_s, times=None))

    def drop_connection(self, match: Match, after_bytes: int, times: Union[int, None] = 1, nth: int = 1) -> Rule:
        return self._add(Rule("drop", matcher(match), after_bytes=after_bytes, times=times, nth=nth))

    def lose_reply(self, match: Match, times: Union[int, None] = 1, nth: int = 1) -> Rule:
        """Apply the ``nth`` matching request (and the ``times - 1`` after it), then cut the connection before its
        answer: the store did what was asked, and the client cannot know."""
        return self._add(Rule("lose_reply", matcher(match), times=times, nth=nth))

    def stop(self) -> None:
        self._server.shutdown()
        self._thread.join(timeout=10)

    # ------------------------------------------------------------------------------------------------- internals
    def _rules_now(self) -> list[Rule]:
        with self._lock:
            return list(self._rules)

    def _open(self, environ) -> Record:
        auth = environ.get("HTTP_AUTHORIZATION", "")
        query = dict(parse_qsl(environ.get("QUERY_STRING", ""), keep_blank_values=True))
        found = _CREDENTIAL.search(auth) or _CREDENTIAL.search("Credential=" + query.get("X-Amz-Credential", ""))
        bucket, _, key = environ.get("PATH_INFO", "").lstrip("/").partition("/")
        with self._lock:
            record = Record(len(self._records), found.group(1) if found else "", environ["REQUEST_METHOD"], bucket,
                            key, query, environ.get("HTTP_RANGE"))
            self._records.append(record)
        return record

    def _written(self, record: Record) -> None:
        """Note when an object's write completed (a PUT that is not a part, or a multipart completion)."""
        complete = record.method == "POST" and "uploadId" in record.query
        put = record.method == "PUT" and "partNumber" not in record.query
        if record.key and record.status == 200 and (complete or put):
            self._written_at[record.path] = time.monotonic()

    def _control(self, environ, start_response):
        query = dict(parse_qsl(environ.get("QUERY_STRING", "")))
        since = int(query.get("since", 0))
        with self._lock:
            found = [r.as_dict() for r in self._records[since:]]
            nxt = len(self._records)
        body = json.dumps({"next": nxt, "records": found}).encode()
        start_response("200 OK", [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
        return [body]


def _fix_length(app):
    """Set Content-Length to the body's real length where the middleware changed the body (a filtered listing)."""
    def wrapped(environ, start_response):
        held = {}

        def holding(status, headers, exc_info=None):
            held.update(status=status, headers=headers, exc_info=exc_info)
            return lambda data: None  # moto never uses write()

        body = app(environ, holding)
        if not held:  # a body that calls start_response lazily (moto's do not): pass it through as is
            return body
        headers = held["headers"]
        if isinstance(body, _Resized):
            headers = [(k, v) for k, v in headers if k.lower() != "content-length"]
            headers.append(("Content-Length", str(body.length)))
        start_response(held["status"], headers, held["exc_info"])
        return body

    return wrapped
