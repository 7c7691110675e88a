"""mkdocs hooks for the documentation site (``hooks:`` in mkdocs.yml).

The package's docstrings cross-reference in Sphinx's roles (``:class:`~lightning_fsdp.x.Y```), which read well in
``help()`` and in an editor; mkdocstrings renders Google-style docstrings as Markdown, where a role is plain text. This
hook shows each role's target as code, as Sphinx would: the last component when the target starts with ``~``.
"""

from __future__ import annotations

import re

ROLE = re.compile(r":(?:class|meth|func|mod|attr|data|exc|obj|const):<code>(~?)([^<]+)</code>")


def _as_code(match: re.Match) -> str:
    short, target = match.group(1), match.group(2)
    return f"<code>{target.rsplit('.', 1)[-1] if short else target}</code>"


def on_page_content(html: str, **kwargs) -> str:
    return ROLE.sub(_as_code, html)
