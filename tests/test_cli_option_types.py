"""The command's option types are one each for every command (``planner.command.positive_int`` and ``byte_size``):
a bad whole number names its own option in the HINT, and a bad size reads the same under ``convert`` and ``plan``.
Argument parsing fails before any command runs, so each case is a run of the command in this process."""

from __future__ import annotations

import pytest

from inprocess import run_cli

pytestmark = pytest.mark.single_process

_PLAN = ["plan", "--model", "m:build", "--inputs", "m:batch"]


def _one_error_line(argv: list[str], tmp_path) -> str:
    result = run_cli(argv, cwd=tmp_path)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith("lightning-fsdp: error: "), result.stderr
    return lines[0]


@pytest.mark.parametrize("argv, option, example", [
    (["lighthouse", "--min-replicas", "1", "--join-timeout-ms", "0"], "--join-timeout-ms", "--join-timeout-ms 60000"),
    (["lighthouse", "--min-replicas", "1", "--heartbeat-timeout-ms", "-3"], "--heartbeat-timeout-ms",
     "--heartbeat-timeout-ms 5000"),
    ([*_PLAN, "--world-size", "0"], "--world-size", "--world-size 8"),
    ([*_PLAN, "--world-size", "2", "--accumulate-grad-batches", "x"], "--accumulate-grad-batches",
     "--accumulate-grad-batches 4"),
])
def test_a_bad_whole_number_names_its_own_option_in_the_hint(argv, option, example, tmp_path):
    line = _one_error_line(argv, tmp_path)
    assert f"argument {option}: invalid value" in line and "expected a whole number of at least 1" in line, line
    assert line.endswith(f"HINT: e.g. {example}"), line


def test_a_bad_size_reads_the_same_under_convert_and_plan(tmp_path):
    convert = _one_error_line(["convert", "a", "b", "--to", "safetensors", "--max-shard-size", "0"], tmp_path)
    plan = _one_error_line([*_PLAN, "--world-size", "2", "--memory-budget", "0"], tmp_path)
    said = convert.partition("argument --max-shard-size: ")[2]
    assert said.startswith("Invalid size '0'.") and "HINT: e.g. `500MB` or `2GiB`." in said, convert
    assert plan.partition("argument --memory-budget: ")[2] == said, (convert, plan)
