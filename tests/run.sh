#!/usr/bin/env bash
# README command 2: install everything into <repo>/.venv (see .ci/install.sh), then run the test suite.
# Extra arguments go to pytest, e.g. `bash tests/run.sh tests/test_errors.py -q`.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/.ci/install.sh"
cd "$ROOT"
exec "$ROOT/.venv/bin/python" -m pytest "$@"
