"""Run the ``lightning-fsdp`` command inside the pytest process: ``lightning_fsdp.cli.main(argv)``, as the installed
entry point calls it, without the ~7 s of imports a new Python process pays.

:func:`run_cli` returns what a subprocess run would: the exit status (``main``'s return value), stdout and stderr.
It runs the command as a fresh process would see it, and leaves nothing behind for the next test:

- it runs in ``cwd`` (``plan`` imports ``MODULE:FACTORY`` from the working directory);
- Python warnings raised during the run are written to the returned stderr the way a fresh interpreter prints them
  (one line each, with its default filters), so "stderr is exactly one line" still fails on a stray warning; pytest
  would otherwise capture them out of sight;
- the modules it imported from ``cwd`` (the user's model files) are removed from ``sys.modules`` afterwards, so the
  next run imports them afresh, as a new process would;
- the isolation guard (``workers/isolation.py``) then checks that the run left no environment variable, signal
  handler, thread, open file, ``sys.path`` entry or default process group behind (``plan`` makes a fake process
  group of the planned world size; it must destroy it). A leak raises :class:`Leak`, failing the test.

What only a real process shows (the installed script, import-time output, ``python -m``'s exit status) is left to the
few tests that still run the command as a subprocess: ``test_cli.py::test_entry_points_run_as_commands``,
``test_planner.py::test_json_output_has_the_peak_per_rank_and_the_breakdown`` and
``test_planner.py::test_bad_input_exits_2_from_a_real_process``.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

sys.path.insert(0, str(Path(__file__).parent / "workers"))

import isolation  # noqa: E402


class Leak(AssertionError):
    """A run of the command in this process left state behind."""


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str


def run_cli(argv: Sequence[object], cwd: Optional[Path] = None, main: Optional[Callable[[list[str]], int]] = None
            ) -> Result:
    if main is None:
        from lightning_fsdp.cli import main
    cwd = Path(cwd or os.getcwd()).resolve()
    modules = set(sys.modules)
    before = isolation.snapshot()
    out, err = io.StringIO(), io.StringIO()
    try:
        os.chdir(cwd)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), \
                warnings.catch_warnings(record=True) as caught:
            _fresh_interpreter_filters()
            try:
                status = main([str(a) for a in argv])
            except SystemExit as exit_:  # `--help`, or anything that exits as the script would
                status = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
        for w in caught:
            err.write(warnings.formatwarning(w.message, w.category, w.filename, w.lineno, w.line))
    finally:
        os.chdir(before.cwd)
        _forget_modules_from(cwd, modules)
        # `plan` puts the working directory and a model file's folder on sys.path, as `python -m` would have.
        sys.path[:] = [p for p in sys.path if p in before.path]
    left = isolation.leaks(before, allow_new_group=False)
    if left:
        raise Leak(f"`lightning-fsdp {' '.join(map(str, argv))}` run in this process left state behind:\n  "
                   + "\n  ".join(left))
    return Result(status, out.getvalue(), err.getvalue())


def _fresh_interpreter_filters() -> None:
    """The warning filters of `python -m lightning_fsdp` with no -W options: DeprecationWarning and friends hidden
    (except those pointing at ``__main__``), everything else shown; here every occurrence is shown, which is
    stricter than once per location."""
    warnings.resetwarnings()
    warnings.simplefilter("always")
    for category in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
        warnings.filterwarnings("ignore", category=category)


def _forget_modules_from(folder: Path, before: set[str]) -> None:
    for name in set(sys.modules) - before:
        file = getattr(sys.modules[name], "__file__", None)
        if file and Path(file).resolve().is_relative_to(folder):
            del sys.modules[name]
