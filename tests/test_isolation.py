"""The isolation guard fails a case that leaks state into the cases after it (``workers/isolation.py``).

Shown from the pytest side, in both places where cases share a process: the worker harness (``run_cases``, every
case of a worker script in one launch) and the in-process command line (``inprocess.run_cli``). Each test passes
only because the guard failed the leaky case, naming what it left behind, while the clean cases beside it passed."""

from __future__ import annotations

import json
import os
import signal
import subprocess

import pytest

from inprocess import Leak, run_cli
import forkserver
from launch import WORKERS, Launch, worker_env

# case -> what the guard must say about it (None: a clean case, which must pass)
EXPECTED = {
    "clean_first": None,
    "leaks_an_environment_variable": "environment variable LFSDP_LEAKED_ON_PURPOSE: None -> '1'",
    "clean_after_a_leak": None,
    "leaks_a_signal_handler": "signal handler of SIGUSR2",
    "leaks_a_thread": "non-daemon thread still running: 'leaked-on-purpose'",
    "leaks_an_open_file": "file left open: ",
    "creates_the_group_the_cases_share": None,
    "destroys_the_shared_group": "the default process group was destroyed",
    "leaks_a_working_directory": "working directory: ",
    "stops_the_thread": None,
}


def test_the_harness_fails_each_case_that_leaks_and_only_those(tmp_path):
    out = tmp_path / "leaky"
    env = worker_env(out, LFSDP_TEST_THREAD_GRACE_S="0.5")
    env.pop("RANK", None)
    proc = subprocess.run([forkserver.python(), str(WORKERS / "leaky.py")], env=env, capture_output=True, text=True,
                          timeout=300)
    launch = Launch(out=out, world_size=1, log=proc.stdout + proc.stderr, returncode=proc.returncode)
    for name, leak in EXPECTED.items():
        record = launch.result(name, 0)
        if leak is None:
            assert record["ok"], f"the clean case {name} failed:\n{record.get('error')}"
        else:
            assert not record["ok"], f"the guard let {name} pass: {record}"
            assert f"case {name} leaked state into the cases after it" in record["error"], record["error"]
            assert leak in record["error"], record["error"]
    assert json.loads((out / "_exit.rank0.json").read_text())["code"] == 1
    assert proc.returncode == 1, launch.log[-3000:]


def _leaky_main(what):
    def main(argv):
        if what == "env":
            os.environ["LFSDP_LEAKED_ON_PURPOSE"] = "1"
        elif what == "signal":
            signal.signal(signal.SIGUSR2, lambda *_: None)
        elif what == "group":
            import torch.distributed as dist

            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        elif what == "file":
            _kept.append(open(__file__))  # noqa: SIM115 - left open on purpose
        print("done")
        return 0

    return main


_kept = []


@pytest.mark.parametrize(("what", "leak"), [
    ("env", "environment variable LFSDP_LEAKED_ON_PURPOSE"),
    ("signal", "signal handler of SIGUSR2"),
    ("group", "a default process group was created and left initialized"),
    ("file", "file left open: "),
])
def test_the_in_process_command_line_fails_a_run_that_leaks(tmp_path, what, leak):
    before_handler = signal.getsignal(signal.SIGUSR2)
    try:
        with pytest.raises(Leak, match=leak):
            run_cli(["anything"], cwd=tmp_path, main=_leaky_main(what))
    finally:  # undo the leak, so this test leaves this process as it found it
        os.environ.pop("LFSDP_LEAKED_ON_PURPOSE", None)
        signal.signal(signal.SIGUSR2, before_handler)
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
        while _kept:
            _kept.pop().close()


def test_the_in_process_command_line_passes_a_clean_run(tmp_path):
    result = run_cli(["anything"], cwd=tmp_path, main=_leaky_main("nothing"))
    assert (result.returncode, result.stdout, result.stderr) == (0, "done\n", "")
