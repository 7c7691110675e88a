"""Two-rank cases for issue 19, part 3: the torch and Lightning releases users have (see ``test_versions.py``).

They run in every CI venv (pinned, newest torch, oldest Lightning), so each checks what the installed release must
do: a joint ``fabric.setup(model, opt)`` trains (Lightning 2.5 unpacks two values from the strategy, 2.6 three); the
opt-in to full unpickling that the errors name works as named; and a checkpoint written by torch 2.15 either loads
exactly (torch >= 2.15) or is refused on every rank with the torch it needs.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from common import full_params, loss_fn, make_fabric, shared_tmpdir
from harness import case, run_cases
from models import TinyTransformer, make_batch

WORLD = 2
FIXTURE = Path(__file__).parents[1] / "fixtures" / "torch215_sharded"
TORCH = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])


class Extra:
    """A user object in a checkpoint: only full unpickling restores it."""

    def __init__(self, value: int) -> None:
        self.value = value


def _message(fn) -> str:
    try:
        fn()
    except Exception as err:  # noqa: BLE001 - the point is the message
        return f"{type(err).__name__}: {err}"
    raise AssertionError("expected an error, got none")


@case
def joint_setup_trains_and_the_unpickling_opt_in_works_as_named():
    import lightning

    from lightning_fsdp import fabric_load  # new in this change: imported here so the other case runs on old code

    fabric = make_fabric(WORLD)
    torch.manual_seed(0)
    plain = TinyTransformer()
    model, opt = fabric.setup(plain, torch.optim.AdamW(plain.parameters(), lr=1e-2))  # joint: Lightning 2.5 failed
    before = full_params(model)
    fabric.backward(loss_fn(model, make_batch(0, fabric.global_rank)))
    opt.step()
    opt.zero_grad()
    trained = full_params(model)
    assert any(not torch.equal(before[k], trained[k]) for k in before), "the optimizer step changed nothing"

    root = shared_tmpdir(fabric)
    fabric.save(root / "ckpt", {"model": model, "optimizer": opt, "extra": Extra(7)})
    with torch.no_grad():
        for param in model.parameters():
            param.zero_()
    state = {"model": model, "optimizer": opt, "extra": None}
    refused = _message(lambda: fabric.load(root / "ckpt", state))
    # The hint names a call that exists on this Lightning, and following it literally restores everything.
    if "fabric.load(path, state, weights_only=False)" in refused:
        fabric.load(root / "ckpt", state, weights_only=False)
        route = "fabric.load"
    else:
        assert "lightning_fsdp.fabric_load(fabric, path, state, weights_only=False)" in refused, refused
        fabric_load(fabric, root / "ckpt", state, weights_only=False)
        route = "fabric_load"
    restored = full_params(model)
    assert all(torch.equal(trained[k], restored[k]) for k in trained), "the weights were not restored"
    assert isinstance(state["extra"], Extra) and state["extra"].value == 7, state["extra"]
    assert "load_checkpoint" not in vars(fabric.strategy), "fabric_load left its one-call binding behind"
    # `fabric_load` is also the plain call on every Lightning: the default refuses the object.
    again = _message(lambda: fabric_load(fabric, root / "ckpt", {"model": model, "optimizer": opt, "extra": None}))
    assert "full unpickling" in again, again
    return {"lightning": lightning.__version__, "route": route}


@case
def a_torch_2_15_checkpoint_loads_or_names_the_torch_it_needs_on_every_rank():
    fabric = make_fabric(WORLD)
    torch.manual_seed(0)
    model = fabric.setup(nn.Linear(3, 2))
    if TORCH >= (2, 15):
        fabric.load(FIXTURE, {"model": model})
        params = full_params(model)
        assert torch.equal(params["weight"], torch.arange(6, dtype=torch.float32).reshape(2, 3)), params["weight"]
        assert torch.equal(params["bias"], torch.tensor([0.5, -1.0])), params["bias"]
        return {"torch": torch.__version__, "loaded": True}
    message = _message(lambda: fabric.load(FIXTURE, {"model": model}))
    for part in ("written by torch 2.15 or newer", f"torch {torch.__version__}, installed here", "torch>=2.15",
                 str(FIXTURE)):
        assert part in message, f"{part!r} not in: {message}"
    assert "too many values" not in message, message
    return {"torch": torch.__version__, "message": message[:300]}


if __name__ == "__main__":
    run_cases()
