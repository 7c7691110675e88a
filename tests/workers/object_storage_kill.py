"""A rank killed half-way through its upload (``tests/test_object_storage.py``): both ranks save step 1 to
``$LFSDP_KILL_DIR/step-00000001`` and it commits; after one more step rank 1 counts the bytes it sends (every Python
socket: s3fs's, through asyncio) and ends its process in the middle of uploading its shard of the next save, which
goes to ``step-00000002`` (``LFSDP_KILL_MODE=new``) or over ``step-00000001`` (``over``). Rank 0 writes step 1's
full parameters to ``$LFSDP_TEST_OUT/step1.pt`` first, for the pytest side to compare with what then loads."""

from __future__ import annotations

import os
import signal
import socket
from pathlib import Path

import torch

from common import full_params, make_fabric, train_steps
from models import TinyTransformer

KILL_AFTER = 4 * 1024  # bytes rank 1 sends once armed: past a request's headers, inside its shard's body


def _arm(out: Path) -> None:
    """From now on, end this process once KILL_AFTER bytes are sent: the send that crosses it sends only its part
    up to the limit, so the server holds a request cut off in its body."""
    sent = [0]

    def counted(original):
        def send(self, data, *args):
            room = KILL_AFTER - sent[0]
            if len(data) >= room:
                original(self, bytes(memoryview(data)[:room]), *args)
                (out / "killed.rank1").write_text(str(KILL_AFTER))
                os._exit(1)
            sent[0] += len(data)
            return original(self, data, *args)
        return send

    socket.socket.send = counted(socket.socket.send)
    socket.socket.sendall = counted(socket.socket.sendall)
    # The shard's single PUTs go through s3fs from now on, whose bytes pass these Python sockets: obstore's
    # (checkpoint/io/transport_put.py) are Rust's, which nothing here can cut mid-body. A PUT cut off leaves no
    # object whichever client sent it; what this test holds is the commit protocol around it.
    os.environ["LFSDP_S3_CLIENT"] = "s3fs"


def main() -> None:
    fabric = make_fabric(2)
    torch.manual_seed(0)
    plain = TinyTransformer()
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
        _arm(out)
    else:
        # torchrun stops the other ranks once rank 1 is dead (SIGTERM, then SIGKILL 30 s later). A survivor on
        # another node sees the death only through its own collectives, and its error is what its user reads: so
        # this one lets torchrun's SIGTERM pass, and fails by itself.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    target = "step-00000002" if os.environ["LFSDP_KILL_MODE"] == "new" else "step-00000001"
    try:
        fabric.save(f"{directory}/{target}", {"model": model, "optimizer": opt, "step": 2})
    except Exception as err:  # the survivor's error, for the pytest side: it must name the URL and the fix
        (out / f"error.rank{fabric.global_rank}.txt").write_text(f"{type(err).__name__}: {err}")
        raise
    raise SystemExit("the save returned although rank 1 was killed in it")


if __name__ == "__main__":
    main()
