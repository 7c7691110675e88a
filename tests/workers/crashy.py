"""Cases around a rank that segfaults on purpose, for ``tests/test_pool_restart.py``: a pool that loses a rank inside a
case starts again, running that case once more and then the cases after it. A case that crashed once only passes on
its second run, with the first crash's stacks kept beside it; a case that crashes every time fails, with its stacks."""

import faulthandler
import os
from pathlib import Path

import torch
import torch.distributed as dist

from harness import case, rank, run_cases


def _group() -> None:
    if not dist.is_initialized():
        dist.init_process_group("gloo")


def _crash_rank_0() -> None:
    if rank() == 0:
        faulthandler._sigsegv()  # a real SIGSEGV, as a bug in native code would raise
    dist.barrier()  # rank 1 waits here for a rank that is gone


@case
def before_the_crashes():
    _group()
    dist.barrier()
    return os.getpid()


@case
def reports_its_priority():
    """The niceness the pool gave this rank (``launch.POOL_NICE``), and its scheduling group's where the kernel has
    autogroup."""
    autogroup = Path("/proc/self/autogroup")
    return {"nice": os.nice(0), "autogroup": autogroup.read_text().strip() if autogroup.exists() else None}


@case
def segfaults_on_rank_0_in_its_first_run_only():
    _group()
    marker = Path(os.environ["LFSDP_TEST_OUT"]) / "crashed_once"
    first_run = not marker.exists()
    dist.barrier()  # every rank has looked before rank 0 leaves the marker
    if first_run:
        if rank() == 0:
            marker.touch()
        _crash_rank_0()
    return os.getpid()


@case
def segfaults_on_rank_0_every_time():
    _group()
    _crash_rank_0()
    return os.getpid()


@case
def after_the_crashes():
    _group()
    total = torch.ones(1)
    dist.all_reduce(total)
    assert total.item() == dist.get_world_size(), total
    return os.getpid()


if __name__ == "__main__":
    run_cases()
