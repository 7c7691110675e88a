"""Where the time of an S3 transfer goes, per client (issue 43 item 6): s3fs (aiobotocore over aiohttp), obstore
(Rust, outside the GIL) and s3torchconnector's client (the AWS CRT), each moving the same object from and into
memory against moto's server and against the stub (``s3_stub.py``), each server in a process of its own.

For every client, server and operation: throughput (MB/s) and the client process's CPU seconds per GB moved
(``getrusage``, every thread, the client alone: each client runs in a fresh process), and the server's CPU seconds
per GB (``/proc/<pid>/stat``). Operations: ``put`` (8 MiB parts, 8 in flight, as the client's multipart upload
does them), ``get`` (one stream) and ``get ranges`` (8 MiB ranges, 8 in flight). obstore is in the ``s3`` and
``test`` extras (a load's ranged GETs go through it, ``checkpoint/io/transport_download.py``); s3torchconnectorclient
is no dependency: install it (or both) into a folder of their own and pass it:

    pip install --target /tmp/s3clients obstore s3torchconnectorclient
    flock /tmp/cpu.lock .venv/bin/python benchmarks/profile_s3.py --clients-path /tmp/s3clients [--json out.json]

Over plain http botocore hashes every request body (SHA-256 for the signature) and adds a CRC32 checksum;
``s3fs-lean`` is s3fs with both off (``payload_signing_enabled=False``, checksums ``when_required``), which is what
an https endpoint gets for the signature.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
BUCKET = "profile"
PART = 8 * 2**20
IN_FLIGHT = 8
CLIENTS = ("s3fs", "s3fs-lean", "obstore", "crt")


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", default=",".join(CLIENTS), help=f"comma-separated, of {', '.join(CLIENTS)}")
    parser.add_argument("--servers", default="stub,moto")
    parser.add_argument("--stub-mb", type=int, default=256, help="object size against the stub")
    parser.add_argument("--moto-mb", type=int, default=48, help="object size against moto (about 13 MB/s)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--clients-path", default=None, help="a folder holding obstore / s3torchconnectorclient")
    parser.add_argument("--json", default=None)
    parser.add_argument("--client", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--endpoint", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--server-pid", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--mb", type=int, default=None, help=argparse.SUPPRESS)
    return parser.parse_args()


# ------------------------------------------------------------------------------------------------ the servers


def _start(server: str) -> tuple[subprocess.Popen, str]:
    if server == "stub":
        command = [sys.executable, str(HERE / "s3_stub.py")]
    else:
        command = [sys.executable, "-c", (
            "from moto.server import ThreadedMotoServer; import threading\n"
            "s = ThreadedMotoServer(ip_address='127.0.0.1', port=0, verbose=False); s.start()\n"
            "print('listening on http://%s:%d' % s.get_host_and_port(), flush=True); threading.Event().wait()")]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)  # moto logs each request
    line = process.stdout.readline().strip()
    if not line.startswith("listening on "):
        process.kill()
        raise SystemExit(f"{server} did not start: {line!r}")
    return process, line.removeprefix("listening on ")


def _server_cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    args = _parse()
    if args.client:
        _client(args)
        return
    rows = []
    for server in args.servers.split(","):
        process, endpoint = _start(server)
        try:
            import boto3

            boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="k", aws_secret_access_key="k",
                         region_name="us-east-1").create_bucket(Bucket=BUCKET)
            mb = args.stub_mb if server == "stub" else args.moto_mb
            for client in args.clients.split(","):
                env = {**os.environ, "AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "k",
                       "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": endpoint,
                       "AWS_EC2_METADATA_DISABLED": "true"}
                command = [sys.executable, __file__, "--client", client, "--endpoint", endpoint, "--mb", str(mb),
                           "--rounds", str(args.rounds), "--server-pid", str(process.pid)]
                if args.clients_path:
                    command += ["--clients-path", args.clients_path]
                run = subprocess.run(command, env=env, capture_output=True, text=True)
                if run.returncode != 0:
                    print(f"[profile_s3] {client} on {server} failed:\n{run.stderr[-2000:]}", flush=True)
                    continue
                for row in json.loads(run.stdout.strip().splitlines()[-1]):
                    rows.append({"server": server, "client": client, "MB": mb, **row})
                    print(f"{server:5} {client:10} {row['op']:11} {row['MB_s']:8.1f} MB/s  client"
                          f" {row['cpu_s_per_GB']:6.2f} CPU-s/GB  server {row['server_cpu_s_per_GB']:6.2f} CPU-s/GB"
                          f"  ({row['MB_s_min']:.1f}-{row['MB_s_max']:.1f} MB/s)", flush=True)
        finally:
            process.kill()
            process.wait()
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


# ------------------------------------------------------------------------------------------------ the clients


def _operations(client: str, endpoint: str) -> dict[str, Callable[..., Any]]:
    """put(key, data), get(key, size) and get_ranges(key, size) for one client, each from and into memory."""
    ranges = lambda size: [(s, min(s + PART, size)) for s in range(0, size, PART)]  # noqa: E731
    if client.startswith("s3fs"):
        import s3fs

        config = ({"s3": {"payload_signing_enabled": False}, "request_checksum_calculation": "when_required",
                   "response_checksum_validation": "when_required"} if client == "s3fs-lean" else None)
        fs = s3fs.S3FileSystem(skip_instance_cache=True, config_kwargs=config)
        return {
            "put": lambda key, data: fs.pipe_file(f"{BUCKET}/{key}", data, chunksize=PART, max_concurrency=IN_FLIGHT),
            "get": lambda key, size: fs.cat_file(f"{BUCKET}/{key}"),
            "get ranges": lambda key, size: fs.cat_file(f"{BUCKET}/{key}", chunksize=PART, max_concurrency=IN_FLIGHT),
        }
    if client == "obstore":
        import obstore
        from obstore.store import S3Store

        store = S3Store(BUCKET, endpoint=endpoint, access_key_id="k", secret_access_key="k", region="us-east-1",
                        virtual_hosted_style_request=False, client_options={"allow_http": True})
        return {
            "put": lambda key, data: obstore.put(store, key, data, chunk_size=PART, max_concurrency=IN_FLIGHT,
                                                 use_multipart=True),
            "get": lambda key, size: obstore.get(store, key).bytes(),
            "get ranges": lambda key, size: obstore.get_ranges(
                store, key, starts=[a for a, _ in ranges(size)], ends=[b for _, b in ranges(size)], coalesce=0),
        }
    if client == "crt":
        from s3torchconnectorclient._mountpoint_s3_client import MountpointS3Client

        crt = MountpointS3Client("us-east-1", endpoint=endpoint, force_path_style=True, part_size=PART)

        def put(key: str, data: bytes) -> None:
            stream = crt.put_object(BUCKET, key)
            stream.write(data)
            stream.close()

        def get(key: str, size: int) -> bytes:  # the CRT splits a whole-object GET into part-sized ranges itself
            return b"".join(crt.get_object(BUCKET, key))

        return {"put": put, "get": get}
    raise SystemExit(f"--client: unknown {client!r}; choose from {', '.join(CLIENTS)}")


def _client(args: argparse.Namespace) -> None:
    if args.clients_path:
        sys.path.insert(0, args.clients_path)
    operations = _operations(args.client, args.endpoint)
    size = args.mb * 2**20
    data = os.urandom(size)
    key = f"{args.client}/object.bin"
    operations["put"](key, data)  # warm-up: connections, imports, the object the gets read
    rows = []
    for op, call in operations.items():
        walls, cpus, servers = [], [], []
        for _ in range(args.rounds):
            usage = resource.getrusage(resource.RUSAGE_SELF)
            server = _server_cpu(args.server_pid)
            start = time.perf_counter()
            got = call(key, data) if op == "put" else call(key, size)
            walls.append(time.perf_counter() - start)
            after = resource.getrusage(resource.RUSAGE_SELF)
            cpus.append(after.ru_utime + after.ru_stime - usage.ru_utime - usage.ru_stime)
            servers.append(_server_cpu(args.server_pid) - server)
            if op != "put" and (sum(map(len, got)) if isinstance(got, list) else len(got)) != size:
                raise SystemExit(f"{args.client} {op}: got the wrong number of bytes")
        gb = size / 1e9
        speeds = [size / 1e6 / w for w in walls]
        rows.append({"op": op, "MB_s": statistics.median(speeds), "MB_s_min": min(speeds), "MB_s_max": max(speeds),
                     "cpu_s_per_GB": statistics.median(cpus) / gb,
                     "server_cpu_s_per_GB": statistics.median(servers) / gb, "rounds": args.rounds})
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
