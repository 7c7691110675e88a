"""Cases that leak on purpose, each one kind of state, for ``tests/test_isolation.py``: the isolation guard in
``harness.run_cases`` must fail every leaky case, naming what it left behind, and pass the clean cases between them.
Run as a plain script (one process, rank 0): what it checks needs no second rank."""

import os
import signal
import tempfile
import threading

import torch.distributed as dist

from harness import case, run_cases

_kept = []  # what the leaky cases keep alive, so only the guard can see it


@case
def clean_first():
    return "nothing left behind"


@case
def leaks_an_environment_variable():
    os.environ["LFSDP_LEAKED_ON_PURPOSE"] = "1"


@case
def clean_after_a_leak():
    # The leak above stays (the guard reports, it does not repair): this case changes nothing more, so it passes.
    return "nothing left behind"


@case
def leaks_a_signal_handler():
    signal.signal(signal.SIGUSR2, lambda *_: None)


@case
def leaks_a_thread():
    stop = threading.Event()
    _kept.append(stop)
    threading.Thread(target=stop.wait, name="leaked-on-purpose").start()


@case
def leaks_an_open_file():
    handle = tempfile.NamedTemporaryFile(prefix="leaked-on-purpose-")
    _kept.append(handle)


@case
def creates_the_group_the_cases_share():
    # Allowed: the first Fabric of a launch does exactly this, and the cases after it use the group.
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


@case
def destroys_the_shared_group():
    dist.destroy_process_group()


@case
def leaks_a_working_directory():
    os.chdir(tempfile.gettempdir())


@case
def stops_the_thread():
    # Undoes leaks_a_thread's thread; the guard sees a thread that ended, which is no leak.
    _kept[0].set()


if __name__ == "__main__":
    run_cases()
