"""The fork server (``tests/forkserver``) stands in faithfully for a fresh Python process, or refuses to.

A launch the suite forks must look, to torchrun and to the test, like one started with ``python``: the same exit
code, the same death by signal, signals reaching the process, the same ``sys.argv``, ``sys.path``, ``__main__``,
working directory, environment and output, new random seeds, and its death when whoever stands for it dies. A
request whose environment differs from the server's where imports read it gets a real process instead.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import forkserver
from launch import worker_env

pytestmark = pytest.mark.skipif(not forkserver.enabled(), reason="LFSDP_TEST_FORKSERVER=0: launches are not forked")

PROBE = r'''
import json, os, random, sys, signal, time
import torch
out = {
    "pid": os.getpid(), "argv": sys.argv, "path0": sys.path[0], "cwd": os.getcwd(), "main": __name__,
    "file": __file__, "spec": __spec__ is None, "value": os.environ.get("LFSDP_PROBE_VALUE"),
    "unset": "LFSDP_PROBE_UNSET" in os.environ, "torch_seed": torch.initial_seed(), "random": random.random(),
    "frozen": __import__("gc").get_freeze_count(), "umask": os.umask(0o022),
    "forked": "forkserver/server.py" in open(f"/proc/{os.getppid()}/cmdline").read(), "ppid_server": os.getppid(),
    "default_term": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
    "int_handler": signal.getsignal(signal.SIGINT) is signal.default_int_handler,
}
print(json.dumps(out), flush=True)
print("to stderr", file=sys.stderr, flush=True)
mode = sys.argv[1] if len(sys.argv) > 1 else "exit0"
if mode.startswith("exit"):
    sys.exit(int(mode[4:]))
if mode == "raise":
    raise ValueError("raised at top level")
if mode == "kill_self":
    os.kill(os.getpid(), signal.SIGKILL)
if mode == "trap_term":
    def on_term(signum, frame):
        print("got SIGTERM", flush=True)
        sys.exit(7)
    signal.signal(signal.SIGTERM, on_term)
    open(os.environ["PROBE_READY"], "w").close()
    time.sleep(60)
if mode == "child":  # a process this one starts with sys.executable
    import subprocess
    child = subprocess.run([sys.executable, __file__, "exit5"], capture_output=True, text=True)
    print(json.dumps({"child": json.loads(child.stdout.splitlines()[0]), "code": child.returncode}), flush=True)
if mode == "pipe":  # descriptors a parent passes with pass_fds
    read_fd, write_fd = int(sys.argv[2]), int(sys.argv[3])
    os.write(write_fd, os.read(read_fd, 100).upper())
if mode == "sleep":
    open(os.environ["PROBE_READY"], "w").close()
    time.sleep(60)
if mode == "ranks":  # what Lightning and torchmetrics set from the rank variables at import
    import lightning.fabric.utilities.rank_zero as fabric, lightning.pytorch.utilities.rank_zero as pytorch
    import lightning_utilities.core.rank_zero as utilities, torchmetrics.utilities.prints as metrics
    print(json.dumps({m.__name__: m.rank_zero_only.rank for m in (fabric, pytorch, utilities, metrics)}), flush=True)
'''


@pytest.fixture(scope="module")
def probe(tmp_path_factory) -> Path:
    where = tmp_path_factory.mktemp("forkserver")
    script = where / "probe.py"
    script.write_text(PROBE)
    return script


def run(probe: Path, *args: str, env: dict | None = None, popen: bool = False, **kwargs):
    # The environment of torchrun in a launch, so that the server already warm for it forks the probe.
    environ = worker_env(probe.parent / "out", LFSDP_PROBE_VALUE="v1")
    environ.update(env or {})
    environ.pop("LFSDP_PROBE_UNSET", None)
    command = [forkserver.python(), str(probe), *args]
    if popen:
        return subprocess.Popen(command, env=environ, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                **kwargs)
    return subprocess.run(command, env=environ, capture_output=True, text=True, timeout=120, **kwargs)


def report(proc) -> dict:
    return json.loads(proc.stdout.splitlines()[0])


@pytest.fixture(scope="module")
def warm(probe):
    """Run until a server for this environment has started and served a request (the first runs are real)."""
    deadline = time.time() + 120
    while time.time() < deadline:
        if report(run(probe))["forked"]:
            return
        time.sleep(0.5)
    pytest.fail("no fork server started within 120 s")


def test_a_forked_process_looks_like_a_fresh_one(probe, warm, tmp_path):
    one, two = run(probe, "exit0", cwd=tmp_path), run(probe, "exit0", cwd=tmp_path)
    a, b = report(one), report(two)
    assert a["forked"] and b["forked"], (one.stderr, two.stderr)
    assert one.returncode == 0 and one.stderr == "to stderr\n", one.stderr
    assert a["argv"] == [str(probe), "exit0"]
    assert (a["path0"], a["file"], a["main"], a["spec"]) == (str(probe.parent), str(probe), "__main__", True)
    assert a["cwd"] == str(tmp_path) and a["value"] == "v1" and not a["unset"]
    assert a["umask"] == _umask()
    assert a["default_term"]
    # New seeds in each process, as a fresh interpreter draws them.
    assert a["torch_seed"] != b["torch_seed"] and a["random"] != b["random"]


@pytest.mark.parametrize("inherited", [signal.SIG_IGN, signal.SIG_DFL])
def test_signals_ignored_by_the_parent_stay_ignored(probe, warm, inherited):
    # A background job's processes start with SIGINT ignored, and a new Python leaves it so; otherwise Python
    # installs its KeyboardInterrupt handler. Whatever the server itself inherited.
    proc = run(probe, preexec_fn=lambda: signal.signal(signal.SIGINT, inherited))
    assert report(proc)["forked"] and report(proc)["int_handler"] == (inherited == signal.SIG_DFL)


def test_a_full_exit_puts_every_object_back_in_the_collectors_reach(probe, warm):
    # Frozen, the server's imports cost nothing at exit; the exit tests ask for a new interpreter's whole last
    # collection instead.
    frozen, full = report(run(probe)), report(run(probe, env={"LFSDP_FORKSERVER_FULL_EXIT": "1"}))
    assert frozen["forked"] and full["forked"]
    assert frozen["frozen"] > 100_000 and full["frozen"] == 0, (frozen["frozen"], full["frozen"])


def test_exit_codes_and_deaths_by_signal_come_through(probe, warm):
    assert run(probe, "exit3").returncode == 3
    raised = run(probe, "raise")
    assert raised.returncode == 1 and "ValueError: raised at top level" in raised.stderr
    assert run(probe, "kill_self").returncode == -signal.SIGKILL


def test_a_signal_to_the_stand_in_reaches_the_process(probe, warm, tmp_path):
    ready = tmp_path / "ready"
    proc = run(probe, "trap_term", env={"PROBE_READY": str(ready)}, popen=True)
    _wait_for(ready)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 7 and "got SIGTERM" in out
    assert json.loads(out.splitlines()[0])["forked"]


def test_descriptors_passed_to_the_stand_in_reach_the_process(probe, warm):
    to_child, from_parent = os.pipe()
    from_child, to_parent = os.pipe()
    os.write(from_parent, b"through the pipe")
    proc = run(probe, "pipe", str(to_child), str(to_parent), pass_fds=(to_child, to_parent))
    for fd in (to_child, from_parent, to_parent):
        os.close(fd)
    assert proc.returncode == 0 and report(proc)["forked"], proc.stderr
    assert os.read(from_child, 100) == b"THROUGH THE PIPE"
    os.close(from_child)


def test_a_process_started_with_sys_executable_is_forked_too(probe, warm):
    # Lightning's launcher starts the other ranks with sys.executable: they are forked as well.
    proc = run(probe, "child")
    assert proc.returncode == 0, proc.stderr
    nested = json.loads(proc.stdout.splitlines()[1])
    assert nested["code"] == 5 and nested["child"]["forked"] and nested["child"]["argv"] == [str(probe), "exit5"]


def test_killing_the_stand_in_kills_the_process(probe, warm, tmp_path):
    ready = tmp_path / "ready"
    proc = run(probe, "sleep", env={"PROBE_READY": str(ready)}, popen=True)
    _wait_for(ready)
    proc.kill()
    proc.wait(timeout=60)
    pid = json.loads(proc.stdout.readline())["pid"]
    deadline = time.time() + 30
    while forkserver._alive(pid) and time.time() < deadline:
        time.sleep(0.05)
    assert not forkserver._alive(pid), f"the forked process {pid} outlived its stand-in"


@pytest.mark.parametrize("variable", ["HF_HOME", "PYTHONHASHSEED", "OMP_NUM_THREADS"])
def test_an_environment_imports_would_read_differently_gets_a_real_process(probe, warm, variable):
    # huggingface_hub reads HF_HOME at import, the interpreter PYTHONHASHSEED at start, OpenMP OMP_NUM_THREADS at
    # load: a process forked from a server that started with other values would not be what was asked for.
    proc = run(probe, env={variable: "37", "LFSDP_FORKSERVER_START": "0"})  # and start no server for it
    assert proc.returncode == 0 and not report(proc)["forked"]


# RANK before LOCAL_RANK for Lightning, LOCAL_RANK alone for torchmetrics; SLURM_PROCID before JSM_NAMESPACE_RANK.
RANKS = [{"RANK": "3", "LOCAL_RANK": "1"}, {"SLURM_PROCID": "5", "JSM_NAMESPACE_RANK": "6"}]


def test_every_rank_is_forked_from_one_server_with_the_ranks_a_fresh_interpreter_sets(probe, warm):
    # One server serves every rank (server.RANK_VARIABLES): a forked process sets again what Lightning and
    # torchmetrics set from RANK, LOCAL_RANK, SLURM_PROCID and JSM_NAMESPACE_RANK at import. Each must be what a
    # fresh interpreter with that environment has; the fresh ones run side by side.
    environ = {k: v for k, v in worker_env(probe.parent / "out").items() if k not in ("RANK", "LOCAL_RANK")}
    fresh = [subprocess.Popen([sys.executable, str(probe), "ranks"], env={**environ, **ranks}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for ranks in RANKS]
    forked = [run(probe, "ranks", env=ranks) for ranks in RANKS]
    for ranks, real, fork in zip(RANKS, fresh, forked):
        out, err = real.communicate(timeout=300)
        assert real.returncode == 0 and fork.returncode == 0, (err, fork.stderr)
        assert report(fork)["forked"], f"{ranks}: not forked ({fork.stderr})"
        expected, got = json.loads(out.splitlines()[1]), json.loads(fork.stdout.splitlines()[1])
        assert got == expected, f"{ranks}: forked {got}, fresh {expected}"
    assert len({report(fork)["ppid_server"] for fork in forked}) == 1, "the ranks came from more than one server"


def test_unsupported_interpreter_options_get_a_real_process(probe, warm):
    proc = subprocess.run([forkserver.python(), "-X", "dev", str(probe)], env=worker_env(probe.parent / "out"),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and not report(proc)["forked"]


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _wait_for(path: Path) -> None:
    deadline = time.time() + 60
    while not path.exists():
        assert time.time() < deadline, f"{path} never appeared"
        time.sleep(0.02)
