"""A Trainer script whose last checkpoint is a background save that fails (issue 21, item 9, Trainer front): every
write of step 2's checkpoint raises ENOSPC (injected into DCP's file streams on every rank). Not a harness script:
the pytest side (``tests/test_async_exit.py``) checks torchrun's exit status and the output."""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path

import torch.distributed.checkpoint.filesystem as dcp_fs
from lightning.pytorch.callbacks import ModelCheckpoint

from trainer_common import LitGPT, loader, make_trainer, strategy

WHERE = Path(os.environ["LFSDP_EXIT_DIR"])
original = dcp_fs.FileSystem.create_stream


@contextmanager
def create_stream(self, path, mode):
    if "w" in mode and ".step=2.ckpt." in str(path):
        raise OSError(28, os.strerror(28), str(path))
    with original(self, path, mode) as stream:
        yield stream


dcp_fs.FileSystem.create_stream = create_stream
callback = ModelCheckpoint(dirpath=WHERE, filename="{step}", every_n_train_steps=1, save_top_k=-1)
trainer = make_trainer(strategy(state_dict_type="sharded", async_save=True), max_steps=2, enable_checkpointing=True,
                       callbacks=[callback])
trainer.fit(LitGPT(), loader())
print(f"rank {trainer.global_rank}: fit returned", flush=True)
