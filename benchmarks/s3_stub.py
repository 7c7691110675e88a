"""A minimal S3 endpoint for measuring clients, not servers (issue 43 item 6): aiohttp, path-style, bodies kept in
memory, no MD5 (the ETag is a counter), no signature checks. moto spends Python time per byte (werkzeug, an MD5 per
object, copies) and saturates a core at about 13 MB/s, so against it every client looks alike; against this stub the
client's own cost shows.

Only what the clients we compare send: bucket PUT, object PUT (``If-None-Match: *`` and ``If-Match`` answered with
412 as S3 does), GET with or without ``Range``, HEAD, DELETE, ListObjectsV2, and multipart create / upload part /
complete / abort. Bodies sent ``aws-chunked`` (botocore's and the CRT's streaming checksums) are decoded.

    .venv/bin/python benchmarks/s3_stub.py [--port 0]     # prints "listening on http://127.0.0.1:PORT"
"""

from __future__ import annotations

import argparse
import itertools
import time
from typing import Optional
from xml.sax.saxutils import escape

from aiohttp import web

_ETAGS = itertools.count(1)
_CHUNK = 2**20
NS = 'xmlns="http://s3.amazonaws.com/doc/2006-03-01/"'


class Stub:
    def __init__(self) -> None:
        self.buckets: dict[str, dict[str, tuple[bytes, str, float]]] = {}
        self.uploads: dict[str, dict[int, tuple[bytes, str]]] = {}

    async def handle(self, request: web.Request) -> web.StreamResponse:
        bucket, _, key = request.path.lstrip("/").partition("/")
        query = request.query
        method = request.method
        if not key:
            if method == "PUT":
                self.buckets.setdefault(bucket, {})
                return web.Response(status=200)
            if method in ("GET", "HEAD"):
                return self._list(bucket, query)
            return _error(405, "MethodNotAllowed")
        objects = self.buckets.get(bucket)
        if objects is None:
            return _error(404, "NoSuchBucket")
        if method == "POST" and "uploads" in query:
            upload = f"u{next(_ETAGS)}"
            self.uploads[upload] = {}
            return _xml(f"<InitiateMultipartUploadResult {NS}><Bucket>{bucket}</Bucket><Key>{escape(key)}</Key>"
                        f"<UploadId>{upload}</UploadId></InitiateMultipartUploadResult>")
        if "uploadId" in query:
            return await self._multipart(request, objects, key, query["uploadId"])
        if method == "PUT":
            refused = _precondition(request, objects.get(key))
            if refused:
                return refused
            body = await _body(request)
            etag = f'"{next(_ETAGS):032x}"'
            objects[key] = (body, etag, time.time())
            return web.Response(status=200, headers={"ETag": etag})
        if method in ("GET", "HEAD"):
            found = objects.get(key)
            if found is None:
                return _error(404, "NoSuchKey") if method == "GET" else web.Response(status=404)
            body, etag, when = found
            headers = {"ETag": etag, "Last-Modified": time.strftime("%a, %d %b %Y %H:%M:%S GMT", time.gmtime(when)),
                       "Accept-Ranges": "bytes", "Content-Type": "application/octet-stream"}
            start, end, status = 0, len(body), 200
            if "Range" in request.headers:
                first, _, last = request.headers["Range"].removeprefix("bytes=").partition("-")
                start = int(first) if first else max(0, len(body) - int(last))
                end = min(len(body), int(last) + 1) if (first and last) else len(body)
                if start >= len(body):
                    return _error(416, "InvalidRange")
                status = 206
                headers["Content-Range"] = f"bytes {start}-{end - 1}/{len(body)}"
            if method == "HEAD":
                headers["Content-Length"] = str(end - start)
                return web.Response(status=status, headers=headers)
            # Written in 1 MiB views: one write of a whole large body makes aiohttp buffer a copy of it.
            response = web.StreamResponse(status=status, headers=headers)
            response.content_length = end - start
            await response.prepare(request)
            view = memoryview(body)
            for at in range(start, end, _CHUNK):
                await response.write(view[at:min(at + _CHUNK, end)])
            await response.write_eof()
            return response
        if method == "DELETE":
            objects.pop(key, None)
            return web.Response(status=204)
        return _error(405, "MethodNotAllowed")

    async def _multipart(self, request: web.Request, objects: dict, key: str, upload: str) -> web.StreamResponse:
        parts = self.uploads.get(upload)
        if parts is None:
            return _error(404, "NoSuchUpload")
        if request.method == "PUT":
            body = await _body(request)
            etag = f'"{next(_ETAGS):032x}"'
            parts[int(request.query["partNumber"])] = (body, etag)
            return web.Response(status=200, headers={"ETag": etag})
        if request.method == "DELETE":
            del self.uploads[upload]
            return web.Response(status=204)
        # complete: the parts in number order (the client's list is trusted; this is a benchmark stub)
        await request.read()
        refused = _precondition(request, objects.get(key))
        if refused:
            return refused
        del self.uploads[upload]
        etag = f'"{next(_ETAGS):032x}-{len(parts)}"'
        objects[key] = (b"".join(parts[n][0] for n in sorted(parts)), etag, time.time())
        return _xml(f"<CompleteMultipartUploadResult {NS}><Key>{escape(key)}</Key><ETag>{escape(etag)}</ETag>"
                    "</CompleteMultipartUploadResult>")

    def _list(self, bucket: str, query) -> web.Response:
        objects = self.buckets.get(bucket)
        if objects is None:
            return _error(404, "NoSuchBucket")
        prefix, delimiter = query.get("prefix", ""), query.get("delimiter", "")
        contents, prefixes = [], set()
        for key in sorted(objects):
            if not key.startswith(prefix):
                continue
            rest = key[len(prefix):]
            if delimiter and delimiter in rest:
                prefixes.add(prefix + rest.split(delimiter, 1)[0] + delimiter)
                continue
            body, etag, when = objects[key]
            stamp = time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime(when))
            contents.append(f"<Contents><Key>{escape(key)}</Key><LastModified>{stamp}</LastModified>"
                            f"<ETag>{escape(etag)}</ETag><Size>{len(body)}</Size>"
                            "<StorageClass>STANDARD</StorageClass></Contents>")
        common = "".join(f"<CommonPrefixes><Prefix>{escape(p)}</Prefix></CommonPrefixes>" for p in sorted(prefixes))
        return _xml(f"<ListBucketResult {NS}><Name>{bucket}</Name><Prefix>{escape(prefix)}</Prefix>"
                    f"<KeyCount>{len(contents) + len(prefixes)}</KeyCount><MaxKeys>1000</MaxKeys>"
                    f"<IsTruncated>false</IsTruncated>{''.join(contents)}{common}</ListBucketResult>")


def _precondition(request: web.Request, current: Optional[tuple]) -> Optional[web.Response]:
    if request.headers.get("If-None-Match") == "*" and current is not None:
        return _error(412, "PreconditionFailed")
    match = request.headers.get("If-Match")
    if match is not None and (current is None or current[1] != match):
        return _error(412 if current is not None else 404, "PreconditionFailed" if current else "NoSuchKey")
    return None


async def _body(request: web.Request) -> bytes:
    raw = await request.read()
    encoded = request.headers.get("Content-Encoding", "")
    if "aws-chunked" in encoded or request.headers.get("x-amz-content-sha256", "").startswith("STREAMING-"):
        return _dechunk(raw)
    return raw


def _dechunk(raw: bytes) -> bytes:
    """The payload of an ``aws-chunked`` body: ``<hex size>[;chunk-signature=...]\\r\\n<data>\\r\\n`` until a zero
    size, then trailers (checksums), which this stub ignores."""
    out, at = [], 0
    while True:
        line_end = raw.index(b"\r\n", at)
        size = int(raw[at:line_end].split(b";", 1)[0], 16)
        if size == 0:
            return b"".join(out)
        out.append(raw[line_end + 2:line_end + 2 + size])
        at = line_end + 2 + size + 2


def _xml(text: str, status: int = 200) -> web.Response:
    return web.Response(status=status, body=('<?xml version="1.0" encoding="UTF-8"?>' + text).encode(),
                        content_type="application/xml")


def _error(status: int, code: str) -> web.Response:
    return _xml(f"<Error><Code>{code}</Code><Message>{code}</Message></Error>", status)


def app() -> web.Application:
    stub = Stub()
    application = web.Application(client_max_size=6 * 2**30)
    application.router.add_route("*", "/{tail:.*}", stub.handle)
    return application


def main() -> None:
    import asyncio

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args()

    async def serve() -> None:
        runner = web.AppRunner(app(), access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, args.host, args.port)
        await site.start()
        host, port = site._server.sockets[0].getsockname()[:2]  # noqa: SLF001 (the port the system chose)
        print(f"listening on http://{host}:{port}", flush=True)
        await asyncio.Event().wait()

    asyncio.run(serve())


if __name__ == "__main__":
    main()
