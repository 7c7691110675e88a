"""The real 2-rank steps that ``tests/test_planner.py`` holds the planner's predictions against: each case runs one
configuration of ``benchmarks/plan_accuracy.py`` (the same code its command runs under torchrun) and returns this
rank's tracker peak. In the 2-rank pool rather than a launch each: ``FSDPMemTracker`` counts the tensors of the step
it watches, not the process, so what earlier cases left behind does not enter the figure."""

import sys
from pathlib import Path

from harness import case, run_cases

_saved_path = list(sys.path)
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
try:
    import plan_accuracy  # it puts benchmarks/ and examples/ on sys.path; the cases after this script must not see them
finally:
    sys.path[:] = _saved_path


@case
def gpt_2_ac():
    return plan_accuracy.measure_on_this_rank("gpt-2-ac")


@case
def gpt_2_tiny_batch():
    return plan_accuracy.measure_on_this_rank("gpt-2-tiny-batch")


if __name__ == "__main__":
    run_cases()
