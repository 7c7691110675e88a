"""Two-rank cases of ``tests/test_plain_entries.py``: a plain entry whose data DCP holds, with DTensor leaves, read
in place through ``fabric.load``; a Trainer callback's state holding a DTensor, restored on resume."""

from __future__ import annotations

import tempfile

import torch
from lightning.pytorch.callbacks import Callback
from torch.distributed.tensor import DTensor

from common import full_params, make_fabric, shared_tmpdir
from harness import case, run_cases
from lightning_fsdp.checkpoint.save import sharded_model_state, write_sharded
from models import TinyTransformer
from trainer_common import LitGPT, loader, make_trainer, strategy

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


class _Average(Callback):
    """A callback whose state holds a DTensor (a copy of a sharded parameter), so the Trainer's sharded save writes
    the whole "callbacks" entry through DCP."""

    def __init__(self):
        self.copy, self.steps, self.loaded = None, 0, None

    def on_train_batch_end(self, trainer, pl_module, *args):
        self.copy, self.steps = next(pl_module.parameters()).detach().clone(), self.steps + 1

    def state_dict(self):
        return {"copy": self.copy, "steps": self.steps}

    def load_state_dict(self, state):
        self.loaded = state


@case
def trainer_resume_restores_a_callback_state_that_held_a_dtensor():
    """Old code: the sharded checkpoint's "callbacks" entry (in DCP, not meta.pt) was not returned to Lightning, so
    no callback's `load_state_dict` ran on resume (every callback's state was lost, silently)."""
    first = _Average()
    trainer = make_trainer(strategy(state_dict_type="sharded"), max_steps=2, callbacks=[first])
    trainer.fit(LitGPT(), loader())
    assert isinstance(first.copy, DTensor)
    expected = first.copy.full_tensor()
    path = trainer.strategy.broadcast(f"{tempfile.mkdtemp()}/ck")  # rank 0's folder, the same path on every rank
    trainer.save_checkpoint(path)
    again = _Average()
    make_trainer(strategy(state_dict_type="sharded"), max_steps=3, callbacks=[again]).fit(LitGPT(), loader(),
                                                                                       ckpt_path=path)
    assert again.loaded is not None, "the callback's state was not restored"
    # Whole, as a full checkpoint keeps it: a plain tensor on every rank.
    assert again.loaded["steps"] == 2 and torch.equal(again.loaded["copy"], expected), again.loaded
    return {"shape": list(expected.shape)}


if __name__ == "__main__":
    run_cases()
