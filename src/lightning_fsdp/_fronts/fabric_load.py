"""``fabric.load`` with the arguments Lightning's ``Fabric.load`` does not pass on, on every supported Lightning.

Lightning 2.6's ``Fabric.load`` takes ``weights_only`` and passes it to the strategy; Lightning 2.5's takes no such
argument, so a user of 2.5 could not reach the opt-in to full unpickling that this package's errors name. Neither
version's ``Fabric.load`` takes ``storage_options`` (the fsspec options of one load from a URL), which the strategy's
``load_checkpoint`` does. :func:`fabric_load` is ``fabric.load`` with both: with only what Lightning passes itself it
is exactly that call; otherwise it runs Lightning's own ``fabric.load`` (which unwraps the Fabric objects and restores
user entries in place) with the strategy's ``load_checkpoint`` bound to the other arguments for that one call.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, Optional, Union

from lightning_fsdp._base.compat import FABRIC_LOAD_TAKES_WEIGHTS_ONLY

__all__ = ["fabric_load"]


def fabric_load(
    fabric: Any, path: Union[str, Path], state: Optional[dict[str, Any]] = None, strict: bool = True, *,
    weights_only: Optional[bool] = None, storage_options: Optional[dict[str, Any]] = None,
) -> dict[str, Any]:
    """``fabric.load(path, state, strict, weights_only=weights_only)`` on Lightning 2.5 and 2.6 alike, with
    ``storage_options`` (the fsspec options of this one load, overriding the strategy's) when given.

    Example (a checkpoint you trust that holds objects beyond tensors)::

        from lightning_fsdp import fabric_load
        fabric_load(fabric, "ckpt", {"model": model, "optimizer": optimizer}, weights_only=False)
    """
    bound: dict[str, Any] = {} if storage_options is None else {"storage_options": storage_options}
    extra: dict[str, Any] = {}
    if weights_only is not None:
        (extra if FABRIC_LOAD_TAKES_WEIGHTS_ONLY else bound)["weights_only"] = weights_only
    if not bound:
        return fabric.load(path, state, strict, **extra)
    strategy = fabric.strategy
    # An instance attribute shadows the method for this one call only; `finally` removes it even if the load fails.
    strategy.load_checkpoint = functools.partial(type(strategy).load_checkpoint, strategy, **bound)
    try:
        return fabric.load(path, state, strict, **extra)
    finally:
        del strategy.load_checkpoint
