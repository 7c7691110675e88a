"""Every test the READMEs cite exists: a renamed or deleted test breaks this, not the claim it was meant to prove.

A cited id is a backquoted ``tests/test_x.py``, ``test_x.py::test_name``, ``tests/test_x.py::test_case[name]`` (``*``
allowed, as in ``[parity_*]``), or a bare ``[name]`` / ``test_case[name]``, which refers to a file named in the same
table or paragraph. Each must match at least one test of the suite: the ids this session collected where it collected
the whole suite (``conftest.suite_ids``), else those ``pytest --collect-only`` finds.
"""

from __future__ import annotations

import fnmatch
import re
import subprocess
import sys
from pathlib import Path

import pytest

# Every test here keeps one core busy (this process, or one subprocess at a time): they run first, beside the
# background pools (tests/conftest.py).
pytestmark = pytest.mark.single_process

ROOT = Path(__file__).resolve().parent.parent
DOCS = ["README.md", "configs/README.md", *(str(p.relative_to(ROOT)) for p in sorted((ROOT / "docs").rglob("*.md")))]
CODE = re.compile(r"`([^`\n]+)`")
FILE_ID = re.compile(r"^(?:tests/)?(test_\w+\.py)(?:::(\w+)?(\[[^\]]*\])?)?$")
WORKER_FILE = re.compile(r"^tests/(?:workers/)?[\w/]+\.py$")
BARE_ID = re.compile(r"^(?:(\w+))?(\[[^\]]+\])$")


def _blocks(text: str) -> list[str]:
    """Tables and paragraphs: runs of non-empty lines (a table is one block, so a bare id may lean on any row)."""
    return [b for b in re.split(r"\n\s*\n", text) if b.strip()]


def cited_ids(text: str) -> list[tuple[str, str]]:
    """(pattern over collected node ids, how the doc wrote it) for every cited test."""
    cited = []
    for block in _blocks(text):
        spans = CODE.findall(block)
        files = [f"tests/{m.group(1)}" for m in map(FILE_ID.match, spans) if m]
        for span in spans:
            if m := FILE_ID.match(span):
                path, func, params = f"tests/{m.group(1)}", m.group(2), m.group(3)
                cited.append((f"{path}::{func or '*'}{_escape(params) if params else '*'}" if func or params
                              else f"{path}::*", span))
            elif WORKER_FILE.match(span):
                cited.append((span, span))
            elif m := BARE_ID.match(span):
                # No file in the block: nothing it could refer to, so it is reported (an empty pattern matches none).
                func, params = m.group(1) or "*", _escape(m.group(2))
                cited.append(("|".join(f"{f}::{func}{params}" for f in dict.fromkeys(files)) or "::", span))
    return cited


def _escape(params: str) -> str:
    # `[` opens a character class in fnmatch: match the brackets literally, keep `*` as a wildcard.
    return "".join({"[": "[[]", "]": "[]]"}.get(c, c) for c in params)


@pytest.fixture(scope="module")
def collected(suite_ids) -> list[str]:
    if suite_ids is not None:  # this session collected the whole suite already
        return suite_ids
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "tests"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    ids = [line.strip() for line in proc.stdout.splitlines() if "::" in line]
    assert len(ids) > 100, f"collection found only {len(ids)} tests:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return ids


def _exists(pattern: str, collected: list[str]) -> bool:
    if "::" not in pattern:  # a file such as tests/workers/convert_memory.py
        return (ROOT / pattern).is_file()
    return any(fnmatch.fnmatchcase(node, alt) for alt in pattern.split("|") if alt != "::" for node in collected)


@pytest.mark.parametrize("doc", DOCS)
def test_every_cited_test_exists(doc, collected):
    cited = cited_ids((ROOT / doc).read_text())
    assert cited or doc != "docs/guides/checkpoints.md", f"no test ids found in {doc}: the parser is broken"
    missing = [written for pattern, written in cited if not _exists(pattern, collected)]
    assert not missing, f"{doc} cites tests that pytest does not collect: {missing}"


def test_the_parser_sees_a_wrong_id():
    """The control: a misspelled id in a table, bare or qualified, is reported."""
    table = ("| a | `tests/test_fabric_core.py::test_case[parity_*]` |\n| b | `[sharding_is_real]` |\n"
             "| c | `[no_such_case]`, `test_trainer_core.py::test_case[nope]` |\n\nA paragraph with no file: `[orphan]`.\n")
    collected = ["tests/test_fabric_core.py::test_case[parity_full_shard]",
                 "tests/test_fabric_core.py::test_case[sharding_is_real]"]
    missing = [w for p, w in cited_ids(table) if not _exists(p, collected)]
    assert missing == ["[no_such_case]", "test_trainer_core.py::test_case[nope]", "[orphan]"], missing
