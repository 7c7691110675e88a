"""A process group of one rank in the test process (gloo, an in-memory store): for in-process tests that need real
DTensors (``fully_shard``) or DCP's collectives without launching ranks. Each test module wraps it in a fixture of
the scope it needs: ``with one_rank_group(): yield``."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch.distributed as dist


@contextmanager
def one_rank_group() -> Iterator[None]:
    assert not dist.is_initialized(), "a process group is already up in this process"
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
