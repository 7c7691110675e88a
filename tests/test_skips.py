"""The skip rule (``tests/skips.py``): every skip is listed with its reason, and a skip that is not about the
installed versions fails the run, where pytest alone would exit 0."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from skips import allowed

pytestmark = pytest.mark.single_process

TESTS = Path(__file__).resolve().parent


def _session(tmp_path: Path, body: str) -> subprocess.CompletedProcess:
    (tmp_path / "conftest.py").write_text(
        f"import sys\nsys.path.insert(0, {str(TESTS)!r})\nimport skips\n\n\n"
        "def pytest_configure(config):\n    config.pluginmanager.register(skips.SkipRule(), 'lfsdp-skip-rule')\n")
    (tmp_path / "test_some.py").write_text("import pytest\n\n\n" + body)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path),
                           str(tmp_path)], cwd=tmp_path, capture_output=True, text=True, timeout=120)


def test_a_skip_about_this_machine_fails_the_run_and_every_skip_is_listed(tmp_path):
    run = _session(tmp_path, "def test_passes():\n    pass\n\n\n"
                             "def test_version():\n    pytest.skip('WeightAveraging needs Lightning 2.6')\n\n\n"
                             "def test_machine():\n    pytest.skip('cannot mount a tmpfs here: permission denied')\n")
    assert run.returncode == 1, run.stdout + run.stderr
    assert "allowed: test_some.py::test_version: WeightAveraging needs Lightning 2.6" in run.stdout, run.stdout
    assert ("NOT ALLOWED: test_some.py::test_machine: cannot mount a tmpfs here: permission denied"
            in run.stdout), run.stdout
    assert "1 skip(s) not about the installed versions" in run.stdout, run.stdout


def test_a_missing_module_skipped_at_collection_fails_the_run(tmp_path):
    run = _session(tmp_path, "pytest.importorskip('a_module_that_is_not_installed')\n\n\n"
                             "def test_never():\n    pass\n")
    assert run.returncode == 1, run.stdout + run.stderr
    assert "NOT ALLOWED: test_some.py: could not import 'a_module_that_is_not_installed'" in run.stdout, run.stdout


def test_version_skips_alone_pass(tmp_path):
    run = _session(tmp_path, "def test_version():\n    pytest.skip('WeightAveraging needs Lightning 2.6')\n")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "skipped tests (1), each with its reason" in run.stdout, run.stdout


def test_the_registry_reads_reasons_by_their_start():
    assert allowed("WeightAveraging needs Lightning 2.6")
    assert allowed("LFSDP_TEST_FORKSERVER=0: launches are not forked")
    assert not allowed("cannot mount a tmpfs here: mount: only root can do that")
    assert not allowed("could not import 'transformers': No module named 'transformers'")
    assert not allowed("this needs Lightning to be faster")
