#!/usr/bin/env bash
# The benchmark command: install the project with its benchmark extras into <repo>/.venv, then measure every
# figure (benchmarks/run_all.py; arguments go there, e.g. `--quick` or `--only training`).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/.ci/install.sh"
"$ROOT/.venv/bin/python" -m pip install --quiet --disable-pip-version-check -c "$ROOT/.ci/constraints.txt" -e "$ROOT[bench]"
cd "$ROOT"
exec "$ROOT/.venv/bin/python" benchmarks/run_all.py "$@"
