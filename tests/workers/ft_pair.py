"""One replica group of one rank, in a torch world of its own, for ``tests/test_ft_group.py``'s two-group run.

    python ft_pair.py REPLICA_ID OUT_DIR STEPS

Group 0 starts the lighthouse (``min_replicas=1``), writes its address to ``OUT_DIR/lighthouse`` and trains alone;
after its second committed step it writes ``OUT_DIR/joinable``, which group 1 waits for before it starts (and group 0
waits for group 1's ``OUT_DIR/joining``, pausing a little per step while alone, so that group 1 joins well before the
end). Group 1
thus joins behind, heals from group 0 (the project's transport: model shards and optimizer state, nothing
unpickled), and both train on to ``STEPS`` committed steps. The batch of a step is seeded by the group and the
committed step, so a replay of who took part in each step gives the weights exactly. Each group writes its final full
weights, the participants of each of its committed steps and its counters to ``OUT_DIR/group<id>.pt``.
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

from lightning_fsdp.engine.fault_tolerance import heal
from lightning_fsdp.engine.fault_tolerance.config import FaultTolerance
from lightning_fsdp.engine.fault_tolerance.group import ReplicaGroup
from lightning_fsdp.engine.fault_tolerance.transport import HealTransport

WAIT_S = 60.0  # bound on a group's wait for the other's file (each is written within a second or two)
ALONE_S = 0.05  # group 0's pause per step until group 1 has joined: it must not finish before group 1 arrives


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))


def batch(replica_id: int, step: int) -> torch.Tensor:
    return torch.randn(4, 6, generator=torch.Generator().manual_seed(1000 * replica_id + step))


def _wait_for(path: Path) -> None:
    deadline = time.monotonic() + WAIT_S
    while not path.exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"{path} did not appear within {WAIT_S} s")
        time.sleep(0.02)


def main(replica_id: int, out: Path, steps: int) -> None:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # this group's own world
    server = None
    if replica_id == 0:
        from torchft.coordination import LighthouseServer

        server = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=200, quorum_tick_ms=20,
                                  heartbeat_timeout_ms=2000)
        (out / "lighthouse.tmp").write_text(server.address())
        (out / "lighthouse.tmp").rename(out / "lighthouse")
    else:
        _wait_for(out / "joinable")
        (out / "joining").write_text("")
    config = FaultTolerance(replica_id=replica_id, num_replica_groups=2, lighthouse=(out / "lighthouse").read_text(),
                            min_replicas=1, timeout=30.0, quorum_timeout=30.0, connect_timeout=10.0)
    net = model()
    if replica_id == 1:  # a group that joins behind starts from other weights: only the heal makes them equal
        with torch.no_grad():
            for p in net.parameters():
                p.add_(1.0)
    mesh = init_device_mesh("cpu", (1,))
    fully_shard(net[0], mesh=mesh)
    fully_shard(net[2], mesh=mesh)
    fully_shard(net, mesh=mesh)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)  # momentum: optimizer state to heal
    layout = heal.layout_of(net, [opt])
    participants, healed = {}, []
    with ReplicaGroup(config, transport=lambda pg: HealTransport(pg, layout=layout)) as group:
        group.install(net)
        group.register_state("lightning_fsdp", lambda payload: healed.append(heal.load(payload, net, [opt])),
                             lambda: heal.produce(net, [opt]))
        while group.current_step < steps:
            group.begin_window()
            group.participating_rank()  # waits for the quorum: a healer's step is the live groups' after it
            step, count = group.current_step, group.manager.num_participants()
            with group.aborting():
                net(batch(replica_id, step)).square().mean().backward()
            if group.commit():
                opt.step()
                participants[step] = count
            opt.zero_grad()
            if replica_id == 0 and server is not None:
                if group.current_step == 2:  # group 1 may start now; group 0 goes on once it is about to join
                    (out / "joinable").write_text("")
                    _wait_for(out / "joining")
                if count < 2:
                    time.sleep(ALONE_S)
        weights = {k: v.full_tensor().clone() for k, v in net.state_dict().items()}
        result = {"weights": weights, "participants": participants, "healed": len(healed),
                  "hook_calls": group.hook_calls, "bytes": [group.manager._checkpoint_transport.bytes_sent,
                                                            group.manager._checkpoint_transport.bytes_received]}
        torch.save(result, out / f"group{replica_id}.pt")
        if server is not None:  # the lighthouse stays up until group 1 is done too
            _wait_for(out / "group1.pt")
    if server is not None:
        server.shutdown()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("RUST_LOG", "warn")  # torchft's Rust side reads it once, at import; its INFO is per quorum
    main(int(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]))
