"""A rank killed in the middle of a streamed multipart upload (``tests/test_streaming_save.py``): both ranks save
step 1 to ``$LFSDP_KILL_DIR/step-00000001`` and it commits; after one more step rank 1 counts the bytes it sends and
ends its process in the middle of its shard's third upload part (parts of ``$LFSDP_PART_SIZE`` bytes, below S3's
minimum: the test lowers moto's), saving to ``step-00000002`` (``LFSDP_KILL_MODE=new``) or over ``step-00000001``
(``over``). Rank 0 writes step 1's full parameters to ``$LFSDP_TEST_OUT/step1.pt`` first."""

from __future__ import annotations

import os
import signal
import socket
from pathlib import Path

import torch

from common import full_params, make_fabric, train_steps
from models import TinyTransformer

from lightning_fsdp.checkpoint.io.transfers import Transfers, set_transfers


def _arm(out: Path, limit: int) -> None:
    """End this process once ``limit`` bytes are sent from now on, cutting the request that crosses it."""
    sent = [0]

    def counted(original):
        def send(self, data, *args):
            room = limit - sent[0]
            if len(data) >= room:
                original(self, bytes(memoryview(data)[:room]), *args)
                (out / "killed.rank1").write_text(str(limit))
                os._exit(1)
            sent[0] += len(data)
            return original(self, data, *args)
        return send

    socket.socket.send = counted(socket.socket.send)
    socket.socket.sendall = counted(socket.socket.sendall)


def main() -> None:
    part = int(os.environ["LFSDP_PART_SIZE"])
    set_transfers(Transfers(part_size=part, parts_in_flight=2))  # unchecked: a test size below S3's 5 MiB
    fabric = make_fabric(2)
    torch.manual_seed(0)
    plain = TinyTransformer(dim=64)
    model, opt = fabric.setup(plain, torch.optim.AdamW(plain.parameters(), lr=1e-2))
    directory = os.environ["LFSDP_KILL_DIR"]
    train_steps(fabric, model, opt, 1)
    fabric.save(f"{directory}/step-00000001", {"model": model, "optimizer": opt, "step": 1})
    expected = full_params(model)
    out = Path(os.environ["LFSDP_TEST_OUT"])
    out.mkdir(parents=True, exist_ok=True)
    if fabric.global_rank == 0:
        torch.save(expected, out / "step1.pt")
    train_steps(fabric, model, opt, 1, start=1)
    fabric.barrier()
    if fabric.global_rank == 1:
        _arm(out, part * 5 // 2)
    else:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # fail by itself, as a survivor on another node would
    target = "step-00000002" if os.environ["LFSDP_KILL_MODE"] == "new" else "step-00000001"
    try:
        fabric.save(f"{directory}/{target}", {"model": model, "optimizer": opt, "step": 2})
    except Exception as err:
        (out / f"error.rank{fabric.global_rank}.txt").write_text(f"{type(err).__name__}: {err}")
        raise
    raise SystemExit("the save returned although rank 1 was killed in it")


if __name__ == "__main__":
    main()
