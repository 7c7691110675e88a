"""Checkpoints on object storage (issues 38 and 43), side by side in one invocation against a local S3 server (moto's,
in this process, on 127.0.0.1, behind a counting middleware), on 2 CPU ranks and a small GPT with AdamW.

Sides, each timed as the max over ranks after a barrier, their order rotated per round (round r starts at side
r mod n, so drift in the machine's load hits every side alike):

- ``save``: ``fabric.save("s3://...", state)``; ``plain put``: each rank ``s3fs.pipe_file`` of as many random bytes
  as its own shard, from memory; ``dcp save``: ``dcp.save`` through torch's ``FsspecWriter(sync_files=False)`` (what
  torchtitan uses) of the same model and optimizer.
- ``load``: ``fabric.load("s3://...", state)``; ``plain get``: each rank ``s3fs.cat_file`` of its own shard object
  into memory; ``dcp load``: ``dcp.load`` through ``FsspecReader``.
- ``plain put 2`` and ``plain get 2``: the plain sides again, so the harness's own noise is a row too.
- ``async save call``: how long ``fabric.save`` with ``async_save=True`` blocks the caller.

Each rank uses its own access key (``w<world>r<rank>``); the middleware counts, per key, the request and response
body bytes and the requests, so a rank's bytes are read at the server, whatever client moved them. During every side
a 5 ms sampler records the rank's resident memory (``/proc/self/statm``, above its value at the start, after
``malloc_trim``) and the size of its ``TMPDIR`` (a fresh folder per rank): the local disk a save or load writes.
After the rounds, a one-file (``state_dict_type="full"``) save and load count what rank 1 downloads, and a second
launch at world 4 with a smaller model counts the bytes per rank of a sharded load there.

What limits it: moto spends Python time per byte (werkzeug, an MD5 per object for the ETag, copies) on the same 2
cores as the ranks, so every side is bound by the server and the throughput ratios show serial phases and extra
bytes, not client speed (``benchmarks/profile_s3.py`` measures clients against a fast stub). Two of moto's costs
are not S3's: completing a multipart upload copies and hashes the whole object again (0.32 s for 86 MiB here; the
plain put of a shard under 100 MiB is one PUT, and so is each object of a save's shard of at most 16 parts), and a ranged GET copies the whole object
(55 ms per range of an 86 MiB object, whatever its length). The second would turn a reader's small ranges into
seconds, so the counting server answers ranged GETs itself from moto's stored bytes (``--moto-ranges``: not).
Where a save's or a load's own time goes: ``benchmarks/profile_checkpoint.py`` (py-spy, the collector, the reads).
Run (the parent starts the server and the ranks; take the CPU lock around it on a shared machine):

    flock /tmp/cpu.lock .venv/bin/python benchmarks/object_storage.py [--rounds 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any, Callable, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rows import emit, figure  # noqa: E402

BUCKET = "bench"
LEDGER_PATH = "/__ledger__"
MIB = 2**20


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", default=None, help="write the rows here as JSON")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--dim", type=int, default=384, help="a multiple of 6 (the heads)")
    parser.add_argument("--world4-layers", type=int, default=2, help="the model of the world-4 launch (bytes only)")
    parser.add_argument("--world4-dim", type=int, default=192)
    parser.add_argument("--moto-ranges", action="store_true",
                        help="leave ranged GETs to moto, which copies the whole object for each (see _ranged_get)")
    parser.add_argument("--worker", choices=("main", "scale"), default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--tmp-root", default=None, help=argparse.SUPPRESS)
    return parser.parse_args()


# ------------------------------------------------------------------------------------------- the counting server


class Ledger:
    """WSGI middleware around moto's app: per access key (from the SigV4 ``Credential=``), the request body bytes
    received (``in``), the response body bytes sent (``out``) and the requests, by method. ``GET /__ledger__``
    answers the counts as JSON and is not counted."""

    def __init__(self, app: Callable, fast_ranges: bool = True) -> None:
        self.app = app
        self.fast_ranges = fast_ranges
        self.lock = threading.Lock()
        self.counts: dict[str, dict[str, int]] = {}
        log = os.environ.get("BENCH_LEDGER_LOG")
        self.log = open(log, "a", buffering=1) if log else None

    def _add(self, key: str, field: str, n: int) -> None:
        with self.lock:
            row = self.counts.setdefault(key, {"in": 0, "out": 0, "requests": 0})
            row[field] = row.get(field, 0) + n

    def __call__(self, environ: dict, start_response: Callable) -> Any:
        if environ.get("PATH_INFO") == LEDGER_PATH:
            with self.lock:
                body = json.dumps(self.counts).encode()
            start_response("200 OK", [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
            return [body]
        auth = environ.get("HTTP_AUTHORIZATION", "")
        key = auth.split("Credential=", 1)[1].split("/", 1)[0] if "Credential=" in auth else "anonymous"
        self._add(key, "requests", 1)
        self._add(key, environ.get("REQUEST_METHOD", "?"), 1)
        if self.log is not None:  # BENCH_LEDGER_LOG: one line per request, to see what a side asked for
            self.log.write(f"{time.time():.3f} {key} {environ.get('REQUEST_METHOD')} {environ.get('PATH_INFO')}"
                           f"?{environ.get('QUERY_STRING', '')} {environ.get('HTTP_RANGE', '-')}\n")
        environ["wsgi.input"] = _CountingInput(environ["wsgi.input"], lambda n: self._add(key, "in", n))
        ranged = _ranged_get(environ, start_response) if self.fast_ranges else None
        return self._counted(key, ranged if ranged is not None else self.app(environ, start_response))

    def _counted(self, key: str, body: Any) -> Any:
        try:
            for chunk in body:
                self._add(key, "out", len(chunk))
                yield chunk
        finally:
            if hasattr(body, "close"):
                body.close()


def _ranged_get(environ: dict, start_response: Callable) -> Any:
    """A plain ``GET /bucket/key`` with ``Range: bytes=a-b``, answered from moto's stored object by reading only
    those bytes. moto itself copies the whole object for every ranged GET (55 ms for a 1.5 KB range of an 86 MiB
    object here, whatever the range), which S3 does not: left alone, a reader that asks for many small ranges would
    be measured against moto's copy, not against its own requests. None: anything else, left to moto (which then
    also answers a missing key or a bad range)."""
    import urllib.parse

    from moto.core import DEFAULT_ACCOUNT_ID
    from moto.s3.models import s3_backends

    spec = environ.get("HTTP_RANGE", "")
    if environ.get("REQUEST_METHOD") != "GET" or environ.get("QUERY_STRING") or not spec.startswith("bytes="):
        return None
    first, _, last = spec[len("bytes="):].partition("-")
    bucket, _, name = urllib.parse.unquote(environ.get("PATH_INFO", "")).lstrip("/").partition("/")
    if not (first.isdigit() and last.isdigit() and name):
        return None
    try:
        found = s3_backends[DEFAULT_ACCOUNT_ID]["aws"].get_object(bucket, name)
    except Exception:  # noqa: BLE001 (no such bucket or key: moto answers it)
        return None
    start, end = int(first), min(int(last), (found.size if found else 0) - 1)
    if found is None or start > end:
        return None
    with found.lock:
        found._value_buffer.seek(start)  # noqa: SLF001 (moto's buffer of the object's bytes)
        body = found._value_buffer.read(end - start + 1)  # noqa: SLF001
    start_response("206 Partial Content", [
        ("Content-Type", "binary/octet-stream"), ("Content-Length", str(len(body))), ("ETag", found.etag),
        ("Content-Range", f"bytes {start}-{end}/{found.size}"), ("Last-Modified", found.last_modified_RFC1123),
        ("Accept-Ranges", "bytes")])
    return [body]


class _CountingInput:
    def __init__(self, raw: Any, note: Callable[[int], None]) -> None:
        self.raw, self.note = raw, note

    def read(self, *args: Any) -> bytes:
        data = self.raw.read(*args)
        self.note(len(data))
        return data

    def readline(self, *args: Any) -> bytes:
        data = self.raw.readline(*args)
        self.note(len(data))
        return data

    def __iter__(self):
        for line in self.raw:
            self.note(len(line))
            yield line


def serve(fast_ranges: bool = True) -> tuple[Any, str]:
    """moto's S3 app behind :class:`Ledger` on a threaded werkzeug server (what ``ThreadedMotoServer`` runs)."""
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
    from werkzeug.serving import make_server

    class Quiet(MotoRequestHandler):
        def log_request(self, *args: Any, **kwargs: Any) -> None:  # a line per request would flood the output
            pass

    server = make_server("127.0.0.1", 0, Ledger(DomainDispatcherApplication(create_backend_app), fast_ranges),
                         threaded=True,
                         request_handler=Quiet)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    host, port = server.server_address[:2]
    return server, f"http://{host}:{port}"


def launch_on_server(argv: list[str], extra_env: Optional[dict[str, str]] = None) -> None:
    """For the profilers: this module's server (in this process, with the bucket), then two ranks of ``argv`` under
    torchrun, signing as the benchmark's ranks do; the server stops when they have ended."""
    import boto3

    server, endpoint = serve(True)
    try:
        boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="bench", aws_secret_access_key="bench",
                     region_name="us-east-1").create_bucket(Bucket=BUCKET)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "bench",
               "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1",
               "AWS_EC2_METADATA_DISABLED": "true", **(extra_env or {})}
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *argv],
                       check=True, env=env)
    finally:
        server.shutdown()


def main() -> None:
    args = _parse()
    if args.worker:
        _worker(args)
        return
    server, endpoint = serve(fast_ranges=not args.moto_ranges)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "bench",
           "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true",
           "BENCH_LEDGER_URL": endpoint + LEDGER_PATH}
    try:
        import boto3

        boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="bench", aws_secret_access_key="bench",
                     region_name="us-east-1").create_bucket(Bucket=BUCKET)
        rows: list[dict] = []
        with tempfile.TemporaryDirectory(prefix="object_storage_bench_") as scratch:
            for mode, world, layers, dim in (("main", 2, args.layers, args.dim),
                                             ("scale", 4, args.world4_layers, args.world4_dim)):
                out = Path(scratch) / f"{mode}.json"
                command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
                           __file__, "--worker", mode, "--out", str(out), "--rounds", str(args.rounds),
                           "--layers", str(layers), "--dim", str(dim), "--tmp-root", str(Path(scratch) / mode)]
                subprocess.run(command, check=True, env=env)
                rows.extend(json.loads(out.read_text()))
        emit(rows, args.json)
    finally:
        server.shutdown()


# ---------------------------------------------------------------------------------------------- the ranks' side


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _tree_bytes(root: Path) -> int:
    total = 0
    for folder, _, files in os.walk(root):
        for name in files:
            try:
                total += os.lstat(os.path.join(folder, name)).st_size
            except FileNotFoundError:  # removed while walked
                pass
    return total


class Sampler:
    """Peak resident memory above the start and peak size of ``tmp`` while the block runs, sampled every 5 ms."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self._stop = threading.Event()

    def __enter__(self) -> "Sampler":
        try:  # freed memory kept in arenas would hide new allocations (TESTING-NOTES, "Measuring memory on CPU")
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except OSError:
            pass
        self.rss0, self.disk0 = _rss(), _tree_bytes(self.tmp)
        self.rss_peak, self.disk_peak = self.rss0, self.disk0
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        self.rss_peak = max(self.rss_peak, _rss())
        self.disk_peak = max(self.disk_peak, _tree_bytes(self.tmp))

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            self._sample()

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()


def _worker(args: argparse.Namespace) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # Before any client exists: the rank's own access key (the ledger counts by it) and a fresh TMPDIR whose peak
    # size is the local disk a save or load writes.
    key = os.environ["AWS_ACCESS_KEY_ID"] = f"w{world}r{rank}"
    tmp = Path(args.tmp_root) / key
    tmp.mkdir(parents=True)
    os.environ["TMPDIR"] = str(tmp)
    tempfile.tempdir = None

    import warnings

    import s3fs
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    import torch.nn.functional as F
    from lightning.fabric import Fabric
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
    from train_gpt import GPT, Block, GPTConfig, make_optimizer  # the example's model

    from lightning_fsdp.fabric import FSDPStrategy

    warnings.filterwarnings("ignore", message=".*returned a view tensor")  # the example model's, once per forward
    torch.set_num_threads(1)
    kinds = ("sync", "async", "full") if args.worker == "main" else ("sync",)
    fabrics = {kind: Fabric(accelerator="cpu", devices=world,
                            strategy=FSDPStrategy(auto_wrap_policy={Block},
                                                  state_dict_type="full" if kind == "full" else "sharded",
                                                  async_save=kind == "async"))
               for kind in kinds}
    for fabric in fabrics.values():
        fabric.launch()
    fabric = fabrics["sync"]
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
    ledger_url = os.environ["BENCH_LEDGER_URL"]

    def counted() -> dict[str, int]:
        with urllib.request.urlopen(ledger_url) as answer:
            return json.loads(answer.read()).get(key, {})

    def measure(action: Callable[[], Any]) -> dict[str, Any]:
        """Run ``action`` on every rank after a barrier: its time (max over ranks) and, per rank, the bytes the
        server received from and sent to this rank, its requests, peak RSS above the start and peak TMPDIR size."""
        fabric.barrier()
        before = counted()
        with Sampler(tmp) as sampler:
            cpu = time.process_time()  # every thread of the rank: the client's loop and transfer threads too
            start = time.perf_counter()
            action()
            elapsed = time.perf_counter() - start
            cpu = time.process_time() - cpu
        after = counted()
        mine = {"s": elapsed, "cpu": cpu, "rss": sampler.rss_peak - sampler.rss0,
                "disk": sampler.disk_peak - sampler.disk0,
                **{f: after.get(f, 0) - before.get(f, 0) for f in ("in", "out", "requests", "GET", "PUT", "HEAD")}}
        ranks: list[Any] = [None] * world
        dist.all_gather_object(ranks, mine)
        return {"s": max(r["s"] for r in ranks), "ranks": ranks}

    def own_shard(prefix: str) -> int:
        """The bytes of this rank's shard files under ``prefix`` (DCP names them ``__<rank>_<i>.distcp``)."""
        fs.invalidate_cache()
        return sum(fs.size(o) for o in fs.ls(prefix, detail=False) if o.rsplit("/", 1)[-1].startswith(f"__{rank}_"))

    def committed() -> tuple[str, dict[str, Any]]:
        fs.invalidate_cache()
        record = json.loads(fs.cat_file(f"{url}/COMMIT"))
        return f"{url}/.{record['token']}", record

    fabric.save(url, state)
    prefix, record = committed()
    shard = own_shard(prefix)
    shards: list[Any] = [None] * world
    dist.all_gather_object(shards, shard)
    checkpoint_bytes = sum(fs.size(f"{prefix}/{name}") for name in record["objects"])
    if args.worker == "scale":
        load = measure(lambda: fabric.load(url, state))
        ratios = [r["out"] / s for r, s in zip(load["ranks"], shards)]
        rows = [figure(f"object storage: bytes a rank downloads on a sharded load / its own shard, world {world}",
                       [max(ratios)], baseline="the rank's own shard file", target=("<=", 1.1),
                       detail={"per_rank": ratios, "shard_MB": [s / 1e6 for s in shards],
                               "checkpoint_MB": checkpoint_bytes / 1e6, "requests": [r["requests"] for r in
                                                                                     load["ranks"]]})]
        if rank == 0:
            Path(args.out).write_text(json.dumps(rows))
        fabric.barrier()
        return

    payload = os.urandom(shard)  # the plain sides move as many bytes as the rank's shard, from and into memory
    plain_key = f"{BUCKET}/{run}/plain/rank{rank}.bin"
    dcp_url = f"s3://{BUCKET}/{run}/dcp"

    def dcp_save() -> None:
        model_sd, optim_sd = get_state_dict(plain, optimizer.optimizer)
        dcp.save({"model": model_sd, "optimizer": optim_sd}, storage_writer=FsspecWriter(dcp_url, sync_files=False, overwrite=True))

    def dcp_load() -> None:
        model_sd, optim_sd = get_state_dict(plain, optimizer.optimizer)
        loaded = {"model": model_sd, "optimizer": optim_sd}
        dcp.load(loaded, storage_reader=FsspecReader(dcp_url))
        set_state_dict(plain, optimizer.optimizer, model_state_dict=loaded["model"],
                       optim_state_dict=loaded["optimizer"])

    background = fabrics["async"].strategy._background_saves

    def finish_async() -> None:
        background.wait(fabrics["async"].strategy._engine)

    def async_call() -> dict[str, Any]:
        finish_async()
        out = measure(lambda: fabrics["async"].save(f"{url}-async", state))
        finish_async()
        return out

    fs.pipe_file(plain_key, payload)
    dcp_save()
    dcp_shard = own_shard(dcp_url.removeprefix("s3://"))
    fabrics["async"].save(f"{url}-async", state)  # warm-up: the first async save creates its process group
    finish_async()

    def plain_get_side() -> dict[str, Any]:
        # The plain put's object: as many bytes as the rank's shard, in one object (a save may split a shard over
        # several `__<rank>_<i>.distcp` objects, so no one of those is the shard).
        return measure(lambda: fs.cat_file(plain_key))

    sides: dict[str, Callable[[], dict[str, Any]]] = {
        "save": lambda: measure(lambda: fabric.save(url, state)),
        "plain put": lambda: measure(lambda: fs.pipe_file(plain_key, payload)),
        "dcp save": lambda: measure(dcp_save),
        "load": lambda: measure(lambda: fabric.load(url, state)),
        "plain get": plain_get_side,
        "dcp load": lambda: measure(dcp_load),
        "plain put 2": lambda: measure(lambda: fs.pipe_file(plain_key, payload)),
        "plain get 2": plain_get_side,
        "async save call": async_call,
    }
    runs = rotated(args.rounds, sides)

    # The one-file checkpoint: saved once, loaded once; what rank 1 downloads against the file.
    full_url = f"{url}-full"
    fabrics["full"].save(full_url, state)
    fs.invalidate_cache()
    full_record = json.loads(fs.cat_file(f"{full_url}/COMMIT"))
    full_bytes = sum(size for size, _ in full_record["objects"].values())
    full_load = measure(lambda: fabrics["full"].load(full_url, state))
    if rank == 0:
        Path(args.out).write_text(json.dumps(_rows(runs, shards, dcp_shard, checkpoint_bytes, full_load, full_bytes,
                                                   len(record["objects"]), world)))
    fabric.barrier()


def rotated(rounds: int, sides: dict[str, Callable[[], Any]]) -> dict[str, list[Any]]:
    """Each side once per round; round r runs the sides starting at side r mod n (a rotation, not a reversal: with
    more than two sides a reversal keeps the middle ones in the middle)."""
    names = list(sides)
    out: dict[str, list[Any]] = {name: [] for name in names}
    for r in range(rounds):
        start = r % len(names)
        for name in names[start:] + names[:start]:
            out[name].append(sides[name]())
    return out


def _rows(runs: dict[str, list[dict]], shards: list[int], dcp_shard: int, checkpoint_bytes: int,
          full_load: dict[str, Any], full_bytes: int, objects: int, world: int) -> list[dict]:
    med = statistics.median
    secs = {side: [r["s"] for r in results] for side, results in runs.items()}

    def per_round(a: str, b: str) -> list[float]:
        return [x / y for x, y in zip(secs[a], secs[b])]

    def worst(side: str, field: str, per: list[int]) -> list[float]:
        """Per round, the largest ratio over ranks of ``field`` to the rank's ``per`` bytes."""
        return [max(r[field] / p for r, p in zip(rnd["ranks"], per)) for rnd in runs[side]]

    def cpu(side: str) -> list[float]:
        """Per round, the CPU seconds of the busiest rank."""
        return [max(r["cpu"] for r in rnd["ranks"]) for rnd in runs[side]]

    def cpu_ratio(a: str, b: str) -> list[float]:
        return [x / y for x, y in zip(cpu(a), cpu(b))]

    cpu_per_gb = {side: med(cpu(side)) / (max(shards) / 1e9) for side in runs}
    shard_mb = [s / 1e6 for s in shards]
    rss_bound = [(64 * MIB + 0.1 * s) / s for s in shards]
    common = {"checkpoint_MB": checkpoint_bytes / 1e6, "shard_MB": shard_mb, "objects": objects}
    seconds = {side: med(v) for side, v in secs.items()}
    rows = [
        figure(f"object storage: bytes a rank downloads on a sharded load / its own shard, world {world}",
               worst("load", "out", shards), baseline="the rank's own shard file", target=("<=", 1.1),
               detail={**common, "dcp_fsspec": med(worst("dcp load", "out", [dcp_shard] * world)),
                       "requests_per_rank": [r["requests"] for r in runs["load"][-1]["ranks"]]}),
        figure("object storage: bytes rank 1 downloads on a full (one-file) load / the file",
               [full_load["ranks"][1]["out"] / full_bytes], baseline="the committed file's bytes", target=("<=", 0.6),
               detail={"file_MB": full_bytes / 1e6, "rank0": full_load["ranks"][0]["out"] / full_bytes,
                       "load_s": full_load["s"]}),
        figure("object storage: local disk written per rank during a sharded save / its shard",
               worst("save", "disk", shards), baseline="peak size of the rank's TMPDIR", target=("<=", 0.1),
               detail={**common, "dcp_fsspec": med(worst("dcp save", "disk", [dcp_shard] * world))}),
        figure("object storage: local disk written per rank during a sharded load / its shard",
               worst("load", "disk", shards), baseline="peak size of the rank's TMPDIR", target=("<=", 0.1),
               detail={**common, "dcp_fsspec": med(worst("dcp load", "disk", [dcp_shard] * world))}),
        figure("object storage: sharded save throughput vs plain s3fs put", per_round("plain put", "save"),
               baseline="s3fs pipe_file of the shard's bytes from memory on each rank, same server",
               target=(">=", 0.9), detail={**common, "seconds": seconds,
                                           "dcp_fsspec": med(per_round("plain put", "dcp save"))}),
        figure("object storage: sharded load throughput vs plain s3fs get", per_round("plain get", "load"),
               baseline="s3fs cat_file of an object of the rank's shard bytes (the plain put's) into memory, same server", target=(">=", 0.9),
               detail={**common, "seconds": seconds, "dcp_fsspec": med(per_round("plain get", "dcp load"))}),
        figure("object storage: sharded save speed vs DCP over fsspec", per_round("dcp save", "save"),
               baseline="dcp.save with FsspecWriter(sync_files=False), same state, same server (DCP s / ours s)",
               target=(">=", 1.0), detail={"save_s": seconds["save"], "dcp_save_s": seconds["dcp save"]}),
        figure("object storage: sharded load speed vs DCP over fsspec", per_round("dcp load", "load"),
               baseline="dcp.load with FsspecReader, same state, same server (DCP s / ours s)", target=(">=", 1.0),
               detail={"load_s": seconds["load"], "dcp_load_s": seconds["dcp load"]}),
        figure("object storage: peak RSS above start of a sync sharded save / the shard", worst("save", "rss", shards),
               baseline="5 ms /proc/self/statm sampler, max over ranks; target: (64 MiB + 0.1x the shard) / the shard", target=("<=", round(max(rss_bound), 3)),
               detail={**common, "MiB": [max(r["rss"] for r in rnd["ranks"]) / MIB for rnd in runs["save"]],
                       "bound": "64 MiB + 0.1x the shard",
                       "dcp_fsspec": med(worst("dcp save", "rss", [dcp_shard] * world))}),
        figure("object storage: peak RSS above start of a sharded load / the shard", worst("load", "rss", shards),
               baseline="5 ms /proc/self/statm sampler, max over ranks; target: (64 MiB + 0.1x the shard) / the shard", target=("<=", round(max(rss_bound), 3)),
               detail={**common, "MiB": [max(r["rss"] for r in rnd["ranks"]) / MIB for rnd in runs["load"]],
                       "bound": "64 MiB + 0.1x the shard",
                       "dcp_fsspec": med(worst("dcp load", "rss", [dcp_shard] * world))}),
        figure("object storage: rank CPU per shard byte, sharded save vs plain s3fs put", cpu_ratio("save", "plain put"),
               baseline="process CPU seconds of each rank (all its threads) during the plain put of as many bytes",
               target=None, detail={"cpu_s_per_GB": cpu_per_gb, "dcp_fsspec": med(cpu_ratio("dcp save", "plain put"))}),
        figure("object storage: rank CPU per shard byte, sharded load vs plain s3fs get", cpu_ratio("load", "plain get"),
               baseline="process CPU seconds of each rank (all its threads) during the plain get of its shard",
               target=None, detail={"cpu_s_per_GB": cpu_per_gb, "dcp_fsspec": med(cpu_ratio("dcp load", "plain get"))}),
        figure("object storage: plain s3fs put vs itself (the harness's noise)", per_round("plain put 2", "plain put"),
               baseline="the same plain put, measured twice per round", target=None),
        figure("object storage: plain s3fs get vs itself (the harness's noise)", per_round("plain get 2", "plain get"),
               baseline="the same plain get, measured twice per round", target=None),
        figure("object storage: async save stall vs a synchronous save", per_round("async save call", "save"),
               baseline="synchronous sharded save to the same bucket", target=("<=", 0.1),
               detail={"async_call_s": seconds["async save call"], "sync_save_s": seconds["save"]}),
    ]
    return rows


if __name__ == "__main__":
    main()
