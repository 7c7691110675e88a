"""The runnable blocks of the README and the documentation site, found by one parser for the tests to run.

Every fenced Python block is a snippet and must run as it stands, whatever its fence (```` ``` ```` or ``~~~``), its
tag (``python``, ``py``, ``python3``, ``py3``) or attributes after the tag (``python title="train.py"``); a
``pycon`` session (``>>>`` prompts) cannot run and is refused. An HTML comment right before the fence
(blank lines allowed) says how: ``<!-- snippet: ranks=2 -->`` runs it on 2 CPU processes under torchrun (a Fabric
or Trainer script with ``devices=2``), the default is one plain process. A ```` ```yaml ```` block marked
``<!-- snippet: cli-config -->`` is a LightningCLI config, run with ``examples/cli_train.py fit --config``. Other
blocks (```` ```bash ````, ```` ```text ````) are not run. There is deliberately no way to mark a Python block as
"do not run": a block that cannot run does not belong in the docs as Python.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FENCE = re.compile(r"^(?P<indent> *)(?P<fence>`{3,}|~{3,})\s*\{?\s*\.?(?P<lang>[\w+-]*)(?P<attributes>[^`]*)$")
MARK = re.compile(r"^\s*<!--\s*snippet:\s*(?P<options>.*?)\s*-->\s*$")
PYTHON = {"python", "py", "python3", "py3"}
YAML = {"yaml", "yml"}
REFUSED = {"pycon", "python-repl", "ipython"}


@dataclass(frozen=True)
class Snippet:
    path: str  # relative to the repository root
    line: int  # of the opening fence, 1-based
    kind: str  # "python" or "cli-config"
    ranks: int
    code: str

    @property
    def name(self) -> str:
        """An identifier that pytest and file names can carry: ``docs-guides-fabric.md-L12``."""
        return f"{self.path.replace('/', '-')}-L{self.line}"

    def to_dict(self) -> dict:
        return asdict(self)


def documents() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def parse(text: str, path: str) -> list[Snippet]:
    lines = text.splitlines()
    found, options, i = [], None, 0
    while i < len(lines):
        if m := MARK.match(lines[i]):
            options = _options(m.group("options"), path, i + 1)
        elif fence := FENCE.match(lines[i]):
            start, indent, lang = i, len(fence.group("indent")), fence.group("lang").lower()
            marks = fence.group("fence")
            if lang in REFUSED:
                raise ValueError(f"{path}:{start + 1}: a {lang} block (an interactive session) cannot run as a snippet;"
                                 " write it as a ```python block with asserts, or as ```text")
            i += 1
            body = []
            # The block ends at a fence of the same character, at least as long, with nothing after it.
            while i < len(lines) and not (lines[i].strip().startswith(marks)
                                          and set(lines[i].strip()) == {marks[0]}):
                body.append(lines[i][indent:])
                i += 1
            opts = options or {}
            kind = "python" if lang in PYTHON else opts.get("kind")
            if lang in YAML and "cli-config" in opts.get("flags", ()):
                kind = "cli-config"
            if kind is not None:
                found.append(Snippet(path, start + 1, kind, int(opts.get("ranks", 1)), "\n".join(body) + "\n"))
            elif options is not None:
                raise ValueError(f"{path}:{start + 1}: a snippet marker before a {lang or 'plain'} block, which is not run")
            options = None
        elif lines[i].strip():
            options = None  # a marker applies to the very next block only
        i += 1
    return found


def _options(text: str, path: str, line: int) -> dict:
    opts: dict = {"flags": []}
    for word in text.split():
        key, sep, value = word.partition("=")
        if sep and key == "ranks" and value in {"1", "2", "4"}:
            opts["ranks"] = value
        elif not sep and word == "cli-config":
            opts["flags"].append(word)
        else:
            raise ValueError(f"{path}:{line}: unknown snippet option {word!r}; allowed: ranks=1|2|4, cli-config")
    return opts


def all_snippets() -> list[Snippet]:
    return [s for doc in documents() for s in parse(doc.read_text(), str(doc.relative_to(ROOT)))]
