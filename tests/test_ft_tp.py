"""Tensor parallelism inside a replica group (issue 44): two groups of two ranks, each a ``(shard=1, tp=2)`` mesh with
a column-split and a row-split layer (workers/ft_tp.py, under torchrun), meeting at a lighthouse in this process.
Rank 1 of group 1 is SIGKILLed in backward; torchrun stops the group, which is started again with the same replica id
and heals rank to rank from group 0 (TP-sharded weights and momentum), which never stops. Both groups end with the
same weights, bit for bit, and with the weights of the same steps in one process (up to the sum over the tp ranks)."""

from __future__ import annotations

import importlib.util
import os
import subprocess

import pytest
import torch

import forkserver
from launch import WORKERS, torchrun, worker_env
from skips import require

require("torchft")

STEPS = 8
KILL_AFTER = 2  # rank 1 of group 1's first attempt dies 2 steps after its first window


def _worker():
    spec = importlib.util.spec_from_file_location("ft_tp", WORKERS / "ft_tp.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _reference() -> dict[str, torch.Tensor]:
    """The same steps in this process, without TP, FSDP or faults: every group's gradient is the batch's."""
    worker = _worker()
    torch.manual_seed(0)
    net = worker.Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        opt.zero_grad()
        net(worker.batch(step)).square().mean().backward()
        opt.step()
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


# single_process, as test_ft_fabric: the groups' processes are forked and rarely busy at once (group 0 waits in its
# quorum while group 1 restarts), so the pools fill the other core.
@pytest.mark.single_process
def test_a_tensor_parallel_group_killed_in_backward_heals_rank_to_rank_and_ends_equal(tmp_path):
    os.environ.setdefault("RUST_LOG", "warn")  # torchft's Rust side logs every quorum at INFO otherwise
    from torchft.coordination import LighthouseServer

    env = worker_env(tmp_path)
    forkserver.wait_until_serving(forkserver.prewarm({k: v for k, v in env.items() if k not in ("RANK", "LOCAL_RANK")}),
                                  timeout_s=120)
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2, join_timeout_ms=200, quorum_tick_ms=20,
                                  heartbeat_timeout_ms=1000)
    (tmp_path / "lighthouse").write_text(lighthouse.address())
    logs = {}

    def start(group: int, kill_after: int = 0) -> subprocess.Popen:
        log = logs.setdefault(group, open(tmp_path / f"group{group}.log", "a"))  # noqa: SIM115 - closed below
        return subprocess.Popen(torchrun("ft_tp.py", 2) + [str(group), str(tmp_path), str(STEPS), str(kill_after)],
                                env=env, stdout=log, stderr=subprocess.STDOUT)

    procs = []
    try:
        procs += [start(0), start(1, KILL_AFTER)]
        codes = [procs[1].wait(timeout=120)]  # bounds a hang only
        procs.append(start(1))
        codes += [procs[2].wait(timeout=120), procs[0].wait(timeout=120)]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for log in logs.values():
            log.close()
        lighthouse.shutdown()
    output = "\n".join((tmp_path / f"group{g}.log").read_text()[-4000:] for g in (0, 1))
    assert codes == [1, 0, 0], output  # torchrun reports its failed first attempt of group 1; then both finish
    assert "exitcode: -9" in (tmp_path / "group1.log").read_text(), output  # the rank died by the SIGKILL
    assert len((tmp_path / "pids0").read_text().split()) == 2  # group 0's two ranks were never restarted
    assert len((tmp_path / "pids1").read_text().split()) == 4
    first, second = (torch.load(tmp_path / f"group{g}.pt") for g in (0, 1))
    assert first["steps"] == second["steps"] == STEPS
    assert first["uncommitted"] and first["healed"] == [], (first["uncommitted"], first["healed"])
    assert second["healed"] == [0], second["healed"]
    # Tensor parallelism was on: a's rows and b's columns split over "tp" (a's bias too, b's bias replicated on it).
    tp_placements = {name: placements[-1] for name, (axes, placements) in first["layout"].items()}
    assert {axes == ["shard", "tp"] for axes, _ in first["layout"].values()} == {True}, first["layout"]
    assert tp_placements == {"a.weight": "Shard(0)", "a.bias": "Shard(0)", "b.weight": "Shard(1)",
                             "b.bias": "Replicate()"}, first["layout"]
    want = _reference()
    assert sorted(first["weights"]) == sorted(want)
    for name, tensor in want.items():
        assert torch.equal(first["weights"][name], second["weights"][name]), name
        # The row-split layer's output is a sum of two partial products: not the one-process order of additions.
        torch.testing.assert_close(first["weights"][name], tensor, rtol=1e-5, atol=1e-6)
