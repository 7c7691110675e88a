"""Four-rank cases for the Trainer front on a (replicate=2, shard=2) mesh: parity with one process, and gradient
accumulation in both of hybrid sharding's no-sync modes."""

from __future__ import annotations

import torch.distributed as dist
from lightning.pytorch import Callback
from torch.distributed.tensor import Replicate, Shard

from harness import case, run_cases
from trainer_common import ATOL, LitGPT, compare_params, gathered, loader, make_trainer, reference_fit, strategy

WORLD = 4
SAMPLES = 32  # 4 batches of 2 per rank and epoch


class _Collectives(Callback):
    """Which gradient collectives FSDP ran in each backward: reduce-scatters inside a shard group, all-reduces across
    replicas. Counted by wrapping the two ``torch.distributed`` functions FSDP calls for them."""

    def __init__(self) -> None:
        self.per_backward: list[tuple[bool, bool]] = []
        self._counts = {"reduce_scatter": 0, "all_reduce": 0}
        self._originals = (dist.reduce_scatter_single, dist.all_reduce)

    def on_fit_start(self, trainer, pl_module) -> None:
        replicate = trainer.strategy.device_mesh.get_group("replicate")
        reduce_scatter, all_reduce = self._originals

        def counted_reduce_scatter(*args, **kwargs):
            self._counts["reduce_scatter"] += 1
            return reduce_scatter(*args, **kwargs)

        def counted_all_reduce(tensor, *args, **kwargs):
            if kwargs.get("group") is replicate:
                self._counts["all_reduce"] += 1
            return all_reduce(tensor, *args, **kwargs)

        dist.reduce_scatter_single, dist.all_reduce = counted_reduce_scatter, counted_all_reduce

    def on_fit_end(self, trainer, pl_module) -> None:
        dist.reduce_scatter_single, dist.all_reduce = self._originals

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        self._counts.update(reduce_scatter=0, all_reduce=0)

    def on_after_backward(self, trainer, pl_module) -> None:
        self.per_backward.append((self._counts["reduce_scatter"] > 0, self._counts["all_reduce"] > 0))


def _fit(accumulate: int = 1, **kwargs):
    seen = _Collectives()
    model = LitGPT()
    trainer = make_trainer(
        strategy(sharding_strategy="HYBRID_SHARD", device_mesh=[2, 2], **kwargs), devices=WORLD,
        accumulate_grad_batches=accumulate, callbacks=[seen],
    )
    trainer.fit(model, loader(SAMPLES))
    reference, _ = reference_fit(2, accumulate=accumulate, world=WORLD, samples=SAMPLES)
    return model, seen.per_backward, compare_params(gathered(model.model), reference.state_dict(), ATOL)


@case
def parity_hybrid_shard_2x2():
    model, collectives, diff = _fit()
    assert collectives == [(True, True)] * 8, collectives
    weight = model.model.head.weight
    assert weight.placements == (Replicate(), Shard(0)), weight.placements
    return {"param_diff": diff}


@case
def accumulation_skip_all_defers_every_collective():
    _, collectives, diff = _fit(accumulate=2)
    # (reduce-scatter, all-reduce) per backward: nothing on the first micro-batch of each step, both on the second.
    assert collectives == [(False, False), (True, True)] * 4, collectives
    return {"param_diff": diff}


@case
def accumulation_reduce_scatter_only_skips_only_the_all_reduce():
    _, collectives, diff = _fit(accumulate=2, hybrid_no_sync="reduce_scatter_only")
    # Reduce-scatter on every micro-batch (gradients stay sharded); only the all-reduce across replicas waits.
    assert collectives == [(True, False), (True, True)] * 4, collectives
    return {"param_diff": diff}


if __name__ == "__main__":
    run_cases()
