"""The runnable blocks of the README and the documentation site, found by one parser for the tests to run.

Every fenced ```` ```python ```` block is a snippet and must run as it stands. An HTML comment right before the fence
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
FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>[\w-]*)\s*$")
MARK = re.compile(r"^\s*<!--\s*snippet:\s*(?P<options>.*?)\s*-->\s*$")
KINDS = {"python": "python", "yaml": "cli-config"}


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
            start, indent, lang = i, len(fence.group("indent")), fence.group("lang")
            i += 1
            body = []
            while i < len(lines) and lines[i].strip() != "```":
                body.append(lines[i][indent:])
                i += 1
            opts = options or {}
            kind = "python" if lang == "python" else opts.get("kind")
            if lang == "yaml" and "cli-config" in opts.get("flags", ()):
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
