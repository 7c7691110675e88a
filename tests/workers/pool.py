"""One launch for the cases of several worker scripts (``tests/launch.py`` starts it; see ``case_tests``).

Each rank runs the scripts named in ``$LFSDP_TEST_SCRIPTS`` one after another, in this process: each as ``python
SCRIPT`` would (``__main__``, so its own ``run_cases()`` call, and whatever its main block does first, runs as
usual), writing its results into ``$LFSDP_TEST_OUT/<script stem>/``. The cases share the process and its process
group: the isolation guard of ``harness.run_cases`` fails a case that leaves state behind for the cases after it.
Once every script has run, the rank's exit status (1 if any case failed) is written into every script's folder, as
the pytest side expects of one launch per script.
"""

import json
import os
import runpy
import sys
from pathlib import Path

import torch

import harness

HERE = Path(__file__).resolve().parent


def main() -> None:
    _lower_priority(int(os.environ.get("LFSDP_TEST_NICE", "0")))
    root = Path(os.environ["LFSDP_TEST_OUT"])
    scripts = os.environ["LFSDP_TEST_SCRIPTS"].split(",")
    harness.POOLED = True
    root.mkdir(parents=True, exist_ok=True)
    harness.STARTED = open(root / f"_started.rank{harness.rank()}.txt", "a")  # noqa: SIM115 - open until exit
    for script in scripts:
        os.environ["LFSDP_TEST_OUT"] = str(root / Path(script).stem)
        harness.CASES.clear()
        # Each script starts with dynamo's caches empty, as in a process of its own: frames compiled for one
        # script's models (a hook shared by every model, say) otherwise carry guards into the next script's compiles,
        # and on Lightning 2.5 building such a guard failed with an IndexError inside dynamo.
        torch._dynamo.reset()
        try:
            runpy.run_path(str(HERE / script), run_name="__main__")
        except BaseException as err:  # noqa: BLE001 - a script that fails outside its cases fails its launch
            harness.POOL_FAILED = True
            print(f"[rank {harness.rank()}] {script} failed outside its cases: {err!r}", file=sys.stderr, flush=True)
            if not isinstance(err, Exception):
                raise
    os.environ["LFSDP_TEST_OUT"] = str(root)
    code = 1 if harness.POOL_FAILED else 0
    for script in scripts:
        folder = root / Path(script).stem
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"_exit.rank{harness.rank()}.json").write_text(json.dumps({"code": code}))
    sys.exit(code)


def _lower_priority(niceness: int) -> None:
    """A pool runs in the background, beside the tests that need no pool: at a lower priority, it takes the CPU those
    leave idle (a launch starting, saving, waiting on its other rank) and little else (``launch.POOL_NICE``).

    Where the kernel groups processes by session for scheduling (autogroup, the default), a process's niceness weighs
    only against the processes of its own session, and a forked rank is a session of its own: the session's group
    gets the niceness too, or it would change nothing."""
    if not niceness:
        return
    os.nice(niceness)
    try:
        with open("/proc/self/autogroup", "w") as group:
            group.write(str(niceness))
    except OSError:  # no autogroup here: the niceness alone counts
        pass


if __name__ == "__main__":
    main()
