"""Fault tolerance on the Trainer front (issue 44): ``Trainer(strategy=FSDPStrategy(fault_tolerance=...))`` with two
replica groups of one rank each, each a world of its own in its own process (workers/ft_trainer_fault.py), meeting at
a lighthouse in this process. Group 1's rank is SIGKILLed in backward, then in the optimizer step; each time it is
restarted with the same replica id and heals from group 0, which never stops: the model, the optimizer, the step LR
scheduler, and the loop's position (global_step, epoch, batch index, the data's position). Both groups end with
``global_step == max_steps`` and the weights of a replay, without faults, of the windows group 0 committed."""

from __future__ import annotations

import pytest
import torch

from ft_harness import load_worker, one_process_group, run_two_groups
from skips import require

require("torchft")

MAX_STEPS = 10
KILLS = ["backward@2", "optimizer@2"]  # each attempt of group 1 dies 2 committed steps after its first window


def _replay(record: dict) -> dict[str, torch.Tensor]:
    """Group 0's committed windows in this process, without FSDP or faults: every group trained on the same batches
    in them (the same data position), so the average of the groups' gradients is one group's."""
    worker = load_worker("ft_trainer_fault")
    torch.manual_seed(0)
    net = worker.Lit("").net
    optimizer, scheduler = worker.optimizers(net.parameters())
    windows: list[list[list[int]]] = [[]]
    for batch in record["batches"]:
        windows[-1].append(batch["ids"])
        if len(windows[-1]) == worker.ACCUMULATE:
            windows.append([])
    assert windows[-1] == [] and len(windows) - 1 == len(record["votes"]), "a window of another length"
    for batches, committed in zip(windows, record["votes"]):
        if not committed:
            continue  # its batches were consumed; nothing of it reached the weights
        optimizer.zero_grad()
        for ids in batches:
            (net(worker.inputs(torch.tensor(ids))).square().mean() / worker.ACCUMULATE).backward()
        optimizer.step()
        scheduler.step()
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


# single_process, as test_ft_fabric: the two groups' processes are forked and rarely busy at once (group 0 waits in its
# quorum while group 1 restarts), so the pools fill the other core.
@pytest.mark.single_process
def test_a_trainer_group_killed_in_backward_and_the_optimizer_step_heals_its_loop_and_ends_bit_for_bit(tmp_path):
    runs = run_two_groups(tmp_path, one_process_group("ft_trainer_fault.py", tmp_path, MAX_STEPS), KILLS)
    codes, output = runs.codes, runs.output()
    assert codes == [-9, -9, 0, 0], output  # two SIGKILLs, then both groups finish
    assert len(runs.pids(0)) == 1  # group 0 was never restarted
    assert len(runs.pids(1)) == 3
    first, second = runs.records()
    assert first["global_step"] == second["global_step"] == MAX_STEPS
    # Group 0's vote failed where group 1 died in backward (the average could not complete) and where a restarted
    # group 1 healed (under min_replicas=2 a window with one group at the newest step does not commit). Group 0 never
    # healed; the last attempt of group 1 healed its loop before its fit loop started.
    assert first["votes"].count(False) >= 2 and not first["healed"], first["votes"]
    assert second["healed"]
    # The loop's position is group 0's: epoch, every batch counter, the batches loggers count, the LR.
    assert second["loop"] == first["loop"], (first["loop"], second["loop"])
    # From its heal on, group 1 read at each (epoch, batch) the samples group 0 read there: its data was positioned.
    read = {(b["epoch"], b["batch_idx"]): (b["ids"], b["global_step"]) for b in first["batches"]}
    assert second["batches"] and second["batches"][0]["global_step"] > 0, second["batches"][:1]  # it healed to a step
    for batch in second["batches"]:
        assert read[batch["epoch"], batch["batch_idx"]] == (batch["ids"], batch["global_step"]), batch
    # No window of group 0 waited out a timeout (the bound against a hang: the quorum timeout, 30 s).
    assert first["longest_window_s"] < 30, first["longest_window_s"]
    want = _replay(first)
    for name, tensor in want.items():
        assert torch.equal(first["weights"][name], tensor), name
        assert torch.equal(second["weights"][name], tensor), name
