"""Four-rank cases: full state dicts into a model set up with hybrid sharding, a (replicate=2, shard=2) mesh whose
parameters have placements (Replicate, Shard(0)) (issue 19, part 1). Every replica must get the same shards, cut as
FSDP2 cuts them, through ``load_state_dict`` and through ``load_raw`` of a full file with a key-renaming module."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from common import full, make_fabric, shared_tmpdir
from harness import case, run_cases
from models import Odd, Remapped

FABRIC = []


def fabric():
    if not FABRIC:
        FABRIC.append(make_fabric(4, sharding_strategy="HYBRID_SHARD", device_mesh=(2, 2)))
    return FABRIC[0]


def built(factory, seed: int = 0):
    torch.manual_seed(seed)
    return factory()


def assert_equal_to(model: nn.Module, reference: nn.Module) -> int:
    got = {k: full(v) for k, v in model.state_dict().items()}
    for key, value in reference.state_dict().items():
        assert torch.equal(got[key], value), f"{key}: differs from the unsharded reference"
    return len(got)


@case
def hybrid_load_state_dict_of_a_full_dict():
    model = fabric().setup(built(Odd))
    placements = {n: p.placements for n, p in model.module.named_parameters()}
    assert set(placements.values()) == {(Replicate(), Shard(0))}, placements
    reference, values = built(Odd), built(Odd, seed=1).state_dict()
    reference.load_state_dict(values)
    model.load_state_dict(values)
    assert all(isinstance(p, DTensor) for p in model.parameters())
    return assert_equal_to(model, reference)


@case
def hybrid_load_raw_through_a_renaming_module():
    f = fabric()
    model = f.setup(built(Remapped))
    base = built(lambda: nn.Linear(4, 4), seed=1).state_dict()
    path = shared_tmpdir(f) / "base.pth"
    if f.global_rank == 0:
        torch.save(base, path)
    f.barrier()
    reference = built(Remapped)
    reference.load_state_dict(base, strict=False)
    f.load_raw(path, model, strict=False)
    return assert_equal_to(model, reference)


if __name__ == "__main__":
    run_cases()
