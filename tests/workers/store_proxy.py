"""A TCP proxy on 127.0.0.1 in front of a store's endpoint (moto's S3 server), to make real outages: the client's
sockets, its timeouts and its retries meet a store that drops connections or stops answering, as a network does.
``memory://`` cannot show any of it.

Modes (:meth:`StoreProxy.set`); every switch first resets every connection open through the proxy, so that no pooled
keep-alive connection carries the old mode over:

- ``"pass"``: bytes go both ways;
- ``"reset"``: every connection is accepted and reset at once (RST): a dropped connection, as a restarting load
  balancer gives;
- ``"stall"``: connections are accepted and read, and nothing is ever answered: a store that stopped answering;
- ``"stall-objects"``: as ``"pass"``, but a request for a checkpoint's data (a key under a ``/.<token>/`` prefix)
  is never answered, nor anything after it on that connection: listings and COMMIT objects are read, and the store
  stops answering once a reader is verifying (a request line comes whole in one read: the client sends its headers
  in one write);
- ``"reset-objects"``: the same requests are answered by a reset instead (RST): connections dropped while a reader
  verifies.

``drop_next(n)`` resets the next ``n`` connections and passes the rest (an outage counted in connections, which
no machine's speed changes). ``outage(mode, seconds)`` switches to ``mode`` and back to ``"pass"`` after ``seconds``, in a daemon timer thread.
Used by ``tests/test_store_outages.py`` in the pytest process and by ``workers/store_outages.py`` on rank 0.
"""

from __future__ import annotations

import socket
import struct
import threading
from urllib.parse import urlsplit

__all__ = ["StoreProxy"]


class StoreProxy:
    def __init__(self, upstream: str) -> None:
        parts = urlsplit(upstream)
        self._upstream = (parts.hostname, parts.port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        host, port = self._listener.getsockname()
        self.endpoint = f"http://{host}:{port}"
        self.mode = "pass"
        self.resets = 0  # connections reset because of the mode (not the switches' resets of open ones)
        self._open: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = False
        self._drop = 0
        threading.Thread(target=self._accept, daemon=True, name="store-proxy-accept").start()

    def set(self, mode: str) -> None:
        assert mode in ("pass", "reset", "stall", "stall-objects", "reset-objects"), mode
        with self._lock:
            self.mode = mode
            doomed, self._open = self._open, set()
        for sock in doomed:
            _reset(sock)

    def drop_next(self, count: int) -> None:
        self.set("pass")
        self._drop = count

    def outage(self, mode: str, seconds: float) -> threading.Timer:
        self.set(mode)
        timer = threading.Timer(seconds, self.set, args=("pass",))
        timer.daemon = True
        timer.start()
        return timer

    def close(self) -> None:
        self._closed = True
        self._listener.close()
        self.set("pass")

    # --- the threads ----------------------------------------------------------------------------------------

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            mode = self.mode
            if self._drop > 0:
                self._drop -= 1
                mode = "reset"
            if mode == "reset":
                self.resets += 1
                _reset(client)
                continue
            with self._lock:
                self._open.add(client)
            if mode == "stall":
                threading.Thread(target=self._sink, args=(client,), daemon=True).start()
                continue
            try:
                upstream = socket.create_connection(self._upstream, timeout=10)
                upstream.settimeout(None)
            except OSError:
                _reset(client)
                continue
            with self._lock:
                self._open.add(upstream)
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                if self.mode in ("stall-objects", "reset-objects") and _object_request(data):
                    if self.mode == "reset-objects":
                        self.resets += 1
                        _reset(src)
                    else:
                        self._sink(src)
                    break
                dst.sendall(data)
        except OSError:
            pass
        for sock in (src, dst):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()
        with self._lock:
            self._open.difference_update((src, dst))

    def _sink(self, client: socket.socket) -> None:
        try:
            while client.recv(65536):
                pass
        except OSError:
            pass
        client.close()


def _object_request(data: bytes) -> bool:
    line = data.split(b"\r\n", 1)[0]
    parts = line.split(b" ")
    return len(parts) == 3 and parts[0] == b"GET" and b"/." in parts[1].split(b"?", 1)[0]


def _reset(sock: socket.socket) -> None:
    """Close with RST, not FIN: the peer sees 'connection reset by peer'."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()
    except OSError:
        pass
