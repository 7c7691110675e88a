#!/usr/bin/env bash
# Build and serve the documentation site on http://127.0.0.1:8000 (MkDocs with Material and mkdocstrings).
# Installs the docs extras into <repo>/.venv first (.ci/install.sh). Extra arguments go to `mkdocs serve`.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/.ci/install.sh"
cd "$ROOT"
export NO_MKDOCS_2_WARNING=1
exec "$ROOT/.venv/bin/python" -m mkdocs serve --strict "$@"
