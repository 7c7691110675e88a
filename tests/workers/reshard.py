"""Save on one world size, load on another (``LFSDP_RESHARD_MODE=save`` / ``load``).

The save launch (2 ranks) writes a sharded and a full checkpoint plus ``expected.pt``, the full parameters and
optimizer state gathered right after saving. Each load launch (1, 3 or 4 ranks) loads both into every layout that
fits its world size and compares with ``expected.pt`` exactly.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist

from common import full, full_params, loss_fn, make_fabric
from harness import case, run_cases
from models import TinyTransformer, make_batch

ROOT = Path(os.environ["LFSDP_RESHARD_DIR"])
MODE = os.environ["LFSDP_RESHARD_MODE"]
WORLD = int(os.environ.get("WORLD_SIZE", "1"))


def _setup(fabric, seed):
    torch.manual_seed(seed)
    plain = TinyTransformer()
    return fabric.setup(plain, torch.optim.AdamW(plain.parameters(), lr=1e-2))


def _named_opt_state(model, opt) -> dict:
    names = [n.removeprefix("_forward_module.").replace("_checkpoint_wrapped_module.", "") for n, _ in model.named_parameters()]
    return {
        f"{names[i]}/{k}": full(v).clone()
        for i, per_param in opt.state_dict()["state"].items()
        for k, v in per_param.items()
    }


def _layouts() -> dict[str, dict]:
    layouts = {"full_shard": {}, "no_shard": {"sharding_strategy": "NO_SHARD"}}
    if WORLD == 4:
        layouts["hybrid_2x2"] = {"sharding_strategy": "HYBRID_SHARD", "device_mesh": (2, 2)}
    if WORLD >= 2:
        layouts["shard_grad_op_ac"] = {"sharding_strategy": "SHARD_GRAD_OP", "activation_checkpointing_policy": "auto"}
    return layouts


if MODE == "save":

    @case
    def save_on_two_ranks():
        for kind in ("sharded", "full"):
            fabric = make_fabric(WORLD, state_dict_type=kind)
            model, opt = _setup(fabric, seed=0)
            for step in range(2):
                fabric.backward(loss_fn(model, make_batch(step, fabric.global_rank)))
                opt.step()
                opt.zero_grad()
            fabric.save(ROOT / kind, {"model": model, "optimizer": opt, "step": 2})
        expected = {"params": full_params(model), "optim": _named_opt_state(model, opt)}
        if fabric.global_rank == 0:
            torch.save(expected, ROOT / "expected.pt")
        return sorted(p.name for p in ROOT.iterdir())

else:

    @case
    def load_into_every_layout():
        expected = torch.load(ROOT / "expected.pt", weights_only=True)
        report = {}
        for layout, kwargs in _layouts().items():
            for kind in ("sharded", "full"):
                fabric = make_fabric(WORLD, **kwargs)
                model, opt = _setup(fabric, seed=123)
                state = {"model": model, "optimizer": opt, "step": 0}
                fabric.load(ROOT / kind, state)
                params = full_params(model)
                assert state["step"] == 2
                assert params.keys() == expected["params"].keys()
                bad = [k for k in params if not torch.equal(params[k], expected["params"][k])]
                assert not bad, f"{layout}/{kind}: parameters differ: {bad[:3]}"
                optim = _named_opt_state(model, opt)
                assert optim.keys() == expected["optim"].keys(), sorted(set(optim) ^ set(expected["optim"]))[:4]
                bad = [k for k in optim if not torch.equal(optim[k], expected["optim"][k])]
                assert not bad, f"{layout}/{kind}: optimizer state differs: {bad[:3]}"
                report[f"{layout}/{kind}"] = "exact"
        dist.barrier()
        return report


if __name__ == "__main__":
    run_cases()
