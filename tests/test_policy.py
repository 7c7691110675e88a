"""The policy language on plain (unsharded) models: which modules each form of policy selects."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn
from torch.distributed.fsdp.wrap import ModuleWrapPolicy, size_based_auto_wrap_policy

from lightning_fsdp.engine.policy import (
    Policy,
    candidate_block_classes,
    describe_units,
    detect_repeated_blocks,
    parse_policy,
)

# --- models ---------------------------------------------------------------------------------------------------
#
# GPT(dim=8, vocab=16, layers=3), parameter counts (numel):
#   embed       Embedding(16, 8)            128
#   blocks.i    Block                       568 = ln 16 + mlp 552
#     .ln       LayerNorm(8)                 16
#     .mlp      Sequential                  552 = 288 + 0 + 264
#       .0      Linear(8, 32)               288
#       .1      GELU                          0
#       .2      Linear(32, 8)               264
#   ln_f        LayerNorm(8)                 16
#   head        Linear(8, 16)               144
#   total                                  1992


class Block(nn.Module):
    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.ln(x))


class GPT(nn.Module):
    def __init__(self, vocab: int = 16, dim: int = 8, layers: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


class Flat(nn.Module):
    """No container holds two modules of one class: nothing repeats."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(8, 2)
        self.extra = nn.ModuleList([nn.Linear(2, 2), nn.LayerNorm(2), nn.ReLU(), nn.ReLU()])


class SubBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.subs = nn.ModuleList(SubBlock() for _ in range(2))
        self.norm = nn.LayerNorm(4)


class Nested(nn.Module):
    """Repeated `Layer`s, each holding repeated `SubBlock`s, next to an encoder/decoder pair of other repeats."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Layer() for _ in range(2))
        self.decoder = nn.Sequential(Block(4), Block(4), Block(4))
        self.out = nn.Linear(4, 4)


def names_of(root: nn.Module, modules: list[nn.Module]) -> list[str]:
    name = {id(m): n for n, m in root.named_modules()}
    return [name[id(m)] for m in modules]


def select(value, root: nn.Module, **kwargs) -> list[str]:
    policy = parse_policy(value, "auto_wrap_policy")
    assert isinstance(policy, Policy)
    return names_of(root, policy.select(root, **kwargs))


BLOCKS = ["blocks.0", "blocks.1", "blocks.2"]
MLPS = ["blocks.0.mlp", "blocks.1.mlp", "blocks.2.mlp"]
MLP_LINEARS = [f"blocks.{i}.mlp.{j}" for i in range(3) for j in (0, 2)]
ALL_LINEARS = MLP_LINEARS + ["head"]


@pytest.fixture
def gpt() -> GPT:
    torch.manual_seed(0)
    return GPT()


def test_parameter_counts_in_comment_are_right(gpt):
    numel = {n: sum(p.numel() for p in m.parameters()) for n, m in gpt.named_modules()}
    assert numel[""] == 1992
    assert numel["embed"] == 128 and numel["head"] == 144 and numel["ln_f"] == 16
    assert numel["blocks.0"] == 568 and numel["blocks.0.ln"] == 16 and numel["blocks.0.mlp"] == 552
    assert numel["blocks.0.mlp.0"] == 288 and numel["blocks.0.mlp.2"] == 264


# --- set of classes and dotted names -------------------------------------------------------------------------


def test_set_of_classes(gpt):
    assert select({Block}, gpt) == BLOCKS
    # A list, a tuple, a frozenset and a bare class all mean the same.
    assert select([Block], gpt) == BLOCKS
    assert select((Block,), gpt) == BLOCKS
    assert select(frozenset({Block}), gpt) == BLOCKS
    assert select(Block, gpt) == BLOCKS


def test_several_classes_in_module_order(gpt):
    # Parents before children, in `named_modules()` order, whatever the order in the policy.
    assert select([nn.Linear, Block], gpt) == [
        "blocks.0", "blocks.0.mlp.0", "blocks.0.mlp.2",
        "blocks.1", "blocks.1.mlp.0", "blocks.1.mlp.2",
        "blocks.2", "blocks.2.mlp.0", "blocks.2.mlp.2",
        "head",
    ]
    assert select({nn.LayerNorm, nn.Embedding}, gpt) == ["embed", "blocks.0.ln", "blocks.1.ln", "blocks.2.ln", "ln_f"]


def test_subclasses_match(gpt):
    # `isinstance`, like FSDP1's ModuleWrapPolicy: a subclass of a named class is selected too.
    class BigBlock(Block):
        pass

    gpt.blocks.append(BigBlock())
    assert select({Block}, gpt) == BLOCKS + ["blocks.3"]
    assert select({BigBlock}, gpt) == ["blocks.3"]


def test_dotted_names_of_test_classes(gpt):
    # The test module is importable under its own name, so its classes can be named like a YAML file would.
    assert Block.__module__ == __name__
    assert select([f"{__name__}.Block"], gpt) == BLOCKS
    assert select(f"{__name__}.Block", gpt) == BLOCKS
    assert select([f"{__name__}.Block", "torch.nn.Embedding"], gpt) == ["embed"] + BLOCKS
    # A class and its dotted name are one entry.
    assert parse_policy([Block, f"{__name__}.Block"], "auto_wrap_policy").classes == (Block,)


def test_dotted_names_of_torch_classes():
    layer = nn.TransformerEncoderLayer(d_model=8, nhead=2, dim_feedforward=16, batch_first=True)
    encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
    assert select("torch.nn.TransformerEncoderLayer", encoder) == ["layers.0", "layers.1"]
    assert select(["torch.nn.TransformerEncoderLayer"], encoder) == ["layers.0", "layers.1"]
    assert select(["torch.nn.LayerNorm"], encoder) == [
        "layers.0.norm1", "layers.0.norm2", "layers.1.norm1", "layers.1.norm2",
    ]
    # "auto" finds the same blocks on torch's own encoder.
    assert select("auto", encoder) == ["layers.0", "layers.1"]


def test_policy_fields_per_form():
    assert parse_policy(None, "auto_wrap_policy") is None
    assert parse_policy("auto", "auto_wrap_policy") == Policy("auto_wrap_policy", auto=True)
    assert parse_policy({Block}, "x") == Policy("x", classes=(Block,))
    pred = lambda m: True  # noqa: E731
    assert parse_policy(pred, "x") == Policy("x", predicate=pred)
    legacy = ModuleWrapPolicy({Block})
    assert parse_policy(legacy, "x") == Policy("x", legacy=legacy)
    sized = functools.partial(size_based_auto_wrap_policy, min_num_params=10)
    assert parse_policy(sized, "x") == Policy("x", legacy=sized)


# --- callables ------------------------------------------------------------------------------------------------


def test_predicate(gpt):
    assert select(lambda m: isinstance(m, Block), gpt) == BLOCKS
    assert select(lambda m: isinstance(m, nn.Linear) and m.out_features == 8, gpt) == [
        "blocks.0.mlp.2", "blocks.1.mlp.2", "blocks.2.mlp.2",
    ]
    assert select(lambda m: False, gpt) == []


def test_predicate_with_default_extra_argument_is_not_legacy(gpt):
    def predicate(module, prefix=None):
        return isinstance(module, nn.Sequential)

    policy = parse_policy(predicate, "auto_wrap_policy")
    assert policy.predicate is predicate and policy.legacy is None
    assert names_of(gpt, policy.select(gpt)) == MLPS


def test_legacy_callable(gpt):
    calls = []

    def legacy(module, recurse, nonwrapped_numel):
        calls.append((type(module), recurse, nonwrapped_numel))
        return recurse or isinstance(module, Block)

    policy = parse_policy(legacy, "auto_wrap_policy")
    assert policy.legacy is legacy and policy.predicate is None
    assert names_of(gpt, policy.select(gpt)) == BLOCKS
    # A chosen block no longer counts towards its parents: the root is left with embed + ln_f + head.
    decisions = [(cls, n) for cls, recurse, n in calls if not recurse]
    assert (Block, 568) in decisions
    assert (nn.ModuleList, 0) in decisions
    assert (GPT, 128 + 16 + 144) in decisions


def test_legacy_callable_by_keyword_name(gpt):
    def legacy(module, recurse, nonwrapped_numel, **kwargs):
        return recurse or nonwrapped_numel >= 552 and isinstance(module, nn.Sequential)

    assert select(legacy, gpt) == MLPS


def test_module_wrap_policy(gpt):
    assert select(ModuleWrapPolicy({Block}), gpt) == BLOCKS
    assert select(ModuleWrapPolicy({nn.Linear}), gpt) == ALL_LINEARS
    assert select(ModuleWrapPolicy({nn.Linear, Block}), gpt) == [
        "blocks.0", "blocks.0.mlp.0", "blocks.0.mlp.2",
        "blocks.1", "blocks.1.mlp.0", "blocks.1.mlp.2",
        "blocks.2", "blocks.2.mlp.0", "blocks.2.mlp.2",
        "head",
    ]


@pytest.mark.parametrize(
    ("min_num_params", "expected", "root_chosen"),
    [
        # Every Linear of the MLPs (288, 264), the embedding (128) and the head (144) reach 100 on their own; the
        # root keeps only ln_f (16).
        (100, ["embed"] + MLP_LINEARS + ["head"], False),
        # 250: only the MLP Linears; the root keeps 128 + 3 * 16 + 16 + 144 = 336.
        (250, MLP_LINEARS, True),
        # 289 > 288: no Linear alone; each MLP (552) is chosen, its Block keeps only the norm (16). Root: 336.
        (289, MLPS, True),
        # 553 > 552: no MLP; each whole Block (568) is chosen. The root keeps 128 + 16 + 144 = 288.
        (553, BLOCKS, False),
        # 569: nothing below the root. The ModuleList (1704) is large but never wrapped (EXCLUDE_WRAP_MODULES).
        (569, [], True),
        (1000, [], True),
        # Nothing at all, not even the root (1992).
        (1993, [], False),
    ],
)
def test_size_based_policy(gpt, min_num_params, expected, root_chosen):
    policy = functools.partial(size_based_auto_wrap_policy, min_num_params=min_num_params)
    assert select(policy, gpt) == expected
    # The root is decided like any module (FSDP1 would wrap its remainder) but only returned on request.
    assert select(policy, gpt, include_root=True) == ([""] if root_chosen else []) + expected


def test_size_based_policy_keeps_force_leaf_modules_whole():
    """torch's size-based policy keeps `nn.MultiheadAttention` a leaf: "their children will never be wrapped".

    MultiheadAttention's forward reads `out_proj.weight` directly instead of calling `out_proj`, so an FSDP unit on
    `out_proj` would never be unsharded before use (with FSDP2: "got mixed torch.Tensor and DTensor").
    """

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = nn.MultiheadAttention(16, 2)  # 1088 = in_proj 768 + 48, out_proj 272
            self.fc = nn.Linear(16, 16)  # 272

    model = Attention()
    policy = functools.partial(size_based_auto_wrap_policy, min_num_params=200)
    chosen = select(policy, model)
    assert "fc" in chosen
    assert [n for n in chosen if n.startswith("attn.")] == [], chosen


# --- "auto" and repeated-block detection ----------------------------------------------------------------------


def test_auto_picks_repeated_blocks_not_inner_linears(gpt):
    assert detect_repeated_blocks(gpt) == [Block]
    chosen = select("auto", gpt)
    assert chosen == BLOCKS
    assert not any(n.endswith(("mlp.0", "mlp.2")) for n in chosen)


def test_auto_on_model_without_repeats():
    model = Flat()
    assert detect_repeated_blocks(model) == []
    assert select("auto", model) == []


def test_auto_ignores_parameterless_repeats_and_single_blocks():
    model = nn.Module()
    model.body = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Dropout(), nn.ReLU())
    model.one = nn.ModuleList([SubBlock()])
    assert detect_repeated_blocks(model) == []
    assert select("auto", model) == []


def test_auto_on_root_sequential_of_linears():
    model = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 2))
    assert detect_repeated_blocks(model) == [nn.Linear]
    assert select("auto", model) == ["0", "2"]


def test_auto_on_nested_repeats():
    model = Nested()
    # SubBlock repeats inside each Layer, Linear inside each Block's MLP: both nest inside an outer repeat.
    assert detect_repeated_blocks(model) == [Layer, Block]
    assert select("auto", model) == ["layers.0", "layers.1", "decoder.0", "decoder.1", "decoder.2"]


def test_auto_when_gpt_has_a_single_block():
    # One Block does not repeat; the two Linears of its MLP do, so they are what "auto" picks.
    model = GPT(layers=1)
    assert detect_repeated_blocks(model) == [nn.Linear]
    assert select("auto", model) == ["blocks.0.mlp.0", "blocks.0.mlp.2", "head"]


# --- the root -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value",
    [
        {GPT},
        f"{__name__}.GPT",
        lambda m: isinstance(m, GPT),
        ModuleWrapPolicy({GPT}),
        functools.partial(size_based_auto_wrap_policy, min_num_params=1000),
    ],
    ids=["class", "dotted", "predicate", "module-wrap-policy", "size-based"],
)
def test_root_is_never_selected(gpt, value):
    assert select(value, gpt) == []
    assert select(value, gpt, include_root=True) == [""]


def test_everything_but_the_root(gpt):
    everything = [n for n, _ in gpt.named_modules()]
    assert select(lambda m: True, gpt) == everything[1:]
    assert select(lambda m: True, gpt, include_root=True) == everything


def test_select_returns_the_module_objects(gpt):
    chosen = parse_policy({Block}, "auto_wrap_policy").select(gpt)
    assert len(chosen) == 3
    assert all(a is b for a, b in zip(chosen, gpt.blocks))


# --- descriptions -----------------------------------------------------------------------------------------------


def test_candidate_block_classes(gpt):
    prefix = __name__
    # Most frequent first; ties keep `modules()` order. Parameter-free modules (GELU) and the root are left out.
    assert candidate_block_classes(gpt) == [
        "torch.nn.modules.linear.Linear (x7)",
        "torch.nn.modules.normalization.LayerNorm (x4)",
        f"{prefix}.Block (x3)",
        "torch.nn.modules.container.Sequential (x3)",
        "torch.nn.modules.sparse.Embedding (x1)",
        "torch.nn.modules.container.ModuleList (x1)",
    ]
    assert candidate_block_classes(gpt, limit=2) == [
        "torch.nn.modules.linear.Linear (x7)",
        "torch.nn.modules.normalization.LayerNorm (x4)",
    ]
    assert candidate_block_classes(nn.Linear(2, 2)) == []


def test_describe_units(gpt):
    assert describe_units(parse_policy("auto", "auto_wrap_policy").select(gpt)) == "3 x Block + root"
    assert describe_units([]) == "root"
    mixed = parse_policy([Block, nn.Embedding], "auto_wrap_policy").select(gpt)
    assert describe_units(mixed) == "1 x Embedding + 3 x Block + root"
    assert describe_units(parse_policy(nn.Linear, "auto_wrap_policy").select(gpt)) == "7 x Linear + root"
