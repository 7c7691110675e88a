#!/usr/bin/env bash
# Create (or reuse) the development environment in <repo>/.venv and install this package with its test extras.
#
#   bash .ci/install.sh          # from anywhere; safe to run again, and fast once everything is installed
#
# Environment variables:
#   PYTHON          interpreter used to create .venv (default: python3)
#   VENV            where the environment lives (default: <repo>/.venv, the pinned one the README's commands use)
#   CONSTRAINTS     the exact versions to install (default: .ci/constraints.txt, the pinned set); `.ci/run` also
#                   installs .ci/constraints-newest-torch.txt and .ci/constraints-oldest-lightning.txt, each in a venv
#                   of its own
#   FRESH=1         delete VENV first and install from scratch (what `.ci/run` does for the extra venvs)
#   AZURITE_VERSION the Azure Storage emulator the tests run (tests/emulators.py), installed with npm into .ci/node
#                   (default: the pinned 3.37.0); every leg's venv shares it
#   TORCH_PIP_ARGS  extra pip arguments for the torch install only. On a CPU-only machine without a local CPU wheel,
#                   use TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu": PyPI's Linux wheel of
#                   torch is the multi-GB CUDA build.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

PYTHON="${PYTHON:-python3}"
VENV="${VENV:-$ROOT/.venv}"
PY="$VENV/bin/python"
CONSTRAINTS="${CONSTRAINTS:-$ROOT/.ci/constraints.txt}"
# Every version is pinned exactly by $CONSTRAINTS. A machine-wide pip constraint (some machines cap torch at the
# releases they keep on disk) would refuse the newest torch that the CI matrix tests, so it is lifted here.
export PIP_CONSTRAINT=/dev/null

if [[ "${FRESH:-0}" == 1 && -e "$VENV" ]]; then
    echo "[install] FRESH=1: removing $VENV"
    rm -rf "$VENV"
fi
# Azurite, the Azure Storage emulator of the tests (npm, not PyPI), pinned; checked on every run, also when the venv
# is up to date, since .ci/node is not part of the venv. Without it the Azure tests fail (never skip), so a missing
# npm stops the install here with the fix. It declares node>=22 but runs its Blob service on the node 20 here.
AZURITE_VERSION="${AZURITE_VERSION:-3.37.0}"
NODE_DIR="$ROOT/.ci/node"
azurite_installed="$(sed -n '0,/"version"/s/^ *"version": *"\([^"]*\)".*/\1/p' \
    "$NODE_DIR/node_modules/azurite/package.json" 2>/dev/null || true)"  # empty when not installed
if [[ "$azurite_installed" != "$AZURITE_VERSION" || ! -x "$NODE_DIR/node_modules/.bin/azurite-blob" ]]; then
    if ! command -v npm >/dev/null 2>&1; then
        echo "[install] npm is not installed, and the Azure tests need Azurite from npm. HINT: install Node.js 20 or" \
            "newer with npm (e.g. apt-get install nodejs npm), then run this again." >&2
        exit 1
    fi
    echo "[install] azurite@$AZURITE_VERSION into ${NODE_DIR#"$ROOT"/} (npm)"
    mkdir -p "$NODE_DIR"
    printf '*\n' > "$NODE_DIR/.gitignore"  # installed files, never committed
    npm install --prefix "$NODE_DIR" --no-audit --no-fund --loglevel=error "azurite@$AZURITE_VERSION"
fi

TORCH_VERSION="$(sed -n 's/^torch==\([^[:space:]]*\).*/\1/p' "$CONSTRAINTS")"
STAMP="$VENV/.lightning-fsdp-installed"

if [[ ! -x "$PY" ]]; then
    echo "[install] creating $VENV with $("$PYTHON" --version 2>&1)"
    "$PYTHON" -m venv "$VENV"
fi

# Skip pip entirely when nothing that decides the environment has changed since the last successful install and
# the package still imports. Any edit to pyproject.toml, the constraints or this script forces a real install.
fingerprint="$(cat pyproject.toml "$CONSTRAINTS" "$ROOT/.ci/install.sh" | cksum)"
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$fingerprint" ]] \
    && "$PY" - "$TORCH_VERSION" >/dev/null 2>&1 <<'PYCHECK'; then
import importlib.metadata as md, importlib.util, sys
# Metadata only, no imports: importing torch and lightning would take seconds.
assert md.version("torch").split("+")[0] == sys.argv[1]
assert md.version("lightning-fsdp") and md.version("pytest") and md.version("mkdocs-material")
assert importlib.util.find_spec("lightning_fsdp") is not None
PYCHECK
    echo "[install] $VENV is up to date"
    exit 0
fi

pip_install() {
    "$PY" -m pip install --quiet --disable-pip-version-check "$@"
}

# torch first and alone, pinned: if anything later asked for torch unpinned, pip could pick a CUDA build.
echo "[install] torch==$TORCH_VERSION"
# shellcheck disable=SC2086  # TORCH_PIP_ARGS is meant to be word-split
pip_install ${TORCH_PIP_ARGS:-} "torch==$TORCH_VERSION"

echo "[install] lightning-fsdp (editable) with the test and docs extras, constrained by ${CONSTRAINTS#"$ROOT"/}"
pip_install -c "$CONSTRAINTS" -e ".[test,docs]"

"$PY" -c "import torch, lightning, lightning_fsdp as lf; print(f'[install] ok: torch {torch.__version__},' \
    f' lightning {lightning.__version__}, lightning-fsdp {lf.__version__}')"
echo "$fingerprint" > "$STAMP"
