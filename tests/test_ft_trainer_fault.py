"""Fault tolerance on the Trainer front (issue 44): ``Trainer(strategy=FSDPStrategy(fault_tolerance=...))`` with two
replica groups of one rank each, each a world of its own in its own process (workers/ft_trainer_fault.py), meeting at
a lighthouse in this process. Group 1's rank is SIGKILLed in backward, then in the optimizer step; each time it is
restarted with the same replica id and heals from group 0, which never stops: the model, the optimizer, the step LR
scheduler, and the loop's position (global_step, epoch, batch index, the data's position). Both groups end with
``global_step == max_steps`` and the weights of a replay, without faults, of the windows group 0 committed."""

from __future__ import annotations

import importlib.util
import os
import subprocess

import pytest
import torch

import forkserver
from launch import WORKERS, worker_env
from skips import require

require("torchft")

MAX_STEPS = 10
KILLS = ["backward@2", "optimizer@2"]  # each attempt of group 1 dies 2 committed steps after its first window


def _worker():
    spec = importlib.util.spec_from_file_location("ft_trainer_fault", WORKERS / "ft_trainer_fault.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _replay(record: dict) -> dict[str, torch.Tensor]:
    """Group 0's committed windows in this process, without FSDP or faults: every group trained on the same batches
    in them (the same data position), so the average of the groups' gradients is one group's."""
    worker = _worker()
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
    os.environ.setdefault("RUST_LOG", "warn")  # torchft's Rust side logs every quorum at INFO otherwise
    from torchft.coordination import LighthouseServer

    env = worker_env(tmp_path)
    forkserver.wait_until_serving(forkserver.prewarm({k: v for k, v in env.items() if k not in ("RANK", "LOCAL_RANK")}),
                                  timeout_s=120)
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2, join_timeout_ms=200, quorum_tick_ms=20,
                                  heartbeat_timeout_ms=1000)
    (tmp_path / "lighthouse").write_text(lighthouse.address())
    logs = {}

    def start(group: int, kill: str = "") -> subprocess.Popen:
        log = logs.setdefault(group, open(tmp_path / f"group{group}.log", "a"))  # noqa: SIM115 - closed below
        return subprocess.Popen([forkserver.python(), str(WORKERS / "ft_trainer_fault.py"), str(group), str(tmp_path),
                                 str(MAX_STEPS), kill], env=env, stdout=log, stderr=subprocess.STDOUT)

    procs = []
    try:
        procs.append(start(0))
        codes = []
        for kill in KILLS:  # each attempt of group 1 dies at its point; the next one heals and goes on
            procs.append(start(1, kill))
            codes.append(procs[-1].wait(timeout=120))  # bounds a hang only; each attempt takes a few seconds
        procs.append(start(1))
        codes += [procs[-1].wait(timeout=120), procs[0].wait(timeout=120)]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for log in logs.values():
            log.close()
        lighthouse.shutdown()
    output = "\n".join((tmp_path / f"group{g}.log").read_text()[-4000:] for g in (0, 1))
    assert codes == [-9, -9, 0, 0], output  # two SIGKILLs, then both groups finish
    assert len((tmp_path / "pids0").read_text().split()) == 1  # group 0 was never restarted
    assert len((tmp_path / "pids1").read_text().split()) == 3
    first, second = (torch.load(tmp_path / f"group{g}.pt") for g in (0, 1))
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
