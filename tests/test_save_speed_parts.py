"""The memory of a streamed upload (issue 43 item 5): while parts are in flight, the client holds no copy of a part
beyond the sink's own buffers (``(parts_in_flight + 1) * part_size``). Handed a ``bytearray`` as ``Body``, aiohttp
sliced it to its Content-Length (a copy), joined it with the headers (another) and asyncio's transport kept what the
socket did not take at once (a third): a sharded save's peak RSS was ~80 MiB above start for 40 MiB of buffers
(``transport_upload.PartBody`` says how the body is handed over now).

Measured with tracemalloc in a child process (a forked one, so no imports to wait for: the endpoint and keys are
arguments, not ``AWS_*`` variables, so the fork server's environment fits): the server (moto's, the
suite's ``s3_server``) runs in the pytest process, whose own allocations would count too."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import forkserver  # noqa: E402
from launch import script_env  # noqa: E402

pytestmark = pytest.mark.single_process

MiB = 2**20
PART, WINDOW, PARTS = 4 * MiB, 2, 6
PIECE = MiB  # transport_upload.PIECE: the parts are larger, so a copy of a part shows
HANG_S = 120

_CHILD = r'''
import json, os, sys, tracemalloc
from lightning_fsdp.checkpoint.io.sink import open_upload
from lightning_fsdp.checkpoint.io.transfers import Transfers, set_transfers
from lightning_fsdp.checkpoint.io.urls import filesystem

part, window, parts, url, endpoint = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
set_transfers(Transfers(part_size=part, parts_in_flight=window))
fs = filesystem("s3://", {"endpoint_url": endpoint, "key": "testing", "secret": "testing"})
data = os.urandom(part * parts + part // 2)  # the last part shorter
fs.ls(url.rsplit("/", 1)[0])  # the client and its connection exist before the measurement starts
tracemalloc.start()
base = tracemalloc.get_traced_memory()[0]
with open_upload(fs, url) as sink:
    view = memoryview(data)
    for start in range(0, len(view), 256 * 1024):  # in torch.save's sort of pieces
        sink.write(view[start:start + 256 * 1024])
peak = tracemalloc.get_traced_memory()[1] - base
tracemalloc.stop()
same = fs.cat_file(url) == data
print(json.dumps({"peak": peak, "same": same, "peak_mib": peak / 2**20, "peak_in_flight": sink.peak_in_flight}))
'''


@pytest.fixture
def moto_parts(monkeypatch):
    """moto refuses parts under 5 MiB but the last; lowered in this process (the server's) for 4 MiB parts."""
    import moto.s3.models

    monkeypatch.setattr(moto.s3.models, "S3_UPLOAD_PART_MIN_SIZE", PART)


def test_parts_in_flight_are_not_copied_by_the_client(s3_server, moto_parts, tmp_path):
    script = tmp_path / "upload.py"
    script.write_text(_CHILD)
    url = f"s3://{s3_server.bucket()}/shard.distcp"
    done = subprocess.run([forkserver.python(), str(script), str(PART), str(WINDOW), str(PARTS), url,
                           s3_server.endpoint], env=script_env(), capture_output=True, text=True, timeout=HANG_S)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["same"], "the object differs from the bytes written"
    assert result["peak_in_flight"] == WINDOW  # the window was full: the bound below is the loaded one
    # The sink's buffers, plus per part in flight what the client may copy of one piece (aiohttp's join with the
    # headers, the transport's buffer), plus 1 MiB for everything else (botocore's request, the connection).
    bound = (WINDOW + 1) * PART + WINDOW * 2 * PIECE + MiB
    assert result["peak"] <= bound, (
        f"a {PARTS + 1}-part upload held {result['peak'] / MiB:.1f} MiB at its peak, over the "
        f"{bound / MiB:.1f} MiB of the sink's buffers and one piece per part in flight: the client copies parts")


def test_the_piece_is_within_the_bound_the_memory_test_allows():
    from lightning_fsdp.checkpoint.io import transport_upload

    assert 64 * 1024 <= transport_upload.PIECE <= PIECE
