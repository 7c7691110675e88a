"""``trainer.fit(..., ckpt_path="last")`` where a ``ModelCheckpoint`` saves to a URL (``dirpath="s3://..."``).

Lightning finds "last" by listing each ``ModelCheckpoint``'s directory with fsspec, then looking the names up on the
local filesystem: the listing drops the URL's protocol, so a bucket's ``last.ckpt`` is never found, and ``fit``
starts from scratch with only a warning. A checkpoint at a URL is also a prefix with a ``COMMIT`` object (see
:mod:`~lightning_fsdp.checkpoint.io.remote`), not one object with a modification time to compare.

So, for our strategy and a URL ``dirpath`` only, "last" is resolved here through the checkpoint's store: among the
committed checkpoints named ``last.ckpt`` or ``last-v<N>.ckpt`` in each such directory, the one committed last (its
commit order, as ``latest`` and retention use). Local directories, and a URL directory that holds no committed
``last`` checkpoint, go to Lightning's own code unchanged.
"""

from __future__ import annotations

import re
from typing import Any, Optional

from lightning_fsdp._base.compat import TRAINER_CKPT_PATH_PARSE, trainer_checkpoint_connector
from lightning_fsdp._fronts.mixin import FrontMixin
from lightning_fsdp._fronts.patching import wrap_once
from lightning_fsdp.checkpoint.formats.commit_order import commit_order_value
from lightning_fsdp.checkpoint.io.store import store_for

__all__ = ["register", "newest_last_in_stores"]

_LAST_NAME = re.compile(r"^last(-v?\d+)?\.ckpt$")


def register() -> None:
    """Wrap the Trainer's resolution of ``ckpt_path`` (idempotent)."""

    def make(original: Any) -> Any:
        def parse_ckpt_path(self: Any, state_fn: Any, ckpt_path: Any, *args: Any, **kwargs: Any) -> Any:
            if ckpt_path == "last" and isinstance(self.trainer.strategy, FrontMixin):
                found = newest_last_in_stores(self.trainer)
                if found is not None:
                    return found
            return original(self, state_fn, ckpt_path, *args, **kwargs)

        return parse_ckpt_path

    wrap_once(trainer_checkpoint_connector(), TRAINER_CKPT_PATH_PARSE, make)


def newest_last_in_stores(trainer: Any) -> Optional[str]:
    """The URL of the ``last`` checkpoint committed last in the URL directories of ``trainer``'s ModelCheckpoints."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    options = trainer.strategy._storage_options(None)
    newest: Optional[tuple[int, str]] = None
    for callback in trainer.checkpoint_callbacks:
        dirpath = getattr(callback, "dirpath", None) if isinstance(callback, ModelCheckpoint) else None
        store = None if dirpath is None else store_for(str(dirpath), options)
        if store is None or not store.remote:  # Lightning resolves `last` in a local directory itself
            continue
        for name, path, record in store.checkpoints_in(str(dirpath)):
            if _LAST_NAME.match(name):
                order = commit_order_value(record) or 0
                if newest is None or order > newest[0]:
                    newest = (order, str(path))
    return None if newest is None else newest[1]
