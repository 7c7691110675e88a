"""One replica group of one rank, in a torch world of its own, for ``tests/test_ft_group.py``'s two-group run.

    python ft_pair.py REPLICA_ID OUT_DIR STEPS

Group 0 starts the lighthouse (``min_replicas=2``: every step needs both groups, so neither runs ahead and none
heals) and writes its address to ``OUT_DIR/lighthouse``; group 1 waits for that file. Each group trains ``STEPS``
steps on batches of its own (seeded by group and step) and writes its final full weights, its votes and its hook
count to ``OUT_DIR/group<id>.pt``.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from lightning_fsdp.engine.fault_tolerance.config import FaultTolerance
from lightning_fsdp.engine.fault_tolerance.group import ReplicaGroup

WAIT_S = 60.0  # bound on group 1's wait for the lighthouse's address (group 0 writes it within a second)


def model() -> nn.Module:
    torch.manual_seed(0)  # both groups start from the same weights (init_sync is off)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))


def batch(replica_id: int, step: int) -> torch.Tensor:
    return torch.randn(4, 6, generator=torch.Generator().manual_seed(1000 * replica_id + step))


def main(replica_id: int, out: Path, steps: int) -> None:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # this group's own world
    server = None
    address_file = out / "lighthouse"
    if replica_id == 0:
        from torchft.coordination import LighthouseServer

        server = LighthouseServer(bind="[::]:0", min_replicas=2, join_timeout_ms=200, quorum_tick_ms=20,
                                  heartbeat_timeout_ms=2000)
        (out / "lighthouse.tmp").write_text(server.address())
        (out / "lighthouse.tmp").rename(address_file)
    deadline = time.monotonic() + WAIT_S
    while not address_file.exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"no lighthouse address in {address_file} after {WAIT_S} s")
        time.sleep(0.02)
    config = FaultTolerance(replica_id=replica_id, num_replica_groups=2, lighthouse=address_file.read_text(),
                            min_replicas=2, timeout=30.0, quorum_timeout=30.0, connect_timeout=10.0)
    net = model()
    mesh = init_device_mesh("cpu", (1,))
    fully_shard(net[0], mesh=mesh)
    fully_shard(net[2], mesh=mesh)
    fully_shard(net, mesh=mesh)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    votes = []
    with ReplicaGroup(config) as group:
        group.install(net)
        for step in range(steps):
            group.begin_window()
            with group.aborting():
                net(batch(replica_id, step)).square().mean().backward()
            votes.append(group.commit())
            if votes[-1]:
                opt.step()
            opt.zero_grad()
        group.check_step(sum(votes))
        weights = {k: v.full_tensor().clone() for k, v in net.state_dict().items()}
        torch.save({"weights": weights, "votes": votes, "hook_calls": group.hook_calls}, out / f"group{replica_id}.pt")
        # Group 0 keeps the lighthouse up until group 1 has written its result (its last vote needs no lighthouse,
        # but its manager's last heartbeats do no harm either way).
        if server is not None:
            other = out / "group1.pt"
            deadline = time.monotonic() + WAIT_S
            while not other.exists() and time.monotonic() < deadline:
                time.sleep(0.02)
    if server is not None:
        server.shutdown()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("RUST_LOG", "warn")  # torchft's Rust side reads it once, at import; its INFO is per quorum
    main(int(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]))
