"""Cases around a rank that segfaults on purpose, for ``tests/test_pool_restart.py``: the case a rank dies in must
fail showing that rank's stacks, and the pool must start again for the cases after it, which then run and pass."""

import faulthandler
import os

import torch
import torch.distributed as dist

from harness import case, rank, run_cases


def _group() -> None:
    if not dist.is_initialized():
        dist.init_process_group("gloo")


@case
def before_the_crash():
    _group()
    dist.barrier()
    return os.getpid()


@case
def segfaults_on_rank_0():
    _group()
    if rank() == 0:
        faulthandler._sigsegv()  # a real SIGSEGV, as a bug in native code would raise
    dist.barrier()  # rank 1 waits here for a rank that is gone
    return os.getpid()


@case
def after_the_crash():
    _group()
    total = torch.ones(1)
    dist.all_reduce(total)
    assert total.item() == dist.get_world_size(), total
    return os.getpid()


if __name__ == "__main__":
    run_cases()
