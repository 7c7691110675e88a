"""Warm Python processes for the test suite's launches: a new rank costs milliseconds instead of seconds of imports.

Most of a small launch is start-up: every rank, and torchrun itself, imports torch and Lightning (3-4 s each on the
2-core reference machine). Here a server (``server.py``) imports them once and forks a process per request; a
client (``client.py``, started as the ``python`` shim :func:`python` returns) stands in for each forked process, so
that torchrun, and the test, see an ordinary child: its exit code, its signals, its output.

The pytest side uses it through ``tests/launch.py``: :func:`env` adds the variables that route torchrun and its
ranks through the shim. Which processes may be forked, and which must be real, is said in CONTRIBUTING.md ("Forked
or real processes"). ``LFSDP_TEST_FORKSERVER=0`` turns it off for a run: every launch then starts real processes.

Servers start on demand, one per environment that fits (every rank shares one: see ``server.RANK_VARIABLES``), the
second time a process of that environment asks, and stop with this pytest process (:func:`stop`, and each server
also watches its owner).
"""

from __future__ import annotations

import atexit
import glob
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
_DIR: str | None = None


def enabled() -> bool:
    return os.environ.get("LFSDP_TEST_FORKSERVER", "1") != "0" and sys.platform == "linux"


def directory() -> str:
    """The servers' folder, made at first use. Short, because a socket path must fit in 107 bytes."""
    global _DIR
    if _DIR is None:
        _DIR = tempfile.mkdtemp(prefix="lfsdp-fs-", dir="/tmp")
        # Python itself, not a shell: a shell would export its own idea of PWD, which imports read.
        (Path(_DIR) / "python").write_text(
            f"#!{sys.executable} -S\nimport sys\nsys.path.insert(0, {str(HERE)!r})\nimport client\nclient.main()\n"
        )
        os.chmod(Path(_DIR) / "python", 0o755)
        atexit.register(stop)
    return _DIR


def python() -> str:
    """The ``python`` to start a forkable process with: ``[python(), ARGS...]`` runs like
    ``[sys.executable, ARGS...]``."""
    return str(Path(directory()) / "python") if enabled() else sys.executable


def env(ranks: bool = True, full_exit: bool = False) -> dict[str, str]:
    """Variables for a process started with :func:`python`: where the servers are. With ``ranks``, torchrun's ranks
    are forked too (torchrun starts them with ``$PYTHON_EXEC``); without, they are real processes. Any process a
    forked one starts with ``sys.executable`` is forked as well, where its environment fits a server.

    ``full_exit``: the forked processes end as a new interpreter does, with every object the server imported back in
    the collector's reach (``gc.unfreeze``), so that the last collection at exit runs over all of them; for the tests
    of how a process exits. It costs the second at exit that freezing saves."""
    if not enabled():
        return {}
    # A forked process's sys.executable is the shim, so torchrun's ranks need a real one named to be real.
    found = {"LFSDP_FORKSERVER_DIR": directory(), "LFSDP_FORKSERVER_OWNER": str(os.getpid()),
             "PYTHON_EXEC": python() if ranks else sys.executable}
    return {**found, "LFSDP_FORKSERVER_FULL_EXIT": "1"} if full_exit else found


def prewarm(wanted: dict[str, str]) -> str | None:
    """Start a server for the environment ``wanted`` now, so that the first processes of the session are forked too
    (a server's imports take a few seconds; until one serves an environment, its processes run real). Returns the
    server's name, for :func:`wait_until_serving`."""
    if not enabled():
        return None
    from forkserver import client
    return client.start_server(directory(), wanted)


def wait_until_serving(name: str | None, timeout_s: float = 60.0) -> None:
    """Wait until the server ``name`` serves (or started and refused to), or ``timeout_s`` passed."""
    if not enabled() or name is None:
        return
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if any(os.path.exists(os.path.join(directory(), f"{name}.{end}")) for end in ("sock", "alias", "refused")):
            return
        time.sleep(0.2)


def summary() -> str:
    """How many servers started, what their imports cost, and how many processes they forked or refused."""
    if _DIR is None:
        return ""
    logs = [Path(p).read_text() for p in glob.glob(os.path.join(_DIR, "*.log"))]
    imports = [float(line.split(" after ")[1].split()[0]) for log in logs for line in log.splitlines()
               if line.startswith("serving ")]
    forked = sum(line.startswith("forked ") for log in logs for line in log.splitlines())
    real = Path(_DIR) / "real-processes.txt"
    real = real.read_text().splitlines() if real.is_file() else []
    # Each real one costs a full start (imports, and a collection at exit): name them, so that a new one shows.
    shown = [" ".join(arg if len(arg) < 80 else arg[:60].replace("\n", " ") + "..." for arg in json.loads(line))
             for line in real]
    named = "".join(f"\n  {count} x {argv}" for argv, count in Counter(shown).most_common())
    return (f"{len(imports)} fork servers ({sum(imports):.0f} s of imports in all), {forked} processes forked,"
            f" {len(real)} run as real processes (no server fitted their environment yet){':' if real else ''}{named}")


def stop() -> None:
    """Stop every server and remove their folder."""
    global _DIR
    if _DIR is None:
        return
    pids = []
    for path in glob.glob(os.path.join(_DIR, "keys-*.json")):
        pid = int(Path(path).stem.split("-", 1)[1])
        try:
            os.kill(pid, signal.SIGTERM)
            pids.append(pid)
        except ProcessLookupError:
            pass
    deadline = time.time() + 5
    while pids and time.time() < deadline:
        pids = [p for p in pids if _alive(p)]
        time.sleep(0.05)
    shutil.rmtree(_DIR, ignore_errors=True)
    _DIR = None


def _alive(pid: int) -> bool:
    """Running (a zombie that nobody has reaped yet counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
