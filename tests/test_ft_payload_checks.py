"""A peer's heal payload and a checkpoint's torchft counters are untrusted input (reviewer R's findings F5-F7, F9, F10,
2026-11-29): each malformed one is one clear error before anything is allocated from it or applied.

- F5: a tensor shape with a 0 dim next to huge ones claimed 0 bytes, passed the header check, then crashed the
  receive (a raw TypeError or "Stride calculation overflowed") after the receiver had answered ACCEPTED;
- F10: a header of millions of empty tensors cost ~1.5 GiB and ~23 s: the receiver now bounds their count;
- F6: random states that restoring then failed on passed the check, after the model had been overwritten;
- F7: torchft's part of the heal tree (its counters, applied by torchft as soon as the transport returns) and the tree's
  shape were never checked;
- F9: a checkpoint's counters had no upper bound, a refused entry was printed whole, and a user's own entry saved with
  fault tolerance off was blamed on "another tool".

All in this process: the wire cases run two threads over a 2-rank gloo group on a ``HashStore``, as
tests/test_ft_transport.py does.
"""

from __future__ import annotations

import copy
import json
import random
from datetime import timedelta

import pytest
import torch

from lightning_fsdp._fronts import replica
from lightning_fsdp._fronts.replica_checkpoint import STATE_KEY, restore_replica_state
from lightning_fsdp.engine.fault_tolerance import heal
from lightning_fsdp.engine.fault_tolerance.config import FaultToleranceError
from lightning_fsdp.engine.fault_tolerance import transport as T
from test_ft_transport import pair  # its two-rank gloo group in threads

pytestmark = pytest.mark.single_process

TIMEOUT = timedelta(seconds=30)  # bounds a hang only: a transfer here takes milliseconds
LAYOUT = {"digest": "0", "entries": []}


def header(specs, tree, step=3) -> bytes:
    return json.dumps({"format": T.FORMAT, "step": step, "layout": LAYOUT, "tensors": specs, "tree": tree}).encode()


def raw_sender(raw: bytes):
    """A sender of a hand-made header with the transport's own framing (what a faulty or hostile peer could send)."""
    return lambda pg: T.send(pg, 1, raw, [], timeout=TIMEOUT)


# ---- F5: shapes whose dims overflow, though empty ----------------------------------------------------------------


@pytest.mark.parametrize("shape", [[0, 2**62, 2**62], [0, 2**63], [2**40, 0, 2**40, 2**40], [2**61, 0]])
def test_an_empty_shape_whose_dims_overflow_is_refused_in_the_header(shape):
    with pytest.raises(T.PayloadError, match=r"tensor 0 has the shape .* span over .*HINT") as caught:
        T.parse_header(header([["float32", shape, 0, False]], {"x": 0}), step=3, layout=LAYOUT, max_bytes=1 << 20)
    assert type(caught.value) is T.PayloadError and caught.value.code == T.MALFORMED
    # The largest empty shape accepted is one torch allocates.
    (spec,) = T.parse_header(header([["float32", [0, 2**60], 0, False]], {"x": 0}), step=3, layout=LAYOUT).specs
    assert torch.empty(spec.shape, dtype=spec.dtype).shape == (0, 2**60)


def test_an_overflowing_empty_shape_fails_both_sides_before_any_tensor_byte():
    """Old code: the receiver answered ACCEPTED, the sender reported success, the receiver raised a raw TypeError."""
    raw = header([["float32", [0, 2**63], 0, False]], {"x": 0})
    sent, received = pair(raw_sender(raw), lambda pg: T.receive(pg, 0, step=3, layout=LAYOUT, timeout=TIMEOUT))
    assert type(received) is T.PayloadError and "span over" in str(received)
    assert type(sent) is T.PayloadError and "refused the heal payload: malformed" in str(sent)


# ---- F10: the number of tensors ----------------------------------------------------------------------------------


def test_more_tensors_than_the_receiver_allows_are_refused_as_too_large():
    specs = [["bool", [0], 0, True]] * 3
    tree = {"l": [{"x": i} for i in range(3)]}
    assert len(T.parse_header(header(specs, tree), step=3, layout=LAYOUT, max_tensors=3).specs) == 3
    with pytest.raises(T.PayloadError, match="lists 3 tensors, over the 2 this receiver allows") as caught:
        T.parse_header(header(specs, tree), step=3, layout=LAYOUT, max_tensors=2)
    assert caught.value.code == T.TOO_LARGE


class _Captured(Exception):
    """Stops start_replica_group once the group's parts are captured."""


def _captured_group(monkeypatch, module, optimizers, extra=None):
    """What start_replica_group gives its ReplicaGroup: the transport factory and the heal's load function."""
    seen = {}

    class Group:
        def __init__(self, config, transport, device):
            seen["transport"] = transport

        def install(self, module):
            pass

        def register_state(self, key, load, produce):
            seen["load"], seen["produce"] = load, produce
            raise _Captured

        def close(self):
            pass

    monkeypatch.setattr(replica, "ReplicaGroup", Group)
    with pytest.raises(_Captured):
        replica.start_replica_group(None, module, optimizers, device=torch.device("cpu"), extra=extra)
    return seen


def test_the_fronts_transport_bounds_tensors_by_the_model_and_checks_its_own_key(monkeypatch):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))  # 4 parameters, 3 buffers
    transport = _captured_group(monkeypatch, model, [torch.optim.SGD(model.parameters(), lr=0.1)])["transport"](None)
    assert transport.max_tensors == replica.heal_tensors_limit(model) == 8 * 7 + replica.HEAL_TENSOR_SLACK
    assert transport.max_bytes == replica.heal_bytes_limit(model) and transport.user_keys == (replica.HEAL_KEY,)


# ---- F7: torchft's tree ------------------------------------------------------------------------------------------

GOOD_TREE = {"user": {"lightning_fsdp": {"w": torch.arange(4.0)}}, "torchft": {"step": 3, "batches_committed": 6}}
DROP = object()  # a part left out of the tree
BAD_TREES = {
    "a negative count": {"torchft": {"step": 3, "batches_committed": -7}},
    "a str count": {"torchft": {"step": 3, "batches_committed": "12"}},
    "a list count": {"torchft": {"step": 3, "batches_committed": [1, 1, 1]}},
    "a bool count": {"torchft": {"step": 3, "batches_committed": True}},
    "a count of 2**53": {"torchft": {"step": 3, "batches_committed": 2**53}},
    "a float count": {"torchft": {"step": 3, "batches_committed": 6.0}},
    "another step": {"torchft": {"step": 4, "batches_committed": 6}},
    "a missing counter": {"torchft": {"step": 3}},
    "an extra counter": {"torchft": {"step": 3, "batches_committed": 6, "x": 0}},
    "counters not a dict": {"torchft": [3, 6]},
    "no torchft part": {"torchft": DROP},
    "no user part": {"user": DROP},
    "a user part without the key": {"user": {"other": 1}},
    "a user part with another key too": {"user": {"lightning_fsdp": None, "other": 1}},
    "a user part that is a list": {"user": [None]},
    "an extra top key": {"more": 1},
}


def _tree(name):
    return {key: value for key, value in {**GOOD_TREE, **BAD_TREES[name]}.items() if value is not DROP}


@pytest.mark.parametrize("name", list(BAD_TREES))
def test_a_tree_that_is_not_torchfts_is_refused_before_any_tensor_byte(name):
    """Old code: received whole and handed to torchft, which set its counters from it (-7, '12', a list: the next
    checkpoint then stored them or failed), or later failed applying it with a bare KeyError."""
    tree = _tree(name)
    sent, received = pair(
        lambda pg: T.HealTransport(pg, layout=LAYOUT).send_checkpoint([1], 3, tree, TIMEOUT),
        lambda pg: T.HealTransport(pg, layout=LAYOUT, user_keys=("lightning_fsdp",)).recv_checkpoint(
            0, T.FORMAT, 3, TIMEOUT))
    assert type(received) is T.PayloadError and "HINT" in str(received), received
    assert received.code == T.MALFORMED and "heal payload from rank 0: the tree" in str(received)
    assert type(sent) is T.PayloadError and "refused the heal payload: malformed" in str(sent)


def test_torchfts_tree_with_its_counters_at_the_bound_is_received():
    tree = copy.deepcopy(GOOD_TREE)
    tree["torchft"]["batches_committed"] = 2**53 - 1
    sent, received = pair(
        lambda pg: T.HealTransport(pg, layout=LAYOUT).send_checkpoint([1], 3, tree, TIMEOUT),
        lambda pg: T.HealTransport(pg, layout=LAYOUT, user_keys=("lightning_fsdp",)).recv_checkpoint(
            0, T.FORMAT, 3, TIMEOUT))
    assert sent is None and received["torchft"] == tree["torchft"]
    assert torch.equal(received["user"]["lightning_fsdp"]["w"], torch.arange(4.0))


# ---- F6: random states -------------------------------------------------------------------------------------------


def _with(**parts):
    state = heal.rng_state()
    state.update(parts)
    return state


def _python(index=None, word=None, gauss=None, length=625):
    version, internal, _ = random.getstate()
    internal = list(internal)[:length]
    if index is not None:
        internal[-1] = index
    if word is not None:
        internal[0] = word
    return (version, internal, gauss)


def _numpy(kind="MT19937", keys=None, pos=0, has_gauss=0, cached=0.0, length=5):
    keys = torch.zeros(624, dtype=torch.int64) + 5 if keys is None else keys
    return (kind, keys, pos, has_gauss, cached)[:length]


BAD_RNG = {
    "python index 10**6": lambda: _with(python=_python(index=10**6)),
    "python index 625": lambda: _with(python=_python(index=625)),
    "python word 2**40": lambda: _with(python=_python(word=2**40)),
    "python word -1": lambda: _with(python=_python(word=-1)),
    "python gauss a str": lambda: _with(python=_python(gauss="x")),
    "python version 9": lambda: _with(python=(9, *_python()[1:])),
    "python 624 words": lambda: _with(python=_python(length=624)),
    "torch state all zeros": lambda: _with(torch=torch.zeros_like(torch.get_rng_state())),
    "torch state int64": lambda: _with(torch=torch.get_rng_state().long()),
    "torch state 2-d": lambda: _with(torch=torch.get_rng_state().reshape(2, -1)),
    "numpy a 2-tuple": lambda: _with(numpy=("MT19937", 7)),
    "numpy 3 keys": lambda: _with(numpy=_numpy(keys=torch.zeros(3, dtype=torch.int64))),
    "numpy keys of 2**32": lambda: _with(numpy=_numpy(keys=torch.full((624,), 2**32))),
    "numpy keys float": lambda: _with(numpy=_numpy(keys=torch.zeros(624))),
    "numpy position 625": lambda: _with(numpy=_numpy(pos=625)),
    "numpy position -1": lambda: _with(numpy=_numpy(pos=-1)),
    "numpy has_gauss 5": lambda: _with(numpy=_numpy(has_gauss=5)),
    "numpy cached an int": lambda: _with(numpy=_numpy(cached=0)),
    "numpy another kind": lambda: _with(numpy=_numpy(kind="PCG64")),
    "cuda one state too many": lambda: _with(cuda=[torch.zeros(16, dtype=torch.uint8)] * (torch.cuda.device_count()
                                                                                            + 1)),
    "cuda states not tensors": lambda: _with(cuda=[0] * torch.cuda.device_count() or [0]),
}


@pytest.fixture(autouse=True)
def same_random_state_after():
    """A failed restore on old code may leave a generator changed: later tests get them back as they were."""
    state = heal.rng_state()
    yield
    heal.restore_rng_state(state)


@pytest.mark.parametrize("name", list(BAD_RNG))
def test_random_states_restore_would_fail_on_are_refused_by_the_check(name):
    heal.check_rng_state(heal.rng_state())  # this rank's own, and the edges of the ranges, pass
    heal.check_rng_state(_with(numpy=_numpy(pos=624, has_gauss=1, keys=torch.full((624,), 2**32 - 1))))
    heal.check_rng_state(_with(python=_python(index=624)))
    with pytest.raises(T.LayoutMismatch, match=r"(?s)the random states \(.+\).*HINT"):
        heal.check_rng_state(BAD_RNG[name]())


def test_a_heal_with_bad_random_states_changes_nothing(monkeypatch):
    """Old code: the check passed, the model and optimizer were overwritten, then restoring raised ValueError."""
    torch.manual_seed(0)
    source = torch.nn.Linear(4, 4)
    target = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(target.parameters(), lr=0.1)
    payload = heal.produce(source, [torch.optim.SGD(source.parameters(), lr=0.1)], strategy=_with(
        python=_python(index=10**6)))
    load = _captured_group(monkeypatch, target, [optimizer])["load"]
    before = [p.detach().clone() for p in target.parameters()]
    with pytest.raises(T.LayoutMismatch, match="the random states"):
        load(payload)
    assert all(torch.equal(p, b) for p, b in zip(target.parameters(), before))
    assert not torch.equal(target.weight, source.weight)


def test_a_heal_whose_loop_state_does_not_fit_changes_nothing(monkeypatch):
    """The Trainer's loop state is checked before the model is: old code overwrote the weights and the optimizer,
    then refused the loop state (its shape check ran in the last step of the heal)."""
    from lightning_fsdp._fronts.trainer_heal import LoopPosition

    class Loop:  # the fit loop's state_dict, as LoopPosition reads it
        def state_dict(self):
            return {"epoch_progress": {"current": {"processed": 0}}, "state_dict": {}}

    position = LoopPosition(type("Trainer", (), {"fit_loop": Loop()})())
    torch.manual_seed(0)
    source, target = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(target.parameters(), lr=0.1)
    payload = heal.produce(source, [torch.optim.SGD(source.parameters(), lr=0.1)], strategy=heal.rng_state(),
                           loop={"epoch_progress": {"current": {"processed": "zero"}}, "state_dict": {}})
    load = _captured_group(monkeypatch, target, [optimizer], extra=position)["load"]
    before = [p.detach().clone() for p in target.parameters()]
    with pytest.raises(FaultToleranceError, match=r"epoch_progress\.current\.processed"):
        load(payload)
    assert all(torch.equal(p, b) for p, b in zip(target.parameters(), before))


# ---- F9: the counters in a checkpoint ----------------------------------------------------------------------------


class _Group:
    def __init__(self) -> None:
        self.state = None

    def load_state_dict(self, state) -> None:
        self.state = state


@pytest.mark.parametrize("saved", [{"step": 2**53, "batches_committed": 0}, {"step": 0, "batches_committed": 2**80}])
def test_counters_from_2_to_the_53_are_refused(saved):
    group = _Group()
    with pytest.raises(ValueError, match=r"= \d+\. Allowed: an int >= 0 and < 2\*\*53\. HINT"):
        restore_replica_state(group, {STATE_KEY: saved}, "ckpt")
    assert group.state is None
    restore_replica_state(group, {STATE_KEY: {"step": 2**53 - 1, "batches_committed": 0}}, "ckpt")
    assert group.state == {"step": 2**53 - 1, "batches_committed": 0}


def test_a_users_own_entry_saved_without_fault_tolerance_is_named_in_the_hint_and_cut():
    with pytest.raises(ValueError) as caught:
        restore_replica_state(_Group(), {STATE_KEY: {"my_log": list(range(200_000))}}, "/ckpt/a")
    message = str(caught.value)
    assert len(message) < 1000 and "holds fault_tolerance={'my_log': [0, 1, 2" in message
    assert "saved with fault tolerance off and 'fault_tolerance' is your own entry there" in message
    assert "rename that entry" in message


def test_without_fault_tolerance_only_counters_in_range_are_taken_as_the_strategys():
    remainder = {STATE_KEY: {"step": 2**53, "batches_committed": 0}}
    restore_replica_state(None, remainder, "ckpt")
    assert remainder == {STATE_KEY: {"step": 2**53, "batches_committed": 0}}  # not counters this strategy saved
