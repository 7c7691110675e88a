"""The strategy's ``storage_options`` reach the filesystem of a ``ModelCheckpoint`` in a bucket.

``ModelCheckpoint(dirpath="s3://...")`` builds its own fsspec filesystem in ``setup`` (Lightning's
``get_filesystem(dirpath)``, with no options) and asks it whether the directory is empty (rank 0, at ``fit``), whether
a file name is taken (every save) and which ``last`` checkpoints exist. With the endpoint or credentials only in the
strategy's ``storage_options``, that filesystem reads the environment instead: the first listing fails, or asks
another endpoint. So, for our strategy only, while ``ModelCheckpoint.setup`` runs its ``get_filesystem`` builds URL
filesystems with the strategy's options (a call's own keyword arguments win); a local ``dirpath``, another strategy
or a strategy without options is left to Lightning unchanged. Removals go through the strategy
(``FSDPStrategy.remove_checkpoint``), which uses the same options.
"""

from __future__ import annotations

from typing import Any

from lightning_fsdp._fronts.mixin import FrontMixin
from lightning_fsdp._fronts.patching import wrap_once
from lightning_fsdp.checkpoint.io.store import store_for

__all__ = ["register"]


def register() -> None:
    """Wrap ``ModelCheckpoint.setup`` (idempotent)."""
    from lightning.pytorch.callbacks import ModelCheckpoint, model_checkpoint

    def make(original: Any) -> Any:
        def setup(self: Any, trainer: Any, pl_module: Any, stage: str) -> Any:
            strategy = trainer.strategy
            options = strategy._storage_options(None) if isinstance(strategy, FrontMixin) else None
            if not options:
                return original(self, trainer, pl_module, stage)
            plain = model_checkpoint.get_filesystem

            def get_filesystem(path: Any, **kwargs: Any) -> Any:
                # Options are for a remote store's filesystem: Lightning's local one takes none.
                return plain(path, **({**options, **kwargs} if store_for(str(path)).remote else kwargs))

            # Swapped for this call only, in the thread that runs the Trainer's hooks; `finally` restores it.
            model_checkpoint.get_filesystem = get_filesystem
            try:
                return original(self, trainer, pl_module, stage)
            finally:
                model_checkpoint.get_filesystem = plain

        return setup

    wrap_once(ModelCheckpoint, "setup", make)
