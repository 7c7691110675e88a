"""Two-rank case of ``tests/test_plain_entries.py``: a plain entry whose data DCP holds, with DTensor leaves, read
in place through ``fabric.load``."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from common import full_params, make_fabric, shared_tmpdir
from harness import case, run_cases
from lightning_fsdp.checkpoint.save import sharded_model_state, write_sharded
from models import TinyTransformer

WORLD = 2


@case
def fabric_load_reads_a_plain_entry_held_by_dcp_into_its_dtensors_and_tensors_in_place():
    """An average of the weights kept as DTensors in a plain dict (as the Trainer writes such entries: through DCP),
    and a replicated tensor beside it. Old code: `fabric.load` returned {"step": 3} and left every leaf zero."""
    fabric = make_fabric(WORLD)
    torch.manual_seed(0)
    model = fabric.setup(TinyTransformer())
    ema = {k: v.detach() * 2 for k, v in sharded_model_state(model).items()}
    path = shared_tmpdir(fabric) / "ck"
    write_sharded(path, {"model": sharded_model_state(model), "ema": {"weights": ema, "seen": torch.arange(6.0)}},
                  {"step": 3}, fabric.strategy._engine)
    expected = {k: v.full_tensor() for k, v in ema.items()}

    torch.manual_seed(1)
    fresh = fabric.setup(TinyTransformer())
    zeros = {k: torch.zeros_like(v) for k, v in sharded_model_state(fresh).items()}  # DTensors, sharded like it
    seen = torch.zeros(6)
    state = {"model": fresh, "ema": {"weights": zeros, "seen": seen}}
    assert fabric.load(path, state) == {"step": 3}
    loaded = state["ema"]["weights"]
    assert all(isinstance(v, DTensor) and v is zeros[k] for k, v in loaded.items()), "not read in place"
    assert all(torch.equal(loaded[k].full_tensor(), expected[k]) for k in expected), "the average differs"
    assert state["ema"]["seen"] is seen and torch.equal(seen, torch.arange(6.0))
    assert all(torch.equal(v, full_params(model)[k]) for k, v in full_params(fresh).items())
    return {"leaves": len(loaded)}


if __name__ == "__main__":
    run_cases()
