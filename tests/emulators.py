"""Local emulators of GCS and Azure Blob Storage for the tests, on 127.0.0.1 ports the system chose, one of each per
session (:func:`gcs`, :func:`azurite`, started at first use and stopped by :func:`stop`, which the fixtures of
``tests/test_conditional_stores.py`` call at the end of the session).

- GCS: ``gcp-storage-emulator`` (PyPI, the test extra), in the pytest process: a plain HTTP server thread over an
  in-memory store, serving the JSON API that gcsfs speaks (``endpoint_url`` or ``STORAGE_EMULATOR_HOST``). It ignores
  the preconditions of uploads (``ifGenerationMatch``), so :class:`Gcs` enforces them itself, the way the GCS
  documentation says the service does (412 when the live object's generation differs; ``0``: when there is one).
  The server answers one request at a time, so that check and the write it guards are one step. What this shows: the
  condition the client sends and how its refusal is read; not that GCS refuses (``UNTESTED`` in
  ``checkpoint/io/conditional.py``). :meth:`Gcs.before_upload` lets "another writer" land just before a given upload.
- Azure: Azurite (npm, installed by ``.ci/install.sh`` into ``.ci/node``), a real process serving the Blob API with
  Azure's well-known development account; it enforces ``If-Match`` / ``If-None-Match`` itself. Started in the
  background at first use, so the GCS tests run while it starts (about 3 s on the reference machine).

A missing emulator is an error naming the install command, never a skip.

gcsfs trap (``shared/TESTING-NOTES.md``): its default class asks each bucket for its type over gRPC first, which
against an emulator waits 60 s per bucket. :func:`gcs_filesystem_class` is gcsfs's plain JSON-API class, which the
tests register for ``gs://`` while they run.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import threading
import uuid
from pathlib import Path
from typing import Any, Callable, Optional

ROOT = Path(__file__).resolve().parent.parent
AZURITE = ROOT / ".ci" / "node" / "node_modules" / ".bin" / "azurite-blob"
# Azurite's development account: a published, well-known key that only Azurite accepts.
AZURE_ACCOUNT = "devstoreaccount1"
AZURE_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
START_TIMEOUT_S = 60.0  # a bound on a hang, not a measure: Azurite starts in about 3 s here

_LOCK = threading.Lock()
_GCS: Optional["Gcs"] = None
_AZURITE: Optional["Azurite"] = None


def gcs_filesystem_class() -> Any:
    """gcsfs's JSON-API filesystem class, without the gRPC bucket-type probe of its default (extended) class."""
    from gcsfs.core import GCSFileSystem

    return GCSFileSystem


class Gcs:
    """gcp-storage-emulator in this process, with upload preconditions enforced (see the module's docstring)."""

    def __init__(self) -> None:
        from gcp_storage_emulator import server as emulator

        self._before: dict[tuple[str, str], Callable[[Any], None]] = {}
        self.enforce = True  # False: the emulator as shipped (the test that it still ignores preconditions)
        self._patch_uploads(emulator)
        self._server = emulator.create_server("127.0.0.1", 0, in_memory=True)
        self._server._api.daemon = True  # never keeps the pytest process alive, even if stop() is not reached
        self._server.start()
        host, port = self._server._api._httpd.server_address[:2]
        self.endpoint = f"http://{host}:{port}"
        self.storage_options = {"endpoint_url": self.endpoint, "token": "anon", "project": "test"}

    def _patch_uploads(self, emulator: Any) -> None:
        """Route this server's object uploads through :meth:`_insert` (the emulator's route table is module-level;
        only this module's server runs in the tests' process)."""
        insert = emulator.objects.insert
        if getattr(insert, "lfsdp_original", None) is not None:
            insert = insert.lfsdp_original

        def checked(request: Any, response: Any, storage: Any, *args: Any, **kwargs: Any) -> Any:
            return self._insert(insert, request, response, storage, *args, **kwargs)
        checked.lfsdp_original = insert  # type: ignore[attr-defined]
        emulator.objects.insert = checked
        emulator.HANDLERS = tuple((regex, {m: (checked if h is insert else h) for m, h in handlers.items()})
                                  for regex, handlers in emulator.HANDLERS)

    def _insert(self, insert: Callable, request: Any, response: Any, storage: Any, *args: Any, **kwargs: Any) -> Any:
        from http import HTTPStatus

        bucket = request.params["bucket_name"]
        name = (request.query.get("name") or [None])[0]
        if name is None and isinstance(request.data, dict):
            name = (request.data.get("meta") or request.data).get("name")
        hook = self._before.pop((bucket, name), None)
        if hook is not None:
            hook(storage)
        wanted = (request.query.get("ifGenerationMatch") or [None])[0]
        if self.enforce and wanted is not None and "upload_id" not in request.query:
            live = _live_generation(storage, bucket, name)
            if (wanted == "0" and live is not None) or (wanted != "0" and live != wanted):
                response.status = HTTPStatus.PRECONDITION_FAILED
                response.json({"error": {"code": 412, "message": "At least one of the pre-conditions you specified"
                                         " did not hold.", "errors": [{"reason": "conditionNotMet"}]}})
                return None
        return insert(request, response, storage, *args, **kwargs)

    def before_upload(self, url: str, payload: bytes) -> None:
        """Make "another writer" store ``payload`` at ``url`` (``gs://bucket/key``) just before the next upload to it
        is handled: after the uploader read the version, before its write reaches the store."""
        bucket, key = url.split("://", 1)[1].split("/", 1)

        def other_writer(storage: Any) -> None:
            from gcp_storage_emulator.handlers import objects

            resource = objects._make_object_resource(self.endpoint, bucket, key, "application/octet-stream",
                                                     str(len(payload)))
            storage.create_file(bucket, key, payload, objects._checksums(payload, resource))
        self._before[(bucket, key)] = other_writer

    def bucket(self) -> str:
        """A new, empty bucket of its own."""
        name = f"test-{uuid.uuid4().hex[:12]}"
        self.filesystem().mkdir(name)
        return name

    def filesystem(self) -> Any:
        """A gcsfs filesystem on this server, with no cached instance or listings."""
        return gcs_filesystem_class()(**self.storage_options, skip_instance_cache=True, use_listings_cache=False)

    def stop(self) -> None:
        self._server.stop()


def _live_generation(storage: Any, bucket: str, name: str) -> Optional[str]:
    from gcp_storage_emulator.exceptions import NotFound

    try:
        return str(storage.get_file_obj(bucket, name)["generation"])
    except NotFound:
        return None


class Azurite:
    """Azurite's Blob service, a process of its own on 127.0.0.1 and a port the system chose, data in memory."""

    def __init__(self) -> None:
        if not os.access(AZURITE, os.X_OK):
            raise FileNotFoundError(f"Azurite (the Azure Storage emulator the tests need) is not installed at {AZURITE}."
                                    " HINT: run `bash .ci/install.sh` (it installs it with npm into .ci/node).")
        if shutil.which("node") is None:
            raise FileNotFoundError("Azurite needs node, which is not on PATH. HINT: install Node.js 20 or newer.")
        self._proc = subprocess.Popen(
            [str(AZURITE), "--blobHost", "127.0.0.1", "--blobPort", "0", "--inMemoryPersistence", "--silent",
             "--skipApiVersionCheck", "--loose", "--disableTelemetry"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True)
        self._ready = threading.Event()
        self._said: list[str] = []
        self.endpoint: Optional[str] = None
        threading.Thread(target=self._read, name="azurite-output", daemon=True).start()

    def _read(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:  # read to the end, so that Azurite never blocks on a full pipe
            self._said.append(line.rstrip())
            found = re.search(r"listens on (http://127\.0\.0\.1:\d+)", line)
            if found and self.endpoint is None:
                self.endpoint = found.group(1)
                self._ready.set()
        self._ready.set()  # it ended: wait() says so

    def wait(self) -> "Azurite":
        if not self._ready.wait(START_TIMEOUT_S) or self.endpoint is None:
            said = "\n".join(self._said[-20:])
            raise RuntimeError(f"Azurite did not start within {START_TIMEOUT_S:g} s (exit status {self._proc.poll()})."
                               f" It said:\n{said}\nHINT: run `bash .ci/install.sh` again.")
        return self

    @property
    def connection_string(self) -> str:
        return (f"DefaultEndpointsProtocol=http;AccountName={AZURE_ACCOUNT};AccountKey={AZURE_KEY};"
                f"BlobEndpoint={self.wait().endpoint}/{AZURE_ACCOUNT};")

    @property
    def storage_options(self) -> dict[str, Any]:
        return {"connection_string": self.connection_string}

    def filesystem(self) -> Any:
        import adlfs

        return adlfs.AzureBlobFileSystem(**self.storage_options, skip_instance_cache=True)

    def container(self) -> str:
        """A new, empty container of its own."""
        name = f"test-{uuid.uuid4().hex[:12]}"
        self.filesystem().mkdir(name)
        return name

    def stop(self) -> None:
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()


def gcs() -> Gcs:
    global _GCS
    with _LOCK:
        if _GCS is None:
            _GCS = Gcs()
        return _GCS


def azurite(wait: bool = True) -> Azurite:
    """The session's Azurite; ``wait=False`` starts it and returns at once (:meth:`Azurite.wait` later)."""
    global _AZURITE
    with _LOCK:
        if _AZURITE is None:
            _AZURITE = Azurite()
        server = _AZURITE
    return server.wait() if wait else server


def stop() -> None:
    global _GCS, _AZURITE
    with _LOCK:
        for server in (_GCS, _AZURITE):
            if server is not None:
                server.stop()
        _GCS = _AZURITE = None
