"""Turning a failed collective into an error a user can act on.

When a rank dies or hangs, the survivors see a backend error such as gloo's "Connection reset by peer" or "Timed
out waiting 5000ms". Those name neither the rank that raised nor the cause nor the setting that bounds the wait.
:func:`explain_collective_failure` re-raises them as :class:`CollectiveFailure`, which does, and keeps the original
as ``__cause__``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Optional

import torch.distributed as dist

__all__ = ["CollectiveFailure", "explain_collective_failure", "remember_timeout"]

# The default process group's timeout, recorded when the engine creates it: the forward pass is explained from the
# precision plugin, which has no handle on the strategy's settings. None when this package did not create the group
# (the user's script or an earlier Fabric did): then its timeout is unknown here, and messages do not guess it.
_process_group_timeout: Optional[timedelta] = None


def remember_timeout(timeout: Optional[timedelta]) -> None:
    """Record the timeout the default process group was created with; ``None`` when it is not known."""
    global _process_group_timeout
    _process_group_timeout = timeout


class CollectiveFailure(RuntimeError):
    """A collective failed because another rank died, hung or diverged."""


@contextmanager
def explain_collective_failure(phase: str) -> Iterator[None]:
    try:
        yield
    except CollectiveFailure:
        raise
    except dist.DistError as err:
        raise CollectiveFailure(_message(phase, err)) from err
    except RuntimeError as err:
        # Some backends (gloo among them) raise plain RuntimeErrors from their transport layer.
        text = str(err)
        if any(mark in text for mark in ("gloo", "NCCL", "Connection reset", "Connection closed", "Timed out")):
            raise CollectiveFailure(_message(phase, err)) from err
        raise


def _message(phase: str, err: BaseException) -> str:
    timeout = _process_group_timeout
    limit = f"timeout={timeout}" if timeout is not None else "the process group's timeout"
    return (
        f"A collective in {phase} failed on {_suspects()}, which has most likely died, hung, or run a different"
        f" sequence of collectives; waits are bounded by {limit}. The first error is usually in that rank's log."
        f" HINT: fix that rank's error; if a rank is only slow (e.g. a long save), raise `FSDPStrategy(timeout=...)`."
        f" (Reported by {_reporter()}.) Backend error: {str(err).strip()}"
    )


def _reporter() -> str:
    return f"rank {dist.get_rank()} of {dist.get_world_size()}" if dist.is_initialized() else "this rank"


def _suspects() -> str:
    """The rank that failed, as far as this rank can tell: the backends' errors name a peer's address at most, never
    its rank, so with two ranks it is the other one, and with more it is one of the others."""
    if not dist.is_initialized():
        return "another rank"
    me, world = dist.get_rank(), dist.get_world_size()
    others = [r for r in range(world) if r != me]
    if len(others) == 1:
        return f"rank {others[0]}"
    shown = ", ".join(map(str, others[:8])) + (", ..." if len(others) > 8 else "")
    return f"one of the other ranks ({shown})"
