"""Requested plain entries whose data DCP holds are restored (the load skipped them, leaving the state as it was).

A sharded checkpoint keeps a front's sharded extras (the Trainer writes entries holding DTensors through DCP) and
every entry of another tool's ``dcp.save`` (torchtitan's ``{"model": ..., "train_state": ...}``) in DCP's files,
not in ``meta.pt``. A plain dict, list or tensor requested under such a key is read into its own tensors in place;
a pickled leaf is replaced by the saved value; a mismatch is an error naming the key, never a skip.

The Trainer writes every entry holding DTensors (a callback's state, ``on_save_checkpoint`` extras) through DCP and
requests only its models and optimizers: those entries are read whole (plain tensors, as a full checkpoint holds
them) and returned for Lightning to restore (``read_whole``); they were dropped, and every callback's state with them.

In this process with one rank (``OneProcess``), local and at a URL of the suite's S3 server; the two-rank cases (DTensor
leaves through ``fabric.load``, a Trainer's resume) run in the 2-rank pool (``workers/plain_entries.py``).
"""

from __future__ import annotations

import warnings

import pytest
import torch

from launch import case_tests

CASES = ["fabric_load_reads_a_plain_entry_held_by_dcp_into_its_dtensors_and_tensors_in_place",
         "trainer_resume_restores_a_callback_state_that_held_a_dtensor"]

results, test_two_ranks = case_tests("plain_entries.py", 2, CASES)


def _saved():
    torch.manual_seed(0)
    return {"model": {"a": torch.randn(4), "b": [torch.randn(2, 3), torch.randn(5)]},
            "extra": {"w": torch.randn(3).to(torch.bfloat16), "n": 4}}


def _zeros():
    return {"model": {"a": torch.zeros(4), "b": [torch.zeros(2, 3), torch.zeros(5)]},
            "extra": {"w": torch.zeros(3, dtype=torch.bfloat16), "n": 0}}


def _write(path, tensors, metadata, **options):
    from lightning_fsdp.checkpoint.io.one_process import OneProcess
    from lightning_fsdp.checkpoint.save import write_sharded

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP "assumes" one process: that is the intent here
        write_sharded(path, tensors, metadata, OneProcess(), **options)


def _load(path, state, **kwargs):
    from lightning_fsdp.checkpoint.io.one_process import OneProcess
    from lightning_fsdp.checkpoint.load import load_checkpoint

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_checkpoint(path, state, comm=OneProcess(), **kwargs)


def _assert_restored(state, saved):
    assert torch.equal(state["model"]["a"], saved["model"]["a"]), state
    assert all(torch.equal(x, y) for x, y in zip(state["model"]["b"], saved["model"]["b"])), state
    assert torch.equal(state["extra"]["w"], saved["extra"]["w"]) and state["extra"]["n"] == 4, state


@pytest.mark.single_process
@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_plain_entry_held_by_dcp_is_read_into_its_own_tensors(where, tmp_path, request):
    """Old code: the load returned {"step": 1} and left every tensor zero (and "n" 0), saying nothing."""
    options = {}
    path = tmp_path / "ck"
    if where == "s3":
        server = request.getfixturevalue("s3_server")
        path = f"s3://{server.bucket()}/plain/ck"
        options = {"storage_options": {"endpoint_url": server.endpoint, "key": "testing", "secret": "testing"}}
    saved = _saved()
    _write(path, saved, {"step": 1}, **options)
    state = _zeros()
    leaves = [state["model"]["a"], *state["model"]["b"], state["extra"]["w"]]
    assert _load(path, state, **options) == {"step": 1}
    _assert_restored(state, saved)
    # In place: the state's own tensors hold the values (a DTensor or a GPU tensor keeps its layout and device).
    assert [state["model"]["a"], *state["model"]["b"], state["extra"]["w"]] == leaves
    assert all(x is y for x, y in zip([state["model"]["a"], *state["model"]["b"], state["extra"]["w"]], leaves))


class _TrainState:
    def __init__(self):
        self.step, self.losses = 0, torch.zeros(3)

    def state_dict(self):
        return {"step": self.step, "losses": self.losses}

    def load_state_dict(self, state):
        self.step, self.losses = state["step"], state["losses"]


@pytest.mark.single_process
def test_another_tools_dcp_checkpoint_loads_into_plain_values_and_stateful_objects(tmp_path):
    """A plain ``dcp.save`` (no meta.pt, no checksums), as torchtitan writes one. Old code: nothing was restored."""
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(1)
    weights, losses = {"w": torch.randn(2, 2)}, torch.tensor([1.0, 2.0, 3.0])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": weights, "train_state": {"step": 7, "losses": losses}, "scale": torch.tensor(0.5)},
                 checkpoint_id=tmp_path / "titan", no_dist=True)
    state = {"model": {"w": torch.zeros(2, 2)}, "train_state": _TrainState(), "scale": torch.tensor(0.0)}
    assert _load(tmp_path / "titan", state) == {}
    assert torch.equal(state["model"]["w"], weights["w"]) and state["scale"].item() == 0.5
    assert state["train_state"].step == 7 and torch.equal(state["train_state"].losses, losses)


@pytest.mark.single_process
def test_a_plain_entry_that_cannot_be_read_in_place_is_a_clear_error(tmp_path):
    """Old code: each of these loads returned without an error, the state unrestored."""
    _write(tmp_path / "ck", _saved(), {})
    cases = [  # (what the state passes under "model", strict, what the error must say)
        ({"a": torch.zeros(5), "b": [torch.zeros(2, 3), torch.zeros(5)]}, False,
         r"tensor 'model\.a' of the entry 'model' has shape \[4\] in the checkpoint .* but \[5\] in the state.*HINT"),
        ({"a": torch.zeros(4, dtype=torch.float64), "b": [torch.zeros(2, 3), torch.zeros(5)]}, True,
         r"'model\.a' of the entry 'model' has dtype torch\.float32 in the checkpoint .* but torch\.float64.*HINT"),
        ({"a": 0, "b": [torch.zeros(2, 3), torch.zeros(5)]}, False,
         r"entry 'model' cannot be read into the state in place: .* holds a tensor of shape \[4\] and dtype"
         r" torch\.float32 at 'model\.a', and the state holds a value of type int, not a tensor there\. HINT"),
        (None, False, r"holds 3 leaves under 'model' \(e\.g\. 'model\.a': a tensor of shape \[4\].*\), and the"
                      r" state holds a value of type NoneType, not a tensor there\. HINT.*'model\.b\.1': \[5\]"
                      r" torch\.float32"),
        ({"a": {"x": torch.zeros(4)}, "b": [torch.zeros(2, 3), torch.zeros(5)]}, False,
         r"holds a tensor of shape \[4\] .* at 'model\.a', and the state holds a dict or list there"),
    ]
    for value, strict, message in cases:
        with pytest.raises(ValueError, match=message):
            _load(tmp_path / "ck", {"model": value}, strict=strict)
    with pytest.raises(ValueError, match=r"a pickled value, not a tensor at 'extra\.n', and the state holds a tensor"):
        _load(tmp_path / "ck", {"extra": {"w": torch.zeros(3, dtype=torch.bfloat16), "n": torch.zeros(1)}})


@pytest.mark.single_process
def test_strict_compares_the_leaves_and_strict_false_reads_those_both_have(tmp_path):
    """Old code: the strict loads returned without an error, and the lenient one left "a" zero."""
    saved = _saved()
    _write(tmp_path / "ck", saved, {})
    fewer = {"a": torch.zeros(4)}
    with pytest.raises(KeyError, match=r"entry 'model' and the checkpoint .* do not have the same keys \(in the"
                                       r" checkpoint but not in the entry: 2 \('model\.b\.0', 'model\.b\.1'\)\)"):
        _load(tmp_path / "ck", {"model": fewer})
    more = {"a": torch.zeros(4), "c": torch.zeros(1)}
    with pytest.raises(KeyError, match=r"missing from the checkpoint: 1 \('model\.c'\).*HINT: pass `strict=False`"):
        _load(tmp_path / "ck", {"model": more})
    assert _load(tmp_path / "ck", {"model": more}, strict=False) == {}
    assert torch.equal(more["a"], saved["model"]["a"]) and torch.equal(more["c"], torch.zeros(1))


@pytest.mark.single_process
def test_unrequested_entries_the_caller_names_are_read_whole_and_returned(tmp_path):
    """The Trainer's `read_whole`: nested dicts and lists of tensors and values, rebuilt from DCP's metadata (a key
    holding a dot included); the entries it declines (an optimizer's state) are not read. Old code: no `read_whole`."""
    torch.manual_seed(2)
    callbacks = {"Avg{'decay': 0.5}": {"copy": torch.randn(3, 2), "steps": 2, "hist": [torch.randn(1), {"n": 1}]}}
    tensors = {"model": {"a": torch.randn(4)}, "callbacks": callbacks, "optimizer_0": {"x": torch.ones(2)}}
    _write(tmp_path / "ck", tensors, {"epoch": 1})
    state = {"model": {"a": torch.zeros(4)}}
    rest = _load(tmp_path / "ck", state, read_whole=lambda key: key != "optimizer_0")
    assert sorted(rest) == ["callbacks", "epoch"] and rest["epoch"] == 1, rest
    got, saved = rest["callbacks"]["Avg{'decay': 0.5}"], callbacks["Avg{'decay': 0.5}"]
    assert torch.equal(got["copy"], saved["copy"]) and got["steps"] == 2 and got["hist"][1] == {"n": 1}, got
    assert torch.equal(got["hist"][0], saved["hist"][0]) and list(got) == ["copy", "steps", "hist"], got
    assert _load(tmp_path / "ck", {"model": {"a": torch.zeros(4)}}) == {"epoch": 1}  # without it: nothing more read


@pytest.mark.single_process
def test_a_crafted_metadata_path_is_refused_before_anything_is_allocated():
    """`read_whole` rebuilds an entry from `.metadata`'s planner_data: a list index far beyond the entries (which
    would allocate a list of that length), a path that is not its flat name's, or a container another path contradicts
    is a clear error. Old code: there was no such reading."""
    from types import SimpleNamespace

    from lightning_fsdp.checkpoint.fit import saved_template

    chunk = SimpleNamespace(offsets=torch.Size([0]), sizes=torch.Size([2]))
    tensor = SimpleNamespace(size=torch.Size([2]), properties=SimpleNamespace(dtype=torch.float32), chunks=[chunk])
    pickled = object()
    entries = {"cb.a": tensor, "cb.l.0": tensor, "cb.l.1": pickled}
    paths = {"cb.a": ("cb", "a"), "cb.l.0": ("cb", "l", 0), "cb.l.1": ("cb", "l", 1)}
    built = saved_template(entries, paths, "cb")
    assert list(built) == ["a", "l"] and built["l"][0].shape == (2,) and built["l"][1] is None
    for crafted in [("cb", "l", 10**12), ("cb", "x", 0), ("cb", "a", 0)]:
        with pytest.raises(ValueError, match=r"places 'cb\.l\.0' at .* does not fit .*HINT"):
            saved_template(entries, {**paths, "cb.l.0": crafted}, "cb")
    # Review (2026-11-28): a leaf listed after a container at its own path replaced that container silently (the
    # other order was refused), and a tensor's chunks were never checked against its shape: `torch.empty` of any
    # claimed shape, handed to the callback with uninitialised bytes where no chunk was read.
    with pytest.raises(ValueError, match=r"places 'cb\.b' at .* does not fit"):
        saved_template({"cb.b.c": tensor, "cb.b": tensor}, {"cb.b.c": ("cb", "b", "c"), "cb.b": ("cb", "b")}, "cb")
    half = SimpleNamespace(size=torch.Size([4]), properties=tensor.properties, chunks=[chunk])
    huge = SimpleNamespace(size=torch.Size([2**20, 2**20]), properties=tensor.properties, chunks=[chunk])
    for meta in (half, huge):
        with pytest.raises(ValueError, match=r"'cb\.a' the shape .* chunks that do not cover it exactly.*HINT"):
            saved_template({"cb.a": meta}, {"cb.a": ("cb", "a")}, "cb")
    assert torch.equal(built["a"], torch.zeros(2))  # zeroed, never uninitialised memory
