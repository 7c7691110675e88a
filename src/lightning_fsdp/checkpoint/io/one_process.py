"""The collectives of one process, for a store's operations when one process reads or writes alone (``convert``,
``inspect``, the checks of ``latest``): every step is agreed with itself only."""

from __future__ import annotations

import contextlib
from typing import Any

__all__ = ["OneProcess"]


class OneProcess:
    """A ``Communicator`` (:mod:`~lightning_fsdp.checkpoint.integrity.agreement`) of one rank."""

    global_rank = 0

    def barrier(self) -> None:
        pass

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return obj

    def agree(self, error: Any) -> Any:
        return None if error is None else (0, error)

    def guard(self, phase: str) -> contextlib.AbstractContextManager[None]:
        """Nothing to watch: no other rank can fail while this one waits."""
        return contextlib.nullcontext()
