"""Four-rank cases for hybrid sharding on a (replicate=2, shard=2) mesh, and NO_SHARD on four ranks.

Run twice by the tests: once as one 4-process launch with an explicit mesh, and once as two simulated nodes of
two processes each (two ``torchrun --nnodes=2`` launches), where the default mesh must come from the cluster
environment (``LFSDP_NUM_NODES=2``).
"""

from __future__ import annotations

import os
from contextlib import contextmanager

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from common import accumulate_three_micro_batches, compare, fsdp_run, full, make_fabric, reference_run, sgd
from harness import case, run_cases
from models import TinyTransformer

WORLD = 4
STEPS = 5
NUM_NODES = int(os.environ.get("LFSDP_NUM_NODES", "1"))
DEVICES = WORLD // NUM_NODES
# On one node the (2, 2) mesh is given explicitly; on two simulated nodes it must be the default.
MESH = {} if NUM_NODES == 2 else {"device_mesh": (2, 2)}


def _fabric(**kwargs):
    return make_fabric(DEVICES, num_nodes=NUM_NODES, **kwargs)


@case
def hybrid_mesh_shape_and_placements():
    fabric = _fabric(sharding_strategy="HYBRID_SHARD", **MESH)
    mesh = fabric.strategy.device_mesh
    assert tuple(mesh.shape) == (2, 2) and mesh.mesh_dim_names == ("replicate", "shard"), (mesh.shape, mesh)
    torch.manual_seed(0)
    model = fabric.setup_module(TinyTransformer())
    weight = model.module.head.weight
    assert isinstance(weight, DTensor) and weight.placements == (Replicate(), Shard(0)), weight.placements
    assert weight.to_local().shape[0] == weight.shape[0] // 2
    return {"mesh": list(mesh.shape), "local_rows": weight.to_local().shape[0]}


@case
def parity_hybrid_shard():
    fabric = _fabric(sharding_strategy="HYBRID_SHARD", **MESH)
    model, losses, _ = fsdp_run(fabric, STEPS)
    reference, ref_losses, _ = reference_run(STEPS, WORLD, sgd)
    return compare(model, reference, losses, ref_losses, 1e-5)


@case
def parity_hybrid_shard_zero2():
    fabric = _fabric(sharding_strategy="_HYBRID_SHARD_ZERO2", **MESH)
    model, losses, _ = fsdp_run(fabric, STEPS)
    reference, ref_losses, _ = reference_run(STEPS, WORLD, sgd)
    return compare(model, reference, losses, ref_losses, 1e-5)


@case
def parity_no_shard_four_ranks():
    fabric = _fabric(sharding_strategy="NO_SHARD")
    assert tuple(fabric.strategy.device_mesh.shape) == (4, 1)
    model, losses, _ = fsdp_run(fabric, STEPS)
    reference, ref_losses, _ = reference_run(STEPS, WORLD, sgd)
    return compare(model, reference, losses, ref_losses, 1e-5)


class _Collectives:
    """Whether each backward ran a reduce-scatter, and an all-reduce across the replicas (the two halves of a
    hybrid gradient reduction), counted by patching torch.distributed's functions for the backward's duration."""

    def __init__(self, fabric) -> None:
        self.replicate = fabric.strategy.device_mesh.get_group("replicate")
        self.per_backward: list[tuple[bool, bool]] = []

    @contextmanager
    def __call__(self):
        import torch.distributed as dist

        counts = {"reduce_scatter": 0, "all_reduce": 0}
        reduce_scatter, all_reduce = dist.reduce_scatter_single, dist.all_reduce

        def counted_reduce_scatter(*args, **kwargs):
            counts["reduce_scatter"] += 1
            return reduce_scatter(*args, **kwargs)

        def counted_all_reduce(tensor, *args, **kwargs):
            counts["all_reduce"] += kwargs.get("group") is self.replicate
            return all_reduce(tensor, *args, **kwargs)

        dist.reduce_scatter_single, dist.all_reduce = counted_reduce_scatter, counted_all_reduce
        try:
            yield
        finally:
            dist.reduce_scatter_single, dist.all_reduce = reduce_scatter, all_reduce
        self.per_backward.append((counts["reduce_scatter"] > 0, counts["all_reduce"] > 0))


@case
def hybrid_accumulation_in_both_no_sync_modes():
    # (reduce-scatter, all-reduce across replicas) per micro-batch: the first two are under `no_backward_sync`.
    expected = {"skip_all": [(False, False), (False, False), (True, True)],
                "reduce_scatter_only": [(True, False), (True, False), (True, True)]}
    report = {}
    for mode in ("skip_all", "reduce_scatter_only"):
        fabric = _fabric(sharding_strategy="HYBRID_SHARD", hybrid_no_sync=mode, **MESH)
        seen = _Collectives(fabric)
        report[mode] = accumulate_three_micro_batches(fabric, 1e-5, label=f"{mode}:", around_backward=seen)
        assert seen.per_backward == expected[mode], f"{mode}: collectives per micro-batch {seen.per_backward}"
    return report


@case
def meta_init_replicas_agree_and_shards_differ():
    import torch.distributed as dist

    fabric = _fabric(sharding_strategy="HYBRID_SHARD", **MESH)
    torch.manual_seed(0)
    with fabric.init_module(empty_init=True):
        model = TinyTransformer()
    model = fabric.setup_module(model)
    weights = {k: full(v) for k, v in model.state_dict().items()}
    sums = [None] * WORLD
    dist.all_gather_object(sums, {k: v.double().sum().item() for k, v in weights.items()})
    assert all(s == sums[0] for s in sums), "replicas initialized the same shard differently"
    w = weights["blocks.0.mlp.0.weight"]
    assert not torch.equal(w[:32], w[32:]), "both shards got the same random numbers"
    return {"checksum": sums[0]["blocks.0.mlp.0.weight"]}


@case
def no_grad_forward_before_each_step_hybrid_zero2():
    # Under _HYBRID_SHARD_ZERO2 every unit stays gathered after forward; a logging forward under no_grad between
    # backward and step must not leave them so.
    from common import loss_fn, max_param_diff, model_and_reference, train_side_by_side
    from models import make_batch

    fabric = _fabric(sharding_strategy="_HYBRID_SHARD_ZERO2", **MESH)
    model, opt, reference, ref_opt = model_and_reference(fabric)

    def logging_forward(step: int) -> None:
        with torch.no_grad():
            loss_fn(model, make_batch(50 + step, fabric.global_rank))
        assert all(isinstance(p, DTensor) for p in model.parameters()), "units left gathered after a no_grad forward"

    train_side_by_side(fabric, model, opt, reference, ref_opt, 3, between=logging_forward)
    return {"param_diff": max_param_diff(model, reference, 1e-5)}


@case
def ranks_seeded_differently_start_from_rank0_hybrid():
    # Every rank builds its own model (another seed, another buffer); after setup each holds rank 0's, replicas
    # included, and training matches a reference that starts from rank 0's model.
    import torch.distributed as dist

    from common import max_param_diff, train_side_by_side

    fabric = _fabric(sharding_strategy="HYBRID_SHARD", **MESH)
    torch.manual_seed(1234 + 17 * fabric.global_rank)
    plain = TinyTransformer()
    plain.register_buffer("scale", 1 + torch.rand(16))
    plain.embed.register_forward_hook(lambda m, a, out: out * plain.scale)
    box = [{k: v.clone() for k, v in [*plain.named_parameters(), *plain.named_buffers()]}]
    dist.broadcast_object_list(box, src=0)
    expected = box[0]
    model, opt = fabric.setup(plain, sgd(plain))
    for name, tensor in [*model.module.named_parameters(), *model.module.named_buffers()]:
        assert torch.equal(full(tensor).detach(), expected[name]), f"{name} is not rank 0's"
    reference = TinyTransformer()
    reference.register_buffer("scale", expected["scale"].clone())
    reference.embed.register_forward_hook(lambda m, a, out: out * reference.scale)
    reference.load_state_dict({k: v for k, v in expected.items() if k != "scale"}, strict=False)
    train_side_by_side(fabric, model, opt, reference, sgd(reference), 3)
    return {"param_diff": max_param_diff(model, reference, 1e-5)}


if __name__ == "__main__":
    run_cases()
