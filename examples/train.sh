#!/usr/bin/env bash
# README command 1: set up <repo>/.venv (first run only), then train the example GPT on 2 processes: CPU processes
# with gloo, or 2 GPUs when CUDA is available. Arguments go to examples/train_gpt.py, e.g.
#
#   bash examples/train.sh --steps 300 --state-dict-type full
#   bash examples/train.sh --help
#
# Fabric's own launcher starts the second process (it re-runs the script), so no torchrun is needed. Relative paths
# such as the default --out checkpoints/gpt are relative to the directory you run this from.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/.ci/install.sh"
exec "$ROOT/.venv/bin/python" "$ROOT/examples/train_gpt.py" "$@"
