"""The heal wire (engine/fault_tolerance/transport.py, issue 44 item 3): a JSON header plus raw tensor bytes.

- plain values come back bit for bit and type for type (NaN payloads, -0.0, inf, int keys, tuples), tensors of every
  allowed dtype byte for byte, 0-d and empty ones included, over a real gloo process group;
- nothing is unpickled during a receive: pickle's loaders and ``torch.load`` raise if called;
- what cannot travel is refused at the sender, naming its path; every malformed header, hand-made or fuzzed, is one
  ``PayloadError`` with a HINT, and a refused header is an error on both sides before any tensor byte moves.

The two ranks are two threads of this process, each holding a ``ProcessGroupGloo`` made from one ``HashStore`` (the
group objects are standalone: no default process group is created in the pytest process).
"""

from __future__ import annotations

import json
import pickle
import random
import struct
import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from lightning_fsdp.engine.fault_tolerance import transport as T

pytestmark = pytest.mark.single_process

TIMEOUT = timedelta(seconds=30)  # bounds a hang only: a transfer here takes milliseconds
LAYOUT = {"digest": "0123456789abcdef", "entries": [["param", "w", "float32", [4]]]}


def pair(sender, receiver, timeout: timedelta = TIMEOUT) -> list:
    """Run ``sender(pg)`` as rank 0 and ``receiver(pg)`` as rank 1 of a 2-rank gloo group in two threads; returns
    [result or exception] per rank."""
    store = dist.HashStore()
    results: list = [None, None]

    def run(rank, fn):
        try:
            pg = dist.ProcessGroupGloo(store, rank, 2, timeout)
            results[rank] = fn(pg)
        except BaseException as err:  # handed to the test, which checks its type
            results[rank] = err

    threads = [threading.Thread(target=run, args=(r, f), daemon=True) for r, f in enumerate((sender, receiver))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout.total_seconds() * 2)
        assert not t.is_alive(), "a transfer hung past the group's timeout"
    return results


def same(a, b) -> bool:
    """Equal in type and value, floats by their bits, tensors by dtype, shape and bytes."""
    if type(a) is not type(b):
        return False
    if type(a) is float:
        return struct.pack(">d", a) == struct.pack(">d", b)
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
            a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))
    if type(a) is T.LocalShard:
        return same(a.local, b.local)
    if type(a) in (list, tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if type(a) is dict:
        return list(a) == list(b) and all(type(k) is type(j) for k, j in zip(a, b)) \
            and all(same(a[k], b[k]) for k in a)
    return a == b


def weird_floats() -> list[float]:
    bits = [0x7FF8000000000001, 0xFFF8000000000000, 0x7FF4000000000000]  # NaNs with payloads and a sign
    return [struct.unpack(">d", struct.pack(">Q", b))[0] for b in bits] + [
        -0.0, 0.0, float("inf"), float("-inf"), 5e-324, 1.7976931348623157e308, 0.1]


def random_tensor(dtype: torch.dtype, shape, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    n = 1
    for s in shape:
        n *= s
    raw = torch.randint(0, 2 if dtype == torch.bool else 256, (n * dtype.itemsize,), dtype=torch.uint8, generator=g)
    return raw.view(dtype).reshape(shape)


def test_plain_values_come_back_bit_for_bit():
    tree = {"floats": weird_floats(), 7: (1, (2, [3]), {}), -1: [], "s": "ä\ud800\x00", "big": -(2 ** 100),
            "flags": [True, False, None], "nested": {0: {"1": {2: ()}}}}
    header, tensors = T.encode(tree, step=3, layout=LAYOUT)
    assert tensors == []
    back = T.build(T.parse_header(header, step=3, layout=LAYOUT), [])
    assert same(back, tree)
    assert struct.pack(">d", back["floats"][0]) == struct.pack(">Q", 0x7FF8000000000001)


def _payload() -> dict:
    shared = random_tensor(torch.float32, (5,), 99)
    tensors = {name: random_tensor(dtype, (3, 2), i) for i, (name, dtype) in enumerate(T.DTYPES.items())}
    return {
        "dtypes": tensors,
        "zero_d": [torch.tensor(2.5), torch.tensor(-0.0, dtype=torch.bfloat16), torch.tensor(True)],
        "empty": (torch.empty(0, 3), torch.empty(0, dtype=torch.int64)),
        "big": random_tensor(torch.bfloat16, (70_000,), 1),  # over SMALL: a message of its own
        "many": [random_tensor(torch.float32, (1000,), 10 + i) for i in range(300)],  # 1.2 MB of small ones: 2 packs
        "strided": random_tensor(torch.float64, (6, 4), 5).t(),
        "twice": [shared, shared],
        "floats": weird_floats(),
    }


def test_tensors_cross_a_gloo_group_byte_for_byte_and_nothing_is_unpickled(monkeypatch):
    payload = _payload()
    header, tensors = T.encode(payload, step=11, layout=LAYOUT)

    def forbidden(*args, **kwargs):
        raise AssertionError("a receive called an unpickler or torch.load")

    import _pickle

    for module, names in ((pickle, ("loads", "load", "Unpickler", "_Unpickler", "_loads", "_load")),
                          (_pickle, ("loads", "load", "Unpickler")), (torch, ("load",)),
                          (torch.serialization, ("load",))):
        for name in names:
            monkeypatch.setattr(module, name, forbidden)
    sent, received = pair(lambda pg: T.send(pg, 1, header, tensors, timeout=TIMEOUT),
                          lambda pg: T.receive(pg, 0, step=11, layout=LAYOUT, timeout=TIMEOUT))
    assert not isinstance(sent, BaseException), sent
    assert not isinstance(received, BaseException), received
    back, count = received
    assert same(back, payload)
    assert back["twice"][0] is back["twice"][1], "a tensor sent once for two references comes back as one object"
    assert sent == count
    data = sum(t.numel() * t.element_size() for t in tensors)
    assert data < count - len(header) <= data + T.ALIGN * len(tensors) + 8  # the tensors' bytes plus pack alignment


def test_local_shards_of_dtensors_travel_as_local_shards(monkeypatch):
    """A DTensor goes as its local shard and comes back as a LocalShard, for the loader to rewrap (no DeviceMesh
    crosses the wire). Faked: the encoder only asks whether a tensor is a DTensor and for its local shard."""
    local = random_tensor(torch.float32, (4, 3), 7)

    class FakeDTensor(torch.Tensor):
        def to_local(self):
            return local

    moment = torch.Tensor._make_subclass(FakeDTensor, torch.zeros(8, 3))
    monkeypatch.setattr(T, "_is_dtensor", lambda t: type(t) is FakeDTensor)
    header, tensors = T.encode({"exp_avg": moment}, step=0, layout=LAYOUT)
    assert json.loads(header)["tree"] == {"d": [["exp_avg", {"dx": 0}]]} and tensors[0] is not moment
    back = T.build(T.parse_header(header, step=0, layout=LAYOUT), [local.clone()])
    assert type(back["exp_avg"]) is T.LocalShard and torch.equal(back["exp_avg"].local, local)


@pytest.mark.parametrize("value, path", [
    ({"lr": lambda step: 1.0}, "state.lr"),
    ({"groups": [{"dtype": torch.float32}]}, "state.groups.0.dtype"),
    ({"mode": T.Spec}, "state.mode"),
    ({"s": {1, 2}}, "state.s"),
    ({(1, 2): 3}, "state"),
    ({True: 3}, "state"),
    ({"size": torch.Size([2])}, "state.size"),
    ({"sparse": torch.zeros(2, 2).to_sparse()}, "state.sparse"),
    ({"q": torch.zeros(2, dtype=torch.uint8).view(torch.float8_e4m3fnuz)}, "state.q"),
    ({"n": json.loads("[" * 70 + "]" * 70)}, "state.n"),
])
def test_the_sender_refuses_what_cannot_travel_naming_its_path(value, path):
    with pytest.raises(TypeError, match=rf"^{path}[:.]"):
        T.encode(value, step=0, layout=LAYOUT)
    with pytest.raises(TypeError, match=rf"^{path}[:.]"):
        T.freeze(value)


def _header(**changes) -> bytes:
    head = {"format": T.FORMAT, "step": 1, "layout": LAYOUT, "tensors": [["float32", [2, 3], 24, True]],
            "tree": {"d": [["w", {"x": 0}]]}}
    head.update(changes)
    return json.dumps(head).encode()


MALFORMED = {
    "not utf-8": b"\xff\xfe{}",
    "not json": b'{"format": ',
    "a list": b"[]",
    "a missing key": json.dumps({"format": T.FORMAT}).encode(),
    "an extra key": _header(extra=1)[:-1] + b',"more":1}',
    "another format": _header(format="lightning-fsdp-heal/0"),
    "a step that is a bool": _header(step=True),
    "an unknown dtype": _header(tensors=[["object", [2, 3], 24, True]]),
    "a wrong byte count": _header(tensors=[["float32", [2, 3], 25, True]]),
    "a negative dim": _header(tensors=[["float32", [-2, -3], 24, True]]),
    "a bool dim": _header(tensors=[["float32", [True, 6], 24, True]]),
    "a short spec": _header(tensors=[["float32", [6], 24]]),
    "an index out of range": _header(tree={"x": 1}),
    "an unused tensor": _header(tree=None),
    "a raw float": _header(tree={"l": [1.5, {"x": 0}]}),
    "a NaN literal": _header()[:-1].replace(b'"tree": {', b'"tree": {"l": [NaN, {"x": 0}]}, "u": {') + b"}",
    "a short float": _header(tree={"l": [{"f": "7ff8"}, {"x": 0}]}),
    "two forms in a node": _header(tree={"x": 0, "l": []}),
    "a repeated dict key": _header(tree={"d": [["a", 1], ["a", {"x": 0}]]}),
    "a tuple dict key": _header(tree={"d": [[[1], {"x": 0}]]}),
    "too deep": _header(tree=json.loads('{"l": [' * 70 + '{"x": 0}' + "]}" * 70)),
    "a stack bomb": b'{"tree": ' + b"[" * 200_000 + b"]" * 200_000 + b"}",
    "a 10000-digit int": _header(tree={"l": [{"x": 0}]})[:-2] + b", " + b"9" * 10_000 + b"]}}",
}


@pytest.mark.parametrize("name", list(MALFORMED))
def test_every_malformed_header_is_one_clear_error(name):
    with pytest.raises(T.PayloadError, match="HINT") as caught:
        T.parse_header(MALFORMED[name], step=1, layout=LAYOUT)
    assert type(caught.value) is T.PayloadError and caught.value.code == T.MALFORMED


def test_another_step_layout_or_size_is_refused_with_its_reason():
    with pytest.raises(T.PayloadError, match="for step 1, expected step 2") as caught:
        T.parse_header(_header(), step=2, layout=LAYOUT)
    assert caught.value.code == T.OTHER_STEP
    other = {"digest": "fedcba9876543210", "entries": [["param", "w", "float32", [8]]]}
    with pytest.raises(T.LayoutMismatch, match=r"entry 0 of 1 here and 1 in the sender.*\[8\].*\[4\]"):
        T.parse_header(_header(), step=1, layout=other)
    with pytest.raises(T.PayloadError, match="24 tensor bytes, over the 23") as caught:
        T.parse_header(_header(), step=1, layout=LAYOUT, max_bytes=23)
    assert caught.value.code == T.TOO_LARGE
    good = T.parse_header(_header(), step=1, layout=LAYOUT, max_bytes=24)
    assert good.specs == [T.Spec(torch.float32, (2, 3), 24, True)]


def test_fuzzed_headers_parse_or_raise_one_error():
    """Random byte edits of a valid header, and random edits of its JSON: each parses (then builds over tensors of
    its specs) or is one PayloadError."""
    rng = random.Random(44)
    tree = {"t": (torch.zeros(2, 3), [torch.tensor(1, dtype=torch.int8), None]), 3: {"f": -0.0, "b": True, "s": "x"},
            "shard": torch.ones(2, dtype=torch.bfloat16)}
    header, _ = T.encode(tree, step=5, layout=LAYOUT)
    parsed = json.loads(header)
    pieces = [None, True, 0, -1, 2 ** 70, 1.5, "", "x", [], {}, {"x": 0}, {"f": "0" * 16}, {"d": []}, [1, [2]]]
    outcomes = {"parsed": 0, "refused": 0}

    def attempt(raw: bytes) -> None:
        try:
            head = T.parse_header(raw, step=5, layout=LAYOUT)
        except T.PayloadError:
            outcomes["refused"] += 1
            return
        T.build(head, [torch.empty(s.shape, dtype=s.dtype) for s in head.specs])
        outcomes["parsed"] += 1

    for _ in range(1500):
        raw = bytearray(header)
        for _ in range(rng.randint(1, 4)):
            at = rng.randrange(len(raw))
            choice = rng.random()
            if choice < 0.4:
                raw[at] = rng.randrange(256)
            elif choice < 0.7:
                del raw[at:at + rng.randint(1, 40)]
            else:
                raw[at:at] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
        attempt(bytes(raw))
    for _ in range(1500):
        head = json.loads(header)
        containers, stack = [], [head]
        while stack:  # every non-empty dict and list of the header, to edit one of them
            node = stack.pop()
            if type(node) in (dict, list) and node:
                containers.append(node)
                stack.extend(node.values() if type(node) is dict else node)
        for _ in range(rng.randint(1, 3)):
            target = rng.choice(containers)
            at = rng.choice(list(target)) if type(target) is dict else rng.randrange(len(target))
            target[at] = rng.choice(pieces)
        attempt(json.dumps(head).encode())
    print(outcomes)
    assert outcomes["refused"] > 2000 and outcomes["parsed"] > 0 and head != parsed


def test_a_refused_header_fails_both_sides_before_any_tensor_byte_and_the_group_stays_usable():
    header, tensors = T.encode({"w": torch.ones(4)}, step=2, layout=LAYOUT)
    other = {"digest": "1", "entries": []}

    def sender(pg):
        errors = []
        for _ in range(2):
            try:
                T.send(pg, 1, header, tensors, timeout=TIMEOUT)
            except T.PayloadError as err:
                errors.append(err)
        return errors, T.send(pg, 1, header, tensors, timeout=TIMEOUT)

    def receiver(pg):
        errors = []
        for layout, step in ((other, 2), (LAYOUT, 3)):
            try:
                T.receive(pg, 0, step=step, layout=layout, timeout=TIMEOUT)
            except T.PayloadError as err:
                errors.append(err)
        return errors, T.receive(pg, 0, step=2, layout=LAYOUT, timeout=TIMEOUT)

    (sent_errors, _), (received_errors, (back, _)) = pair(sender, receiver)
    assert [type(e) for e in received_errors] == [T.LayoutMismatch, T.PayloadError]
    assert "for another layout" in str(sent_errors[0]) and "for another step" in str(sent_errors[1])
    assert torch.equal(back["w"], torch.ones(4))


def test_a_bad_length_or_a_bool_byte_is_refused_over_the_wire():
    """A sender that does not follow the encoder: a header length of 0, and a bool tensor holding a 2."""
    def bad_length(pg):
        pg.send([torch.tensor([0])], 1, 1).wait()
        verdict = torch.zeros(1, dtype=torch.int64)
        pg.recv([verdict], 1, 3).wait()
        return int(verdict)

    def receiver(pg):
        with pytest.raises(T.PayloadError, match="heal header of 0 bytes"):
            T.receive(pg, 0, step=0, layout=LAYOUT, timeout=TIMEOUT)

    verdict, refused = pair(bad_length, receiver)
    assert verdict == T.MALFORMED and refused is None
    header, tensors = T.encode({"b": torch.tensor([1, 2], dtype=torch.uint8), "after": torch.ones(100_000)}, step=0,
                               layout=LAYOUT)
    header = header.replace(b'["uint8",[2],2,true]', b'["bool",[2],2,true]')

    def receive_bool(pg):
        with pytest.raises(T.PayloadError, match="holds bytes other than 0 and 1"):
            T.receive(pg, 0, step=0, layout=LAYOUT, timeout=TIMEOUT)

    # The messages after the bad one are still received: the sender finishes instead of waiting for the timeout.
    assert pair(lambda pg: T.send(pg, 1, header, tensors, timeout=TIMEOUT), receive_bool) == [8 + len(header) + 400_002,
                                                                                              None]


def test_a_peer_that_dies_mid_payload_is_a_transfer_error():
    header, tensors = T.encode({"w": torch.ones(100_000)}, step=0, layout=LAYOUT)

    def dies_after_the_header(pg):
        pg.send([torch.tensor([len(header)])], 1, 1).wait()
        pg.send([torch.frombuffer(bytearray(header), dtype=torch.uint8)], 1, 2).wait()
        pg.recv([torch.zeros(1, dtype=torch.int64)], 1, 3).wait()
        del pg  # its sockets close: the receiver's pending recv fails at once

    def receiver(pg):
        with pytest.raises(T.TransferError, match="received message 0 of the heal payload from rank 0") as caught:
            T.receive(pg, 0, step=0, layout=LAYOUT, timeout=TIMEOUT)
        return str(caught.value)

    assert "HINT" in pair(dies_after_the_header, receiver)[1]


def test_heal_transport_speaks_torchfts_checkpoint_transport_methods():
    state = {"user": {"default": {"w": torch.arange(6.0)}}, "torchft": {"step": 9, "batches_committed": 18}}

    def sender(pg):
        transport = T.HealTransport(pg, layout=LAYOUT)
        assert transport.metadata() == T.FORMAT
        transport.send_checkpoint([1], 9, state, TIMEOUT)
        transport.disallow_checkpoint()
        transport.shutdown()
        return transport.bytes_sent

    def receiver(pg):
        transport = T.HealTransport(pg, layout=LAYOUT)
        with pytest.raises(T.PayloadError, match="'torchft-http'; this group reads 'lightning-fsdp-heal/1'"):
            transport.recv_checkpoint(0, "torchft-http", 9, TIMEOUT)
        return transport.recv_checkpoint(0, T.FORMAT, 9, TIMEOUT), transport.bytes_received

    sent, (back, received) = pair(sender, receiver)
    assert same(back, state) and sent == received > 48
