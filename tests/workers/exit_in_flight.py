"""A rank that exits while one of its gloo collectives is still running: the crash at exit, forced.

This is how "terminate called without an active exception" ended finished test launches. A gloo worker thread
finishes a collective and drops the work, which releases its tensors; in torch 2.13 that takes the GIL (the tensors
have Python objects). If the worker starts waiting for the GIL just before the interpreter finalizes and gets it only
during finalization, Python 3.11 ends the thread with ``pthread_exit``, the forced unwind meets a ``noexcept``
destructor, and C++ calls ``std::terminate``. The model keeps its process group alive, so destroying the groups at
exit does not stop the worker. In a real job the window is a few milliseconds; here it is forced open:

- rank 0 starts an all-reduce on the model's group, drops the handle without waiting, and exits;
- its ``atexit`` handlers, in the order they run: the marker (rank 1 may join now), the library's handler, the
  others, and last one that holds the GIL for a while in C code (a sort), so that the worker, done meanwhile,
  waits for the GIL until finalization; an object with a finalizer that sleeps hands the GIL over then;
- rank 1 joins the all-reduce shortly after the marker appears.

Without the wait at exit in ``lightning_fsdp/_base/process_exit.py`` rank 0 aborts; with it, the library's handler holds
the exit until the worker has dropped the work, and both ranks exit 0.
"""

from __future__ import annotations

import atexit
import os
import random

if os.environ.get("RANK") == "0":
    # The first handler registered runs last, after every other one (whose Python code would hand the GIL over):
    # so this goes before any other import. A sort holds the GIL in C code for about a second.
    atexit.register(sorted, [random.random() for _ in range(1_500_000)])

import json  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from common import make_fabric  # noqa: E402
from harness import TIMEOUT, case, rank, run_cases  # noqa: E402
from lightning_fsdp._base.process_exit import busy_collective_threads  # noqa: E402

KEPT: list = []  # alive until the interpreter's teardown, as a user's model and tensors are
JOIN_AFTER_S = 0.1  # rank 1 joins the all-reduce this long after rank 0 started exiting


class HandsOverTheGIL:
    """Finalized during the interpreter's teardown (it sits in a reference cycle, so the collector frees it); its
    sleep releases the GIL, as a finalizer that does I/O would."""

    def __init__(self) -> None:
        self.cycle = self

    def __del__(self, sleep=time.sleep) -> None:  # bound now: the module's globals may be gone by then
        sleep(0.5)


def record_after_the_wait(out: Path) -> None:
    """Runs right after the library's handler: when it ended, and whether any worker was still busy."""
    out.write_text(json.dumps({"time": time.time(), "busy": busy_collective_threads()}))


@case
def leave_an_all_reduce_in_flight_at_exit():
    folder = Path(os.environ["LFSDP_TEST_OUT"])
    if rank() == 0:
        atexit.register(record_after_the_wait, folder / "rank0-after-wait.json")  # before the library's: runs after
    fabric = make_fabric(2)
    marker = folder / "rank0-exiting"
    model = fabric.setup_module(torch.nn.Linear(16, 16))
    group = fabric.strategy._engine.mesh.get_group()  # held by the model, so it outlives destroy_process_group
    value = torch.full((64,), float(fabric.global_rank + 1))
    KEPT.extend([model, value])
    if fabric.global_rank == 0:
        HandsOverTheGIL()
        atexit.register(marker.write_text, "exiting")  # registered after the library's handler, so it runs first
        dist.all_reduce(value, group=group, async_op=True)  # the handle is dropped at once
        # Until rank 1 joins, a worker waits in the collective: the check at exit must see it as busy. The worker
        # takes the work within milliseconds; the bound is the process group's timeout, past which the collective
        # itself would have failed, so a busy machine cannot fail this.
        deadline = time.monotonic() + TIMEOUT.total_seconds()
        while not busy_collective_threads():  # (once a worker has taken the work from the queue)
            assert time.monotonic() < deadline, "the worker running the all-reduce reads as idle"
            time.sleep(0.001)
        return "left in flight"
    deadline = time.monotonic() + 120
    while not marker.exists():
        if time.monotonic() > deadline:
            raise TimeoutError("rank 0 never reached its exit")
        time.sleep(0.005)
    time.sleep(JOIN_AFTER_S)
    (folder / "rank1-joined.json").write_text(json.dumps({"time": time.time()}))
    dist.all_reduce(value, group=group, async_op=True).wait()
    assert value.tolist() == [3.0] * 64, value
    return "joined after rank 0 started exiting"


if __name__ == "__main__":
    run_cases()
