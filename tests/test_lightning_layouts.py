"""Unit tests for the pure key mapping onto Lightning's checkpoint layouts (``checkpoint/formats/lightning_layouts.py``)."""

import pytest
import torch
from torch import nn

from lightning_fsdp.checkpoint.formats.lightning_layouts import (
    checkpoint_keys_used,
    fqn_keyed_optimizer_state,
    read_entry,
    remap_requested_keys,
)

# The top-level keys of each layout Lightning 2.6.6 writes (see the module docstring for the source lines).
TRAINER_FULL = {"epoch", "global_step", "pytorch-lightning_version", "state_dict", "loops", "callbacks",
                "optimizer_states", "lr_schedulers"}
TRAINER_MODEL_PARALLEL_SHARDED = {"state_dict", "optimizer_0", "epoch", "global_step", "loops"}
TRAINER_FSDP_SHARDED = {"model", "optimizer_0", "epoch", "global_step", "loops"}
FABRIC = {"model", "optimizer", "step"}


@pytest.mark.parametrize(
    "available, models, optimizers, kwargs, expected",
    [
        (TRAINER_FULL, ["model"], ["optimizer"], {}, {"model": "state_dict", "optimizer": "optimizer_states/0"}),
        (TRAINER_FULL, ["model"], ["optimizer"], {"num_optimizer_states": 1},
         {"model": "state_dict", "optimizer": "optimizer_states/0"}),
        (TRAINER_FULL, ["model"], ["g", "d"], {"num_optimizer_states": 2},
         {"model": "state_dict", "g": "optimizer_states/0", "d": "optimizer_states/1"}),
        (TRAINER_MODEL_PARALLEL_SHARDED, ["model"], ["optimizer"], {},
         {"model": "state_dict", "optimizer": "optimizer_0"}),
        (TRAINER_FSDP_SHARDED, ["model"], ["optimizer"], {}, {"optimizer": "optimizer_0"}),  # "model" is there
        (TRAINER_MODEL_PARALLEL_SHARDED | {"optimizer_1"}, ["m"], ["a", "b"], {},
         {"m": "state_dict", "a": "optimizer_0", "b": "optimizer_1"}),
        # Nothing to do for the layouts that keep the user's keys, ours and Fabric's.
        (FABRIC, ["model"], ["optimizer"], {}, {}),
        # The requested key is present: never redirected, even if the Trainer's key is there too.
        (FABRIC | {"state_dict"}, ["model"], [], {}, {}),
        (TRAINER_FULL, ["model"], [], {}, {"model": "state_dict"}),
        (TRAINER_FULL, [], ["optimizer"], {}, {"optimizer": "optimizer_states/0"}),
    ],
)
def test_remap_requested_keys(available, models, optimizers, kwargs, expected):
    assert remap_requested_keys(available, models, optimizers, **kwargs) == expected


@pytest.mark.parametrize(
    "available, models, optimizers, kwargs",
    [
        # Two models cannot both be the one LightningModule.
        (TRAINER_FULL, ["model", "ema"], [], {}),
        # Uneven optimizer counts: a positional match could load the wrong optimizer's state.
        (TRAINER_FULL, [], ["optimizer"], {"num_optimizer_states": 2}),
        (TRAINER_FULL, [], ["a", "b"], {"num_optimizer_states": 1}),
        (TRAINER_MODEL_PARALLEL_SHARDED | {"optimizer_1"}, [], ["optimizer"], {}),
        (TRAINER_MODEL_PARALLEL_SHARDED, [], ["a", "b"], {}),
        # Gaps in the Trainer's optimizer numbering.
        ({"state_dict", "optimizer_1"}, [], ["optimizer"], {}),
        # One requested optimizer key is present: the checkpoint is not in the Trainer's layout for optimizers.
        ({"state_dict", "optimizer_0", "a"}, [], ["a", "b"], {}),
        # No Trainer entries at all.
        ({"weights"}, ["model"], ["optimizer"], {}),
    ],
)
def test_remap_requested_keys_leaves_ambiguous_keys_alone(available, models, optimizers, kwargs):
    assert remap_requested_keys(available, models, optimizers, **kwargs) == {}


def test_read_entry_resolves_top_level_keys_and_list_entries():
    contents = {"state_dict": {"w": 1}, "optimizer_states": [{"a": 0}, {"b": 1}], "x/1": "literal"}
    assert read_entry(contents, "state_dict") == {"w": 1}
    assert read_entry(contents, "optimizer_states/1") == {"b": 1}
    assert read_entry(contents, "x/1") == "literal"  # a real key wins over the list form
    for missing in ("optimizer_states/2", "nothing", "state_dict/0", "optimizer_states/-1"):
        with pytest.raises(KeyError, match="no entry"):
            read_entry(contents, missing)


def test_checkpoint_keys_used():
    mapping = {"model": "state_dict", "a": "optimizer_states/0", "b": "optimizer_states/1"}
    assert checkpoint_keys_used(mapping) == {"state_dict", "optimizer_states"}
    assert checkpoint_keys_used({"optimizer": "optimizer_0"}) == {"optimizer_0"}
    assert checkpoint_keys_used({}) == set()


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(3, 2)
        self.b = nn.Linear(2, 1)


def _stepped(net, param_groups):
    opt = torch.optim.Adam(param_groups, lr=0.1)
    net.b(net.a(torch.ones(1, 3))).sum().backward()
    opt.step()
    return opt


def test_fqn_keyed_optimizer_state_of_a_plain_optimizer():
    torch.manual_seed(0)
    net = _Net()
    named = dict(net.named_parameters())
    # Two groups, the second in reverse model order: the ids are positions in the optimizer, not in the model.
    groups = [["b.weight", "a.weight"], ["b.bias", "a.bias"]]
    opt = _stepped(net, [{"params": [named[n] for n in g]} for g in groups])
    osd = opt.state_dict()
    assert list(osd["state"]) == [0, 1, 2, 3]
    converted = fqn_keyed_optimizer_state(osd, [n for g in groups for n in g])
    assert [g["params"] for g in converted["param_groups"]] == groups
    for i, name in enumerate(n for g in groups for n in g):
        assert converted["state"][name] is osd["state"][i]
    assert converted["param_groups"][0]["lr"] == 0.1
    assert list(osd["state"]) == [0, 1, 2, 3], "the input was modified"


def test_fqn_keyed_optimizer_state_of_lightnings_rekeyed_full_state():
    # FSDP.rekey_optim_state_dict(..., PARAM_ID, model) (Lightning's full Trainer checkpoints) numbers parameters by
    # their index in model.parameters() and sorts each group: [a.weight, a.bias, b.weight, b.bias] -> 0, 1, 2, 3.
    osd = {
        "state": {0: {"m": "aw"}, 1: {"m": "ab"}, 2: {"m": "bw"}, 3: {"m": "bb"}},
        "param_groups": [{"params": [0, 2], "lr": 1.0}, {"params": [1, 3], "lr": 0.0}],
    }
    converted = fqn_keyed_optimizer_state(osd, ["a.weight", "b.weight", "a.bias", "b.bias"])
    assert converted["state"] == {"a.weight": {"m": "aw"}, "b.weight": {"m": "bw"}, "a.bias": {"m": "ab"},
                                  "b.bias": {"m": "bb"}}
    assert converted["param_groups"] == [{"params": ["a.weight", "b.weight"], "lr": 1.0},
                                         {"params": ["a.bias", "b.bias"], "lr": 0.0}]


def test_fqn_keyed_optimizer_state_inverts_torchs_rekey_to_param_ids():
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import OptimStateKeyType

    torch.manual_seed(0)
    net = _Net()
    named = dict(net.named_parameters())
    groups = [["a.weight", "b.weight"], ["a.bias", "b.bias"]]  # decay / no-decay split, each in model order
    opt = _stepped(net, [{"params": [named[n] for n in g]} for g in groups])
    by_name = {"state": {}, "param_groups": []}
    flat = [n for g in groups for n in g]
    for i, name in enumerate(flat):
        by_name["state"][name] = opt.state_dict()["state"][i]
    by_name["param_groups"] = [{**g, "params": list(names)} for g, names in zip(opt.state_dict()["param_groups"], groups)]
    # What Lightning's `optimizer_state` does for full checkpoints (pytorch/strategies/fsdp.py l. 539).
    by_id = FSDP.rekey_optim_state_dict(by_name, OptimStateKeyType.PARAM_ID, net)
    assert [g["params"] for g in by_id["param_groups"]] == [[0, 2], [1, 3]]  # model.parameters() indices
    assert fqn_keyed_optimizer_state(by_id, flat) == by_name


def test_fqn_keyed_optimizer_state_converts_params_without_state():
    osd = {"state": {}, "param_groups": [{"params": [0, 1], "lr": 0.5}]}
    assert fqn_keyed_optimizer_state(osd, ["x", "y"])["param_groups"] == [{"params": ["x", "y"], "lr": 0.5}]
    # Only some parameters have state (e.g. a frozen one never stepped).
    osd = {"state": {1: {"m": 1}}, "param_groups": [{"params": [0, 1]}]}
    assert fqn_keyed_optimizer_state(osd, ["x", "y"])["state"] == {"y": {"m": 1}}


def test_fqn_keyed_optimizer_state_returns_named_state_unchanged():
    osd = {"state": {"a.weight": {"m": 1}}, "param_groups": [{"params": ["a.weight"], "lr": 1}]}
    assert fqn_keyed_optimizer_state(osd, ["something.else"]) is osd
    empty = {"state": {}, "param_groups": []}
    assert fqn_keyed_optimizer_state(empty, []) is empty


@pytest.mark.parametrize(
    "osd, fqns, match",
    [
        ({"state": {0: {}}, "param_groups": [{"params": ["a"]}]}, ["a"], "mixes parameter names and integer ids"),
        ({"state": {}, "param_groups": [{"params": [0, 1]}]}, ["a"], "lists 2 parameters .* has 1"),
        ({"state": {}, "param_groups": [{"params": [0]}, {"params": [0]}]}, ["a", "b"], r"\(1 distinct\)"),
        ({"state": {5: {}}, "param_groups": [{"params": [0]}]}, ["a"], r"ids \[5\] that no param group lists"),
        ({"state": {True: {}}, "param_groups": [{"params": [True]}]}, ["a"], "mixes"),
    ],
)
def test_fqn_keyed_optimizer_state_refuses_inconsistent_input(osd, fqns, match):
    with pytest.raises(ValueError, match=match):
        fqn_keyed_optimizer_state(osd, fqns)
