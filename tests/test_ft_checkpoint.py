"""Checkpoints under fault tolerance (issue 44): torchft's step saved and restored, a whole-job restart that resumes
exactly, a lighthouse that dies, a group killed while another saves, the writer killed mid-save, and preemption
inside a group. Two replica groups of one rank each (workers/ft_checkpoint.py), forked processes meeting at a
lighthouse in this process, as in test_ft_fabric.py; the helpers' checks of the saved counters run in this process."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import subprocess
import time
import warnings
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import torch

import forkserver
from launch import WORKERS, worker_env
from skips import require

require("torchft")

from lightning_fsdp._fronts.replica_checkpoint import STATE_KEY, restore_replica_state, with_replica_state  # noqa: E402

pytestmark = pytest.mark.single_process  # forked groups, rarely busy at once (see test_ft_fabric.py)


# --- the counters, in this process ----------------------------------------------------------------------------


class _Group:
    """The two methods of ReplicaGroup that the checkpoint helpers call."""

    def __init__(self, step: int = 5, batches: int = 9) -> None:
        self.state = {"step": step, "batches_committed": batches}

    def state_dict(self) -> dict:
        return dict(self.state)

    def load_state_dict(self, state: dict) -> None:
        self.state = dict(state)


def test_the_counters_go_with_the_state_and_come_back_out_of_the_remainder():
    group, state = _Group(), {"model": "m", "step": 3}
    saved = with_replica_state(group, state)
    assert saved == {"model": "m", "step": 3, STATE_KEY: {"step": 5, "batches_committed": 9}}
    assert STATE_KEY not in state  # the caller's dict is left as it was
    assert with_replica_state(None, state) is state  # fault tolerance off: nothing is added
    fresh, remainder = _Group(0, 0), {STATE_KEY: {"step": 5, "batches_committed": 9}, "extra": 1}
    restore_replica_state(fresh, remainder, "ckpt")
    assert fresh.state == {"step": 5, "batches_committed": 9} and remainder == {"extra": 1}
    remainder = {STATE_KEY: {"step": 5, "batches_committed": 9}}
    restore_replica_state(None, remainder, "ckpt")  # fault tolerance off: the strategy's key is not handed on
    assert remainder == {}


def test_a_checkpoint_without_the_counters_resumes_at_the_fallback_step():
    group = _Group()
    restore_replica_state(group, {}, "ckpt")  # Fabric: step 0
    assert group.state == {"step": 0, "batches_committed": 0}
    restore_replica_state(group, {"global_step": 12}, "ckpt", fallback_step=12)  # Trainer: its global_step
    assert group.state == {"step": 12, "batches_committed": 0}


@pytest.mark.parametrize("saved, said", [
    ({"step": -1, "batches_committed": 0}, r"fault_tolerance\['step'\] = -1\. Allowed: an int >= 0"),
    ({"step": True, "batches_committed": 0}, r"fault_tolerance\['step'\] = True\. Allowed: an int >= 0"),
    ({"step": 2, "batches_committed": 1.5}, r"fault_tolerance\['batches_committed'\] = 1\.5\. Allowed"),
    ({"step": 2}, r"holds fault_tolerance=\{'step': 2\}, not torchft's counters\. Allowed: a dict with exactly"),
    ([2, 0], r"holds fault_tolerance=\[2, 0\], not torchft's counters"),
])
def test_a_bad_saved_value_is_refused_naming_the_checkpoint_and_nothing_is_applied(saved, said):
    group = _Group()
    with pytest.raises(ValueError, match=said) as caught:
        restore_replica_state(group, {STATE_KEY: saved}, "/ckpt/step-2")
    assert "'/ckpt/step-2'" in str(caught.value) and "HINT:" in str(caught.value)
    assert group.state == {"step": 5, "batches_committed": 9}


def test_a_bad_fallback_step_is_refused():
    with pytest.raises(ValueError, match=r"the step to resume at .* = -3\. Allowed: an int >= 0"):
        restore_replica_state(_Group(), {"global_step": -3}, "ckpt", fallback_step=-3)


def test_a_users_entry_under_the_strategys_key_is_refused():
    with pytest.raises(ValueError, match=r"Invalid `state\['fault_tolerance'\]=1`.*HINT: Rename your entry"):
        with_replica_state(_Group(), {"model": "m", STATE_KEY: 1})


class _Manager:
    """torchft's Manager as far as the group's counters go."""

    def __init__(self) -> None:
        self.state = {"step": 4, "batches_committed": 8}

    def state_dict(self) -> dict:
        return dict(self.state)

    def load_state_dict(self, state: dict) -> None:
        self.state = dict(state)


def test_the_group_gives_torchfts_counters_and_refuses_to_set_them_inside_a_window():
    from lightning_fsdp.engine.fault_tolerance.group import ReplicaGroup

    group = ReplicaGroup.__new__(ReplicaGroup)  # no torchft Manager: only the counters are used here
    group.manager, group._window_open = _Manager(), True
    assert group.state_dict() == {"step": 4, "batches_committed": 8}
    with pytest.raises(RuntimeError, match=r"inside a window\. HINT: load the checkpoint before the step's first"):
        group.load_state_dict({"step": 1, "batches_committed": 2})  # the quorum in flight was asked with step 4
    assert group.manager.state == {"step": 4, "batches_committed": 8}
    group._window_open = False
    group.load_state_dict({"step": 1, "batches_committed": 2})
    assert group.manager.state == {"step": 1, "batches_committed": 2}


# --- real groups ------------------------------------------------------------------------------------------------


def _worker():
    spec = importlib.util.spec_from_file_location("ft_checkpoint", WORKERS / "ft_checkpoint.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _reference(steps: int) -> list[dict[str, torch.Tensor]]:
    """The weights after 0..steps steps without FSDP or faults: every group's gradient is the batch's."""
    worker = _worker()
    torch.manual_seed(0)
    net = worker.Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    states = [{k: v.detach().clone() for k, v in net.state_dict().items()}]
    for step in range(steps):
        opt.zero_grad()
        net(worker.batch(step)).square().mean().backward()
        opt.step()
        states.append({k: v.detach().clone() for k, v in net.state_dict().items()})
    return states


def _saved_weights(path: Path) -> dict[str, torch.Tensor]:
    """A checkpoint's model, read in this process (DCP without a process group)."""
    import torch.distributed.checkpoint as dcp

    template = {"model": {k: torch.empty_like(v) for k, v in _reference(0)[0].items()}}
    with warnings.catch_warnings():  # DCP warns that it loads in one process, which is the intent here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(template, checkpoint_id=path, no_dist=True)
    return template["model"]


def _saved_counters(path: Path) -> dict:
    """torchft's counters as a checkpoint holds them (its plain entries, ``meta.pt``)."""
    return torch.load(path / "meta.pt", weights_only=True).get(STATE_KEY)


def _equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> bool:
    return got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict[str, str]:
    """One environment for every run of this file, so that one warm server forks all their processes (each run's
    directory is an argument of the worker)."""
    os.environ.setdefault("RUST_LOG", "warn")  # torchft's Rust side logs every quorum at INFO otherwise
    env = worker_env(tmp_path_factory.mktemp("ft_checkpoint"))
    forkserver.wait_until_serving(forkserver.prewarm({k: v for k, v in env.items() if k not in ("RANK", "LOCAL_RANK")}),
                                  timeout_s=120)
    return env


class _Run:
    """A lighthouse in this process and the groups' processes, each attempt of a group with its own plan."""

    def __init__(self, env: dict[str, str], tmp: Path, min_replicas: int, join_timeout_ms: int = 200) -> None:
        from torchft.coordination import LighthouseServer

        self.env, self.tmp, self.procs, self.logs = env, tmp, [], {}
        self.lighthouse = LighthouseServer(bind="[::]:0", min_replicas=min_replicas,
                                           join_timeout_ms=join_timeout_ms,
                                           quorum_tick_ms=20, heartbeat_timeout_ms=1000)
        (tmp / "lighthouse").write_text(self.lighthouse.address())

    def start(self, group: int, plan: dict) -> subprocess.Popen:
        log = self.logs.setdefault(group, open(self.tmp / f"group{group}.log", "a"))  # noqa: SIM115 - closed below
        proc = subprocess.Popen([forkserver.python(), str(WORKERS / "ft_checkpoint.py"), str(group), str(self.tmp),
                                 json.dumps(plan)], env=self.env, stdout=log, stderr=subprocess.STDOUT)
        self.procs.append(proc)
        return proc

    def wait_file(self, name: str, *procs: subprocess.Popen) -> None:
        """Until a group writes ``name`` (bounded against a hang: 120 s; each phase takes a second or two), failing
        at once when one of ``procs`` ended instead."""
        deadline = time.monotonic() + 120
        while not (self.tmp / name).exists():
            ended = [p.returncode for p in procs if p.poll() is not None]
            assert not ended and time.monotonic() < deadline, (name, ended, self.output())
            time.sleep(0.01)

    def release(self, gate: str, *procs: subprocess.Popen) -> None:
        """Once both groups wait at ``gate``, let them go."""
        for g in (0, 1):
            self.wait_file(f"at-{gate}-{g}", *procs)
        (self.tmp / gate).touch()

    def result(self, group: int, attempt: int) -> dict:
        return json.loads((self.tmp / f"result{group}-{attempt}.json").read_text())

    def weights(self, group: int, attempt: int) -> dict[str, torch.Tensor]:
        return torch.load(self.tmp / f"weights{group}-{attempt}.pt")

    def output(self) -> str:
        for log in self.logs.values():
            log.flush()
        return "\n".join((self.tmp / f"group{g}.log").read_text()[-4000:] for g in sorted(self.logs))

    def kill_lighthouse(self) -> None:
        """As a lighthouse process that dies: ``shutdown()`` closes the listening port, but the server answers on
        the connections it has until the object is dropped (see workers/ft_group.py)."""
        address, self.lighthouse = self.lighthouse.address(), self.lighthouse.shutdown()
        port = urlsplit(address).port
        deadline = time.monotonic() + 60  # bounds a hang only; it closes at once
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            except OSError:
                return
            time.sleep(0.05)
        raise AssertionError(f"the lighthouse at {address} still accepts connections after its shutdown")

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for log in self.logs.values():
            log.close()
        if self.lighthouse is not None:
            self.lighthouse.shutdown()


# The restarted groups' quorum timeout: a dead lighthouse is found when it runs out (torchft's quorum call waits it
# out; 3.0 s for 3 s in test_ft_group). Both groups are set up before their first quorum (a gate), so it need only
# outlast a step and the writer's save, which the other group waits for in its quorum (0.3 s at most here, 2026-11-29).
QUORUM_TIMEOUT = 4.0


def test_a_whole_job_restart_resumes_at_the_saved_step_exactly_and_a_dead_lighthouse_ends_every_group(env, tmp_path):
    """Both groups train 3 steps and save (one writes), and stop. Both restart from that checkpoint: torchft's step
    is 3 again, no group heals (init_sync is on, which copies state only at step 0), and after 7 steps both hold the
    weights of a run never stopped. Both save at 7; then the lighthouse dies: each group's next step raises
    FaultToleranceError naming the lighthouse, within the quorum timeout, and the checkpoint at 7 is intact."""
    run = _Run(env, tmp_path, min_replicas=2)  # a step needs both groups: none runs ahead while the other starts
    want = _reference(7)
    try:
        first = {"steps": 3, "min_replicas": 2, "save_at": [3]}
        procs = [run.start(g, first) for g in (0, 1)]
        assert [p.wait(timeout=120) for p in procs] == [0, 0], run.output()
        # init_sync on: torchft copies one group's state to the others when they meet at step 0; at a checkpoint's
        # step it must not (every group holds that step's state already).
        second = {"steps": 8, "min_replicas": 2, "quorum_timeout": QUORUM_TIMEOUT, "load": "ckpt/step-00000003",
                  "save_at": [7], "gates": {"3": "start", "7": "lighthouse-dead"}, "init_sync": True}
        procs = [run.start(g, second) for g in (0, 1)]
        run.release("start", *procs)
        for g in (0, 1):
            run.wait_file(f"at-lighthouse-dead-{g}", *procs)
        run.kill_lighthouse()
        (tmp_path / "lighthouse-dead").touch()
        codes = [p.wait(timeout=QUORUM_TIMEOUT * 3) for p in procs]  # bounds a hang only
    finally:
        run.close()
    assert codes == [0, 0], run.output()
    saved = [run.result(g, 1)["saved"] for g in (0, 1)]
    assert saved == [[["step-00000003", True]], [["step-00000003", False]]], saved  # group 0 wrote, once
    assert [run.result(g, 1)["healed"] for g in (0, 1)] == [[], []]  # the same seed, init_sync off: no copy
    for g in (0, 1):
        result = run.result(g, 2)
        assert result["start_step"] == 3 and result["healed"] == [], result  # resumed at 3; nobody healed
        assert result["steps"] == 7 and _equal(run.weights(g, 2), want[7]), (g, result)
        error = result["error"] or ""
        assert "Fault tolerance failed in" in error and "HINT: check that the lighthouse at http" in error, error
        assert result["error_after_s"] < QUORUM_TIMEOUT + 10, result  # not a hang: within the quorum timeout
    assert _equal(_saved_weights(tmp_path / "ckpt" / "step-00000003"), want[3])
    assert _equal(_saved_weights(tmp_path / "ckpt" / "step-00000007"), want[7])
    # Both groups took part in every step: 2 batches committed per step.
    assert _saved_counters(tmp_path / "ckpt" / "step-00000007") == {"step": 7, "batches_committed": 14}


# Under min_replicas=1 a quorum waits this long for a live group that has not joined yet (a peer inside its save), so
# the groups stay in step; a dead group's heartbeat stops, and the survivor goes on alone after heartbeat_timeout_ms.
IN_STEP_MS = 3000


def test_a_group_killed_while_the_writer_saves_leaves_the_checkpoint_committed_and_the_writer_trains_on(env, tmp_path):
    """Group 1 is SIGKILLed while group 0, the writer, is inside `fabric.save` (its files written, not committed):
    the save commits, equal to the weights at that step, and group 0 trains on alone and saves again."""
    run = _Run(env, tmp_path, min_replicas=1, join_timeout_ms=IN_STEP_MS)
    want = _reference(6)
    try:
        writer = run.start(0, {"steps": 6, "min_replicas": 1, "save_at": [3, 6], "gates": {"0": "start"},
                               "in_save": {"step-00000003": "pause"}})
        other = run.start(1, {"steps": 6, "min_replicas": 1, "save_at": [3], "gates": {"0": "start"}})
        run.release("start", writer, other)
        run.wait_file("saving-step-00000003", writer, other)
        other.kill()
        assert other.wait(timeout=60) == -signal.SIGKILL
        (tmp_path / "go-step-00000003").touch()
        code = writer.wait(timeout=120)  # bounds a hang only
    finally:
        run.close()
    assert code == 0, run.output()
    result = run.result(0, 1)
    assert result["saved"] == [["step-00000003", True], ["step-00000006", True]], result
    assert result["steps"] == 6 and _equal(run.weights(0, 1), want[6]), result
    assert _equal(_saved_weights(tmp_path / "ckpt" / "step-00000003"), want[3])
    assert _equal(_saved_weights(tmp_path / "ckpt" / "step-00000006"), want[6])
    assert [_saved_counters(tmp_path / "ckpt" / f"step-0000000{s}")["step"] for s in (3, 6)] == [3, 6]


def test_the_writer_killed_mid_save_leaves_the_previous_checkpoint_newest_and_the_survivor_becomes_the_writer(
        env, tmp_path):
    """Group 0, the writer, is SIGKILLed inside its save at step 5 (files written, not committed): the newest good
    checkpoint is still step 3, nothing of step 5 is committed; group 1 trains on alone and writes step 8."""
    from lightning_fsdp.checkpoint.latest import newest_good_checkpoint, step_checkpoints

    run = _Run(env, tmp_path, min_replicas=1, join_timeout_ms=IN_STEP_MS)
    want = _reference(8)
    ckpt = tmp_path / "ckpt"
    try:
        writer = run.start(0, {"steps": 8, "min_replicas": 1, "save_at": [3, 5], "gates": {"0": "start"},
                               "in_save": {"step-00000005": "die"}})
        other = run.start(1, {"steps": 8, "min_replicas": 1, "save_at": [3, 5, 8], "gates": {"0": "start",
                                                                                        "6": "checked"}})
        run.release("start", writer, other)
        assert writer.wait(timeout=120) == -signal.SIGKILL, run.output()
        run.wait_file("at-checked-1", other)
        newest = newest_good_checkpoint(ckpt)
        committed = [Path(str(p)).name for p in step_checkpoints(ckpt)]
        (tmp_path / "checked").touch()
        code = other.wait(timeout=120)
    finally:
        run.close()
    assert code == 0, run.output()
    assert Path(str(newest)).name == "step-00000003" and committed == ["step-00000003"], (newest, committed)
    assert run.result(1, 1)["saved"] == [["step-00000003", False], ["step-00000005", False],
                                         ["step-00000008", True]], run.result(1, 1)
    assert [Path(str(p)).name for p in step_checkpoints(ckpt)] == ["step-00000003", "step-00000008"]
    assert _equal(_saved_weights(ckpt / "step-00000003"), want[3])
    assert _equal(_saved_weights(ckpt / "step-00000008"), want[8])
    assert _equal(run.weights(1, 1), want[8])
    assert [_saved_counters(ckpt / f"step-0000000{s}")["step"] for s in (3, 8)] == [3, 8]


def test_a_preempted_writer_saves_its_agreed_checkpoint_and_leaves_and_the_other_group_goes_on(env, tmp_path):
    """SIGTERM reaches group 0, the writer, before step 4: it finishes the step, saves step 5 (the agreed save of
    `Preemption`), and exits with 143; group 1's next quorums form without it, and it trains on and writes step 8."""
    run = _Run(env, tmp_path, min_replicas=1, join_timeout_ms=IN_STEP_MS)
    want = _reference(8)
    try:
        writer = run.start(0, {"steps": 8, "min_replicas": 1, "preemption": True,
                               "gates": {"0": "start", "4": "preempt"}})
        other = run.start(1, {"steps": 8, "min_replicas": 1, "save_at": [8], "gates": {"0": "start"}})
        run.release("start", writer, other)
        run.wait_file("at-preempt-0", writer, other)
        writer.send_signal(signal.SIGTERM)
        (tmp_path / "preempt").touch()
        codes = [writer.wait(timeout=120), other.wait(timeout=120)]
    finally:
        run.close()
    assert codes == [143, 0], run.output()
    first, second = run.result(0, 1), run.result(1, 1)
    assert first["preempted_at"] == 5 and first["saved"] == [["step-00000005", True]], first
    assert _equal(_saved_weights(tmp_path / "ckpt" / "step-00000005"), want[5])
    assert _saved_counters(tmp_path / "ckpt" / "step-00000005")["step"] == 5
    assert second["saved"] == [["step-00000008", True]] and _equal(run.weights(1, 1), want[8]), second
    # It left the quorum: group 1's steps after it did not wait out the quorum timeout (30 s) for it.
    assert second["longest_step_s"] < 30, second
