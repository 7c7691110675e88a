"""Every skip is listed, with its reason, at the end of a run, and a skip that is not about the installed versions
fails the run.

A skip passes silently in pytest's exit status: a disk-full test that skips because this machine cannot mount a
tmpfs, or a Hugging Face test that skips because transformers is missing, shows as green. Here a skip passes only
if its reason matches :data:`ALLOWED`, the registry of skips that are about the versions installed (a feature of a
newer Lightning) or about a switch the runner turned off on purpose; any other skip turns the session red
(exit status 1), and the summary says which and why. To add a skip, add its reason's pattern here with the case
for it; a skip about this machine (no root, no tmpfs, no GPU) does not belong in the suite: make the test run
here, or put it where CI does not collect it (``tests/gpu``).

Registered by ``tests/conftest.py`` (``pytest_configure``).
"""

from __future__ import annotations

import importlib.util
import re

import pytest

# (pattern of the reason, why such a skip is not a hidden failure)
ALLOWED: list[tuple[str, str]] = [
    (r"^\S+ needs (?:torch|Lightning|transformers|litgpt|safetensors|Python) \d+(?:\.\d+)*\b",
     "a feature of a newer version than the one installed (the CI legs install each supported version)"),
    (r"^LFSDP_TEST_FORKSERVER=0: ",
     "the runner turned the fork servers off, and these tests are about the fork servers"),
]


def require(module: str) -> None:
    """Where a module the tests require is missing, fail (an ImportError at collection) where ``importorskip``
    would skip: transformers and litgpt are the `test` extra's, safetensors the package's own dependency."""
    if importlib.util.find_spec(module) is None:
        raise ImportError(f"{module!r} is required by the tests (a dependency in pyproject.toml, or its `test` extra) "
                          "and is not installed. HINT: install it with `bash .ci/install.sh`, or "
                          "`pip install -e '.[test]'`.")


def allowed(reason: str) -> bool:
    """Whether a skip with this reason may pass: it matches a pattern of :data:`ALLOWED`."""
    return any(re.search(pattern, reason) for pattern, _ in ALLOWED)


def reason_of(report) -> str:
    longrepr = report.longrepr
    text = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return text.removeprefix("Skipped: ")


class SkipRule:
    """The pytest plugin: collects every skip (of a test or of a whole file at collection), lists them in the
    terminal summary, and sets the exit status to 1 where one is not allowed."""

    def __init__(self) -> None:
        self.skips: list[tuple[str, str]] = []

    def _note(self, report) -> None:
        if report.skipped and not hasattr(report, "wasxfail"):
            self.skips.append((report.nodeid, reason_of(report)))

    def pytest_runtest_logreport(self, report) -> None:
        self._note(report)

    def pytest_collectreport(self, report) -> None:
        self._note(report)

    def unexplained(self) -> list[tuple[str, str]]:
        return [(nodeid, reason) for nodeid, reason in self.skips if not allowed(reason)]

    def pytest_sessionfinish(self, session) -> None:
        quiet = (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED)
        if self.unexplained() and session.exitstatus in quiet:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if not self.skips:
            return
        terminalreporter.write_sep("=", f"skipped tests ({len(self.skips)}), each with its reason")
        for nodeid, reason in self.skips:
            terminalreporter.write_line(f"{'allowed' if allowed(reason) else 'NOT ALLOWED'}: {nodeid}: {reason}")
        bad = self.unexplained()
        if bad:
            terminalreporter.write_line(
                f"the run fails: {len(bad)} skip(s) not about the installed versions; make those tests run here, or "
                "add the reason to tests/skips.py's ALLOWED with why it is not a hidden failure", red=True, bold=True)
