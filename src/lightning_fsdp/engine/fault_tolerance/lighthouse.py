"""The lighthouse: torchft's quorum server, one per job, that every replica group's rank 0 talks to each step.

``lightning-fsdp lighthouse --min-replicas N`` (:mod:`lightning_fsdp.cli`) runs :func:`serve`; torchft's own
``torchft_lighthouse`` does the same job. The address it prints (``http://<host>:<port>``) is what every group needs
in ``TORCHFT_LIGHTHOUSE``. It holds nothing worth saving: a lighthouse that dies is restarted at the same address and
the groups form their next quorum with it (until then they fail their step with a ``FaultToleranceError``).
"""

from __future__ import annotations

import signal
import threading
from typing import Callable, Optional

from lightning_fsdp.engine.fault_tolerance.config import require_torchft

__all__ = ["DEFAULT_BIND", "serve"]

DEFAULT_BIND = "[::]:29510"  # torchft's own default port for its lighthouse


def serve(min_replicas: int, *, bind: str = DEFAULT_BIND, join_timeout_ms: int = 60_000,
          quorum_tick_ms: int = 100, heartbeat_timeout_ms: int = 5_000,
          announce: Callable[[str], None] = print, stop: Optional[threading.Event] = None) -> None:
    """Serve a lighthouse until SIGINT or SIGTERM (or ``stop`` is set), then shut it down and return.

    ``join_timeout_ms``: how long a quorum waits for groups beyond ``min_replicas`` to join; ``heartbeat_timeout_ms``:
    how long a silent group still counts as live. The defaults are torchft's.
    """
    require_torchft()
    from torchft.coordination import LighthouseServer

    try:
        server = LighthouseServer(bind=bind, min_replicas=min_replicas, join_timeout_ms=join_timeout_ms,
                                  quorum_tick_ms=quorum_tick_ms, heartbeat_timeout_ms=heartbeat_timeout_ms)
    except RuntimeError as err:  # torchft's words: "invalid socket address", "Address already in use"
        raise ValueError(f"The lighthouse could not listen at bind={bind!r} ({err}). HINT: give HOST:PORT of this"
                         " host with a port nobody else uses, e.g. [::]:29510, or [::]:0 for any free port.") from err
    stop = stop or threading.Event()
    previous = {}
    if threading.current_thread() is threading.main_thread():  # signal handlers can only be set there
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, lambda *_: stop.set())
    try:
        address = server.address()
        announce(f"lighthouse serving at {address} (min_replicas={min_replicas}); give every replica group"
                 f" TORCHFT_LIGHTHOUSE={address}. Ctrl-C or SIGTERM stops it.")
        while not stop.wait(0.5):
            pass
    finally:
        server.shutdown()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
