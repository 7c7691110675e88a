"""Checkpoints on object storage (issue 38), side by side in one invocation against a local S3 server (moto's, in
this process, on 127.0.0.1), on 2 CPU ranks and a small GPT with AdamW.

- **object storage: sharded save throughput vs plain s3fs put**: ``fabric.save("s3://...", state)`` (stage, upload
  every rank's objects, then the COMMIT object) against each rank putting the same number of bytes with one plain
  ``s3fs`` ``put_file``. Per round, plain seconds / save seconds (1.0: the save moves bytes as fast as s3fs does).
- **object storage: sharded load throughput vs plain s3fs get**: ``fabric.load("s3://...", state)`` (read COMMIT,
  fetch and check the objects it names, load) against each rank getting the same objects with one plain
  ``s3fs`` ``get``. Per round, plain seconds / load seconds.
- **object storage: async save stall vs a synchronous save**: how long ``fabric.save`` with ``async_save=True``
  blocks the caller, against a synchronous save of the same state to the same bucket (each started with no save in
  flight).

The server and the loopback are shared by both sides (moto keeps objects in the parent's memory), so the ratios say
what our protocol costs on top of moving the bytes, not what S3 itself would give. The checkpoint (model + AdamW,
about 170 MB at the defaults) is large enough that moving bytes, not the requests' round trips, dominates. Run (the parent starts the server and
the 2 ranks; take the CPU lock around it on a shared machine):

    flock /tmp/cpu.lock .venv/bin/python benchmarks/object_storage.py [--rounds 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rows import alternate, emit, figure, ratios  # noqa: E402

BUCKET = "bench"


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default=None, help="write the rows here as JSON")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--dim", type=int, default=384)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    return parser.parse_args()


def main() -> None:
    args = _parse()
    if args.worker:
        _worker(args)
        return
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "AWS_ENDPOINT_URL": f"http://{host}:{port}",
           "AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_EC2_METADATA_DISABLED": "true"}
    try:
        import boto3

        boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], aws_access_key_id="bench",
                     aws_secret_access_key="bench", region_name="us-east-1").create_bucket(Bucket=BUCKET)
        with tempfile.TemporaryDirectory() as scratch:
            out = Path(scratch) / "rows.json"
            command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", __file__,
                       "--worker", "--out", str(out), "--rounds", str(args.rounds), "--layers", str(args.layers),
                       "--dim", str(args.dim)]
            subprocess.run(command, check=True, env=env)
            emit(json.loads(out.read_text()), args.json)
    finally:
        server.stop()


# ---------------------------------------------------------------------------------------------- the ranks' side


def _worker(args: argparse.Namespace) -> None:
    import s3fs
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from lightning.fabric import Fabric

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
    from train_gpt import GPT, Block, GPTConfig, make_optimizer  # the example's model

    from lightning_fsdp.fabric import FSDPStrategy

    torch.set_num_threads(1)
    fabrics = {kind: Fabric(accelerator="cpu", devices=2,
                            strategy=FSDPStrategy(auto_wrap_policy={Block}, state_dict_type="sharded",
                                                  async_save=kind == "async"))
               for kind in ("sync", "async")}
    for fabric in fabrics.values():
        fabric.launch()
    fabric = fabrics["sync"]
    rank = fabric.global_rank
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=64, block_size=64, n_layer=args.layers, n_head=6, n_embd=args.dim)
    with fabric.init_module(empty_init=True):
        plain = GPT(config)
    model, optimizer = fabric.setup(plain, make_optimizer(plain, 1e-4))
    batch = torch.randint(0, config.vocab_size, (4, config.block_size + 1))
    loss = F.cross_entropy(model(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten())
    fabric.backward(loss)
    optimizer.step()  # AdamW's moments exist from here on
    state = {"model": model, "optimizer": optimizer, "step": 0}
    run = fabric.broadcast(f"run-{os.getpid()}")
    url = f"s3://{BUCKET}/{run}/ckpt"
    fs = s3fs.S3FileSystem(skip_instance_cache=True, use_listings_cache=False)  # the environment's endpoint

    def seconds(action: Callable[[], Any]) -> float:
        fabric.barrier()
        start = time.perf_counter()
        action()
        elapsed = torch.tensor(time.perf_counter() - start)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        return elapsed.item()

    def committed() -> list[str]:
        """The objects the checkpoint's COMMIT names now (each save writes under a prefix of its own)."""
        fs.invalidate_cache()
        record = json.loads(fs.cat_file(f"{url}/COMMIT"))
        return [f"{url}/.{record['token']}/{name}" for name in record["objects"]]

    # --- the checkpoint's objects and size, then the plain sides' bytes
    fabric.save(url, state)
    objects = committed()
    total = sum(fs.size(o) for o in objects)
    scratch = Path(tempfile.mkdtemp(prefix="object_storage_bench_"))
    share = scratch / "share.bin"
    share.write_bytes(os.urandom(total // fabric.world_size))  # this rank's part of a save's bytes

    def plain_put() -> None:
        fs.put_file(str(share), f"{BUCKET}/{run}/plain/rank{rank}.bin")

    def plain_get() -> float:  # what a load fetches on each rank: every object the commit names
        now = committed()
        return seconds(lambda: fs.get(now, [str(scratch / "got" / f"{i}") for i in range(len(now))]))

    (scratch / "got").mkdir()
    background = fabrics["async"].strategy._background_saves

    def finish_async() -> None:
        background.wait(fabrics["async"].strategy._engine)

    stall: dict[str, list[float]] = {"sync": [], "async": []}

    def save_call(kind: str) -> float:
        finish_async()
        elapsed = seconds(lambda: fabrics[kind].save(f"{url}-{kind}", state))
        stall[kind].append(elapsed)
        finish_async()
        return elapsed

    fabrics["async"].save(f"{url}-async", state)  # warm-up: the first async save creates its process group
    finish_async()
    sides = {
        "save": lambda: seconds(lambda: fabric.save(url, state)),
        "plain put": lambda: seconds(plain_put),
        "load": lambda: seconds(lambda: fabric.load(url, state)),
        "plain get": plain_get,
        "sync save": lambda: save_call("sync"),
        "async save call": lambda: save_call("async"),
    }
    times = alternate(args.rounds, sides)
    med = statistics.median
    mb = total / 1e6
    rows = [
        figure("object storage: sharded save throughput vs plain s3fs put", ratios(times["plain put"], times["save"]),
               baseline="s3fs put_file of the same bytes from each rank, same server", target=None,
               detail={"checkpoint_MB": mb, "objects": len(objects), "save_s": med(times["save"]),
                       "plain_put_s": med(times["plain put"])}),
        figure("object storage: sharded load throughput vs plain s3fs get", ratios(times["plain get"], times["load"]),
               baseline="s3fs get of the same objects on each rank, same server", target=None,
               detail={"checkpoint_MB": mb, "load_s": med(times["load"]), "plain_get_s": med(times["plain get"])}),
        figure("object storage: async save stall vs a synchronous save",
               ratios(times["async save call"], times["sync save"]),
               baseline="synchronous sharded save to the same bucket", target=("<=", 0.1),
               detail={"async_call_s": med(times["async save call"]), "sync_save_s": med(times["sync save"])}),
    ]
    if rank == 0:
        Path(args.out).write_text(json.dumps(rows))
    fabric.barrier()


if __name__ == "__main__":
    main()
