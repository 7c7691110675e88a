"""Tensor parallelism inside a replica group (issue 44): two groups of two ranks, each a ``(shard=1, tp=2)`` mesh with
a column-split and a row-split layer (workers/ft_tp.py, under torchrun), meeting at a lighthouse in this process.
Rank 1 of group 1 is SIGKILLed in backward; torchrun stops the group, which is started again with the same replica id
and heals rank to rank from group 0 (TP-sharded weights and momentum), which never stops. Both groups end with the
same weights, bit for bit, and with the weights of the same steps in one process (up to the sum over the tp ranks)."""

from __future__ import annotations

import pytest
import torch

from ft_harness import load_worker, run_two_groups, sgd_reference, torchrun_group
from skips import require

require("torchft")

STEPS = 8
KILL_AFTER = 2  # rank 1 of group 1's first attempt dies 2 steps after its first window


# single_process, as test_ft_fabric: the groups' processes are forked and rarely busy at once (group 0 waits in its
# quorum while group 1 restarts), so the pools fill the other core.
@pytest.mark.single_process
def test_a_tensor_parallel_group_killed_in_backward_heals_rank_to_rank_and_ends_equal(tmp_path):
    # The worker reads a kill-after of 0 as no kill.
    runs = run_two_groups(tmp_path, torchrun_group("ft_tp.py", 2, tmp_path, STEPS), [str(KILL_AFTER)], no_kill="0")
    codes, output = runs.codes, runs.output()
    assert codes == [1, 0, 0], output  # torchrun reports its failed first attempt of group 1; then both finish
    assert "exitcode: -9" in runs.log(1), output  # the rank died by the SIGKILL
    assert len(runs.pids(0)) == 2  # group 0's two ranks were never restarted
    assert len(runs.pids(1)) == 4
    first, second = runs.records()
    assert first["steps"] == second["steps"] == STEPS
    assert first["uncommitted"] and first["healed"] == [], (first["uncommitted"], first["healed"])
    assert second["healed"] == [0], second["healed"]
    # Tensor parallelism was on: a's rows and b's columns split over "tp" (a's bias too, b's bias replicated on it).
    tp_placements = {name: placements[-1] for name, (axes, placements) in first["layout"].items()}
    assert {axes == ["shard", "tp"] for axes, _ in first["layout"].values()} == {True}, first["layout"]
    assert tp_placements == {"a.weight": "Shard(0)", "a.bias": "Shard(0)", "b.weight": "Shard(1)",
                             "b.bias": "Replicate()"}, first["layout"]
    want = sgd_reference(load_worker("ft_tp"), STEPS)
    assert sorted(first["weights"]) == sorted(want)
    for name, tensor in want.items():
        assert torch.equal(first["weights"][name], second["weights"][name]), name
        # The row-split layer's output is a sum of two partial products: not the one-process order of additions.
        torch.testing.assert_close(first["weights"][name], tensor, rtol=1e-5, atol=1e-6)
