"""ReplicaGroup (engine/fault_tolerance/group.py) as one replica group of one rank, against a real torchft lighthouse
started in this process (design note section 9, item 5). Runs in the 1-rank pool: each case starts its own lighthouse
and group and closes both, so nothing of torchft outlives it but torchft's daemon threads."""

from __future__ import annotations

import os
import socket
import time
from contextlib import contextmanager
from urllib.parse import urlsplit

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from harness import TIMEOUT, case, run_cases
from lightning_fsdp.engine.fault_tolerance.config import FaultTolerance, FaultToleranceError
from lightning_fsdp.engine.fault_tolerance.group import ReplicaGroup, StepAborted

QUORUM_TIMEOUT = 30.0  # a normal quorum takes milliseconds; this is far from both that and a hang
DEAD_QUORUM_TIMEOUT = 2.0  # the case without a lighthouse waits this long for its quorum

# torchft's Rust side reads RUST_LOG once, when it is imported: without "warn" it logs every quorum tick into the
# pool's log. Set for the import only, so that no case sees a changed environment.
_rust_log = os.environ.get("RUST_LOG")
os.environ["RUST_LOG"] = _rust_log or "warn"
import torchft.coordination  # noqa: E402,F401
if _rust_log is None:
    del os.environ["RUST_LOG"]


def _world() -> None:
    if not dist.is_initialized():  # the pool's one process group (a case may create it, as Fabric.launch does)
        dist.init_process_group("gloo", timeout=TIMEOUT)


@contextmanager
def _lighthouse():
    from torchft.coordination import LighthouseServer

    server = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=100, quorum_tick_ms=20,
                              heartbeat_timeout_ms=1000)
    try:
        yield server
    finally:
        server.shutdown()


def _config(address: str, **kw) -> FaultTolerance:
    kw = {"replica_id": 0, "num_replica_groups": 1, "lighthouse": address, "timeout": 10.0,
          "quorum_timeout": QUORUM_TIMEOUT, "connect_timeout": 2.0, **kw}
    return FaultTolerance(**kw)


def _model(seed: int = 0) -> nn.Module:
    """Two units with parameters and a root with none of its own: two cross-group all-reduces per backward."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model[2], mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _batch(step: int, micro: int = 0) -> torch.Tensor:
    return torch.randn(4, 6, generator=torch.Generator().manual_seed(100 * step + micro))


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.full_tensor().clone() for k, v in model.state_dict().items()}


def _reference(steps: list[int], micro_batches: int) -> dict[str, torch.Tensor]:
    """The same model trained without fault tolerance on the batches of ``steps``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in steps:
        for micro in range(micro_batches):
            model(_batch(step, micro)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@case
def windows_commit_and_the_hook_averages_once_per_unit_per_window():
    _world()
    with _lighthouse() as lighthouse, ReplicaGroup(_config(lighthouse.address())) as group:
        model = _model()
        group.install(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        calls, votes = [], []
        for step in range(3):
            group.begin_window()
            group.begin_window()  # a second call in the window starts no second quorum
            with group.aborting():
                model.set_requires_gradient_sync(False)  # the accumulating micro-batch: no reduce, no hook
                model(_batch(step, 0)).square().mean().backward()
                model.set_requires_gradient_sync(True)
                model(_batch(step, 1)).square().mean().backward()
            votes.append(group.commit())
            calls.append(group.hook_calls)
            if votes[-1]:
                opt.step()
            opt.zero_grad()
            group.check_step(step + 1)
        assert votes == [True, True, True], votes
        assert calls == [2, 4, 6], calls  # two units with parameters, one all-reduce each per window
        assert group.current_step == 3 and group.participating_rank() == 0
        want = _reference([0, 1, 2], micro_batches=2)
        got = _full(model)
        for name, tensor in want.items():
            assert torch.equal(got[name], tensor), name  # one group: its average is its own gradient, exactly
        try:
            group.check_step(2)
        except FaultToleranceError as err:
            assert "torchft has committed 3 steps and the training loop 2" in str(err), err
        else:
            raise AssertionError("check_step(2) passed after 3 commits")
    return {"calls": calls}


@case
def an_aborted_backward_is_reset_not_committed_and_training_goes_on():
    _world()
    with _lighthouse() as lighthouse, ReplicaGroup(_config(lighthouse.address())) as group:
        model = _model()
        group.install(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        votes = []
        for step in range(3):
            group.begin_window()
            if step == 1:
                # What torchft records when a cross-group all-reduce fails (a peer group died): every later
                # all-reduce of the step is a no-op, so the hook stops the backward at its first unit.
                group.manager.report_error(RuntimeError("peer group 1 died"))
            with group.aborting():
                model(_batch(step)).square().mean().backward()
            if step == 1:
                assert all(p.grad is None for p in model.parameters()), "an aborted step's gradients were kept"
            votes.append(group.commit())
            if votes[-1]:
                opt.step()
            opt.zero_grad()
        assert votes == [True, False, True], votes
        assert group.aborted_steps == 1 and group.current_step == 2
        group.check_step(2)
        want, got = _reference([0, 2], micro_batches=1), _full(model)
        for name, tensor in want.items():
            assert torch.equal(got[name], tensor), name  # the aborted step changed nothing, FSDP trained on after it
        # Outside `aborting`, the abort reaches the caller as StepAborted (never as a hang or a half step).
        group.begin_window()
        group.manager.report_error(RuntimeError("peer group 1 died"))
        try:
            model(_batch(9)).square().mean().backward()
        except StepAborted as err:
            assert "peer group 1 died" in str(err), err
        else:
            raise AssertionError("the hook let an aborted step's backward finish")
        group.abort(RuntimeError("done"))
        assert group.commit() is False
    return {"votes": votes}


@case
def a_lighthouse_shut_down_mid_run_is_a_fault_tolerance_error_within_the_quorum_timeout():
    from torchft.coordination import LighthouseServer

    _world()
    server = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=100, quorum_tick_ms=20,
                              heartbeat_timeout_ms=1000)
    address = server.address()
    group = ReplicaGroup(_config(address, quorum_timeout=DEAD_QUORUM_TIMEOUT))
    try:
        model = _model()
        group.install(model)
        group.begin_window()
        model(_batch(0)).square().mean().backward()
        assert group.commit() is True
        # `shutdown()` closes the listening port, but the server keeps answering on the connections it has until the
        # object is dropped: drop it, as a lighthouse process that dies does.
        server.shutdown()
        del server
        _wait_closed(address)
        started = time.monotonic()
        try:
            group.begin_window()
            with group.aborting():
                model(_batch(1)).square().mean().backward()
            group.commit()
        except FaultToleranceError as err:
            elapsed = time.monotonic() - started
            text = str(err)
        else:
            raise AssertionError("a step without a lighthouse committed")
        # A bound against a hang only: torchft's own default quorum timeout is 60 s, the group's 2 s (a quorum
        # without a lighthouse took 3.0 s for a timeout of 3 s here on 2026-11-28).
        assert elapsed < 45, elapsed
        assert address in text and "lightning-fsdp lighthouse" in text, text
        assert "no quorum or answer within quorum_timeout=2 s" in text, text
        assert group.current_step == 1
    finally:
        group.close()
    return {"seconds": round(elapsed, 2), "message": text}


@case
def an_unreachable_lighthouse_is_refused_at_setup_with_its_address_and_how_to_start_one():
    _world()
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    address = f"http://127.0.0.1:{port}"
    try:
        ReplicaGroup(_config(address, connect_timeout=1.0))
    except FaultToleranceError as err:
        text = str(err)
    else:
        raise AssertionError("a group was built without a lighthouse")
    assert f"The lighthouse at {address} did not answer within connect_timeout=1 s" in text, text
    assert "lightning-fsdp lighthouse --min-replicas 1" in text and "TORCHFT_LIGHTHOUSE" in text, text
    return {"message": text}


@case
def a_model_with_two_fsdp_roots_is_refused():
    _world()
    with _lighthouse() as lighthouse, ReplicaGroup(_config(lighthouse.address())) as group:
        model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        fully_shard(model[0], mesh=mesh)
        fully_shard(model[1], mesh=mesh)
        try:
            group.install(model)
        except ValueError as err:
            text = str(err)
        else:
            raise AssertionError("two roots were accepted")
    assert "The model has 2 FSDP roots (0, 1)" in text and "HINT: Shard the model so that one module" in text, text
    return {"message": text}


def _wait_closed(address: str) -> None:
    parts = urlsplit(address)
    deadline = time.monotonic() + TIMEOUT.total_seconds()
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", parts.port), timeout=0.5):
                pass
        except OSError:
            return
        time.sleep(0.05)
    raise AssertionError(f"the lighthouse at {address} still accepts connections after its shutdown")


if __name__ == "__main__":
    run_cases()
