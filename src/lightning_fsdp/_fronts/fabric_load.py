"""``fabric.load`` with the ``weights_only`` opt-in, on every supported Lightning.

Lightning 2.6's ``Fabric.load`` takes ``weights_only`` and passes it to the strategy; Lightning 2.5's takes no such
argument, so a user of 2.5 could not reach the opt-in to full unpickling that this package's errors name.
:func:`fabric_load` is ``fabric.load`` on either: on 2.6 it is exactly that call; on 2.5 it runs 2.5's own
``fabric.load`` (which unwraps the Fabric objects and restores user entries in place) with the strategy's
``load_checkpoint`` bound to the given ``weights_only`` for that one call.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, Optional, Union

from lightning_fsdp._base.compat import FABRIC_LOAD_TAKES_WEIGHTS_ONLY

__all__ = ["fabric_load"]


def fabric_load(
    fabric: Any, path: Union[str, Path], state: Optional[dict[str, Any]] = None, strict: bool = True, *,
    weights_only: Optional[bool] = None,
) -> dict[str, Any]:
    """``fabric.load(path, state, strict, weights_only=weights_only)`` on Lightning 2.5 and 2.6 alike.

    Example (a checkpoint you trust that holds objects beyond tensors)::

        from lightning_fsdp import fabric_load
        fabric_load(fabric, "ckpt", {"model": model, "optimizer": optimizer}, weights_only=False)
    """
    if FABRIC_LOAD_TAKES_WEIGHTS_ONLY or weights_only is None:
        extra = {} if weights_only is None else {"weights_only": weights_only}
        return fabric.load(path, state, strict, **extra)
    strategy = fabric.strategy
    # An instance attribute shadows the method for this one call only; `finally` removes it even if the load fails.
    strategy.load_checkpoint = functools.partial(type(strategy).load_checkpoint, strategy, weights_only=weights_only)
    try:
        return fabric.load(path, state, strict)
    finally:
        del strategy.load_checkpoint
