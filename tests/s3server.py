"""A real S3 endpoint for the tests: moto's S3 server on 127.0.0.1, in the pytest process (``ThreadedMotoServer``).

One server per session (:func:`server`, and the session fixture ``s3_server`` in ``conftest.py``); moto keeps its
buckets in this process for as long as it runs. The server answers real HTTP, so everything the suite starts
reaches it the way a user's ranks reach S3: s3fs, boto3 and botocore read the endpoint and the credentials from the
environment (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ...), so a launch given :attr:`S3Server.env`
(``launch(script, n, tmp, **s3_server.env)``) needs no other argument. It is slow (about 13 MB/s on the reference
machine): keep test checkpoints small.

Usage::

    def test_x(s3_server, monkeypatch):
        url = f"s3://{s3_server.bucket()}/run/step-1"   # a fresh, empty bucket of its own
        s3_server.setenv(monkeypatch)                   # this test's process sees the server (undone after it)
        fs = s3_server.filesystem()                     # an s3fs filesystem on it, with no cached listings

The variables are not set in the pytest process for the whole session: the launch pools start before any fixture,
and a variable that appeared half-way through the session would reach some of them and not others.

The forked processes (``tests/forkserver``) see these variables as real ones do: a fork server compares only the
variables that its imports (torch, Lightning) read, and those read no ``AWS_*`` variable, so a launch given
:attr:`S3Server.env` is still forked (``tests/test_s3server.py`` holds that).
"""

from __future__ import annotations

import threading
import uuid
from pathlib import Path

_LOCK = threading.Lock()
_SERVER: S3Server | None = None


class S3Server:
    """moto's S3 server on ``127.0.0.1`` and a port the system chose."""

    def __init__(self):
        from moto.server import ThreadedMotoServer

        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self._server.start()
        host, port = self._server.get_host_and_port()
        self.endpoint = f"http://{host}:{port}"
        # Any key is accepted by moto. AWS_EC2_METADATA_DISABLED: a client that finds no credentials (the tests of
        # missing credentials take them away) fails at once instead of asking the instance-metadata address, which
        # costs a second or more of timeouts off EC2.
        self.env = {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_EC2_METADATA_DISABLED": "true",
        }

    def bucket(self, name: str | None = None) -> str:
        """Create a bucket (a fresh ``test-<hex>`` one when no name is given) and return its name."""
        name = name or f"test-{uuid.uuid4().hex[:12]}"
        self.client().create_bucket(Bucket=name)
        return name

    def client(self):
        """A boto3 S3 client on this server."""
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=self.env["AWS_ACCESS_KEY_ID"],
                            aws_secret_access_key=self.env["AWS_SECRET_ACCESS_KEY"],
                            region_name=self.env["AWS_DEFAULT_REGION"])

    def filesystem(self):
        """An s3fs filesystem on this server. A new instance each time (s3fs caches instances and their listings):
        what it lists is what the server holds now."""
        import s3fs

        return s3fs.S3FileSystem(endpoint_url=self.endpoint, key=self.env["AWS_ACCESS_KEY_ID"],
                                 secret=self.env["AWS_SECRET_ACCESS_KEY"], skip_instance_cache=True,
                                 use_listings_cache=False,
                                 client_kwargs={"region_name": self.env["AWS_DEFAULT_REGION"]})

    def setenv(self, monkeypatch) -> None:
        """Set :attr:`env` in this process for one test (pytest's ``monkeypatch`` undoes it)."""
        for key, value in self.env.items():
            monkeypatch.setenv(key, value)

    def stop(self) -> None:
        self._server.stop()


def server() -> S3Server:
    """The session's server, started at first use."""
    global _SERVER
    with _LOCK:
        if _SERVER is None:
            _SERVER = S3Server()
        return _SERVER


_POOL_BUCKET: str | None = None


def pool_env(out: Path | None = None) -> dict[str, str]:
    """The environment of the launch pool whose scripts save and load against this server
    (``launch.case_tests(..., env_from=s3server.pool_env)``): :attr:`S3Server.env` and one bucket, made once, in which
    each case works under a prefix of its own. Called when that pool's turn comes in the pools' background thread,
    after collection: this starts the server then, not at import. ``out`` (the launch's folder) is not needed."""
    global _POOL_BUCKET
    found = server()
    with _LOCK:
        if _POOL_BUCKET is None:
            _POOL_BUCKET = found.bucket()
        return {**found.env, "LFSDP_TEST_BUCKET": _POOL_BUCKET}


def stop() -> None:
    global _SERVER, _POOL_BUCKET
    with _LOCK:
        if _SERVER is not None:
            _SERVER.stop()
            _SERVER = None
            _POOL_BUCKET = None
