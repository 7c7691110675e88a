#!/usr/bin/env bash
# README command 2: install everything into <repo>/.venv (see .ci/install.sh), then run the test suite.
# Extra arguments go to pytest, e.g. `bash tests/run.sh tests/test_errors.py -q`.
#
# It prints the 25 slowest tests and the suite's time. Run with no arguments (the whole suite, as the README and
# `.ci/run`'s pinned leg do), it also fails when the suite took longer than its time budget, SUITE_BUDGET_S below:
# see CONTRIBUTING.md for how to keep a new test within it. LFSDP_SUITE_BUDGET_S=<seconds> sets another budget for one
# run (a slower machine); LFSDP_SUITE_BUDGET_S=0 turns the check off.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

# The whole suite on the pinned versions, on the 2-core reference machine: pytest's time was 333 s and 341 s in two
# runs in this checkout on 2026-11-26 (issue 28; 1039 tests; forked low-priority pools beside the other tests), where
# the code before took 370 s and 394 s that morning and 314 to 400 s the day before: the machine's own spread is
# about a quarter. The budget was then the slowest run seen of the code before, plus a margin of about 7% (430 s).
# Raised on 2026-11-27 (issues 37, 38 and 39: 1151 tests, 107 more, among them a real S3 server, a rank killed
# mid-upload, tied-weight and full-checkpoint TP cases in the 4-rank pool, the Trainer's memory plan at 1, 2 and 4
# ranks): pytest's time was 470 s for the whole suite once the pool readers ran last. The 4-rank pool (164 s,
# 9 scripts) is the critical path now. The budget is that run plus the machine's spread (a fifth): 560 s. It is
# over the 6-minute target; bring it back down rather than raising it again. Raise it only with a measurement and a
# reason.
# Raised on 2026-11-29 to 620 s (1634 tests, pytest 558 s, suite 575 s in a clean-checkout run), as a debt. Then
# more launches started in the background with the pools (`env_from=`, `alone=True`, CONTRIBUTING.md): three
# clean-checkout runs of the pinned leg the same day (1652-1656 tests) took pytest 492, 486 and 546 s, the suite 508,
# 501 and 562 s, the third on a machine slower across the board (every pool and slow test took longer). The budget
# is the slowest of them plus about 7%: 600 s, lower than before; the 6-minute target is still not met.
SUITE_BUDGET_S=600

bash "$ROOT/.ci/install.sh"
cd "$ROOT"
start=$(date +%s)
status=0
"$ROOT/.venv/bin/python" -m pytest --durations=25 "$@" || status=$?
elapsed=$(( $(date +%s) - start ))
echo "=== suite: ${elapsed} s, exit ${status}"
budget="${LFSDP_SUITE_BUDGET_S:-$SUITE_BUDGET_S}"
if [[ $# -eq 0 && "$budget" != 0 && $elapsed -gt $budget ]]; then
    echo "=== suite over its time budget: ${elapsed} s measured, budget ${budget} s (SUITE_BUDGET_S in tests/run.sh)." >&2
    echo "    The slowest tests are listed above. Move a new check into an existing launch (case_tests and @case)" >&2
    echo "    or in process (tests/inprocess.py run_cli), as CONTRIBUTING.md says, rather than raising the budget." >&2
    [[ $status -ne 0 ]] || status=3
fi
exit "$status"
