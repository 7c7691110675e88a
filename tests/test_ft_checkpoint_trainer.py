"""torchft's step in the Trainer's checkpoints (issue 44): saved with ``trainer.save_checkpoint`` under fault tolerance
and given back to the replica group on ``fit(ckpt_path=...)``; a checkpoint saved without fault tolerance resumes
torchft at its ``global_step`` (workers/ft_checkpoint_trainer.py, cases in the 2-rank pool, with a scripted group)."""

from __future__ import annotations

from launch import case_tests
from skips import require

require("torchft")

CASES = [
    "a_trainer_checkpoint_holds_torchfts_step_and_a_resume_gives_it_back_before_the_first_window",
    "a_checkpoint_saved_without_fault_tolerance_resumes_torchft_at_its_global_step",
]
results, test_case = case_tests("ft_checkpoint_trainer.py", 2, CASES)
