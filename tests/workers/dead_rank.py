"""One rank dies (or hangs) mid-step; the survivor must fail with an error, from the death or the configured timeout.

Started by ``tests/test_dead_rank.py`` as two plain processes (not torchrun, which would kill the survivor
itself as soon as a worker dies). The survivor records what it raised (and, for the record, how long it waited).
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch

from common import loss_fn, make_fabric
from lightning_fsdp.checkpoint.save import sharded_model_state, write_full
from lightning_fsdp.engine.precision import FSDPPrecision
from models import TinyTransformer, make_batch

MODE = os.environ["LFSDP_DEAD_MODE"]  # see PHASES, or "die_in_full_load"
TIMEOUT_S = float(os.environ["LFSDP_DEAD_TIMEOUT"])
OUT = Path(os.environ["LFSDP_TEST_OUT"])
# Where rank 1 stops, by mode: the survivor's next collective is in that phase of the step.
PHASES = {"die": "forward", "hang": "forward", "die_in_backward": "backward", "die_in_step": "optimizer step",
          "die_in_all_reduce": "all_reduce"}


def main() -> None:
    torch.set_num_threads(1)
    # Under 16-mixed the optimizer step all-reduces the loss scaler's found-inf flag: a collective to die in.
    plugins = [FSDPPrecision("16-mixed")] if MODE == "die_in_step" else None
    fabric = make_fabric(2, plugins=plugins, timeout=timedelta(seconds=TIMEOUT_S))
    torch.manual_seed(0)
    plain = TinyTransformer()
    model, opt = fabric.setup(plain, torch.optim.SGD(plain.parameters(), lr=0.1))
    fabric.backward(loss_fn(model, make_batch(0, fabric.global_rank)))
    opt.step()
    fabric.barrier()
    if MODE == "die_in_full_load":
        _die_in_full_load(fabric, model, opt)
        return
    start = time.monotonic()
    record = {"raised": None}
    try:
        loss = None if MODE in ("die", "hang") else loss_fn(model, make_batch(1, fabric.global_rank))
        if MODE in ("die_in_step", "die_in_all_reduce"):
            fabric.backward(loss)
        if fabric.global_rank == 1:
            if MODE == "hang":
                time.sleep(3600)  # until the test kills it: only the configured timeout can end the survivor's wait
            os._exit(3)
        start = time.monotonic()
        if loss is None:
            loss = loss_fn(model, make_batch(1, 0))
        if MODE not in ("die_in_step", "die_in_all_reduce"):
            fabric.backward(loss)
        if MODE == "die_in_all_reduce":
            fabric.all_reduce(loss.detach())
        opt.step()
        fabric.barrier()
    except BaseException as err:  # noqa: BLE001 - any exception is what we want to see
        record = {"raised": type(err).__name__, "message": str(err)[:2000]}
    _report(record, start)


def _die_in_full_load(fabric, model, opt) -> None:
    """Rank 1 dies inside the full load, where rank 0 waits in the broadcast of the first entry."""
    path = Path(fabric.broadcast(str(OUT / "full.pt")))
    write_full(path, {"model": sharded_model_state(model)}, fabric.strategy._engine)
    if fabric.global_rank == 1:
        import lightning_fsdp.checkpoint.load as load

        load.load_full_from_rank0 = lambda *args, **kwargs: os._exit(3)
    start = time.monotonic()
    record = {"raised": None}
    try:
        fabric.load(path, {"model": model})
    except BaseException as err:  # noqa: BLE001 - any exception is what we want to see
        record = {"raised": type(err).__name__, "message": str(err)[:2000]}
    _report(record, start)


def _report(record: dict, start: float) -> None:
    record["elapsed_s"] = time.monotonic() - start
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"survivor_{MODE}.json").write_text(json.dumps(record))
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
