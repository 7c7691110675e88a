"""Kill a rank in the middle of a save, at three points, and check that the previous checkpoint still loads exactly.

Each kill ends its launch (torchrun takes the other rank down too); the next launch verifies and arms the next kill.
"""

import subprocess

from launch import LAUNCH_TIMEOUT_S, Launch, torchrun, worker_env


def _run(root, tmp_path, name, steps):
    out = tmp_path / name
    proc = subprocess.run(
        torchrun("kill_save.py", 2),
        env=worker_env(out, LFSDP_KILL_DIR=str(root), LFSDP_KILL_STEPS=steps),
        capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S,
    )
    return proc, Launch(out=out, world_size=2, log=proc.stdout + proc.stderr, returncode=proc.returncode)


def test_killed_saves_never_cost_the_previous_checkpoint(tmp_path):
    root = tmp_path / "checkpoints"
    root.mkdir()
    sequence = [
        ("prepare,kill:sharded_write", True),
        ("verify,kill:full_write", True),
        ("verify,kill:between_renames", True),
        ("verify,save_again", False),
    ]
    for i, (steps, killed) in enumerate(sequence):
        proc, result = _run(root, tmp_path, f"launch{i}", steps)
        if killed:
            # The verify step runs before the kill: had it failed, the case would have ended there, unkilled. The
            # marker is written right before `os._exit`, at the intended point, so any other death is no pass.
            point = steps.rsplit("kill:", 1)[1]
            marker = root / f"killed-{point}"
            assert proc.returncode != 0 and marker.is_file(), f"launch {i} ({steps}):\n{result.log[-3000:]}"
            marker.unlink()
        else:
            details = result.check("run_steps")
            assert details[0] == ["verify", "save_again"], details
