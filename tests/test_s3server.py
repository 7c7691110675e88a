"""The suite's S3 server (``tests/s3server.py``, fixture ``s3_server``): a real endpoint that keeps what it is given,
refuses a conditional write over an existing object, and is reached from a launch's forked processes through the
environment alone."""

from __future__ import annotations

import json
import subprocess

import pytest

import forkserver
import launch

pytestmark = pytest.mark.single_process


def test_an_object_put_is_read_back_exactly(s3_server):
    fs = s3_server.filesystem()
    bucket = s3_server.bucket()
    data = bytes(range(256)) * 1000
    fs.pipe_file(f"{bucket}/a/b.bin", data)
    assert s3_server.filesystem().cat_file(f"{bucket}/a/b.bin") == data
    assert s3_server.filesystem().cat_file(f"{bucket}/a/b.bin", start=10, end=20) == data[10:20]
    assert s3_server.filesystem().ls(bucket) == [f"{bucket}/a"]


def test_a_conditional_write_over_an_existing_object_is_refused_with_412(s3_server):
    from botocore.exceptions import ClientError

    bucket = s3_server.bucket()
    client = s3_server.client()
    client.put_object(Bucket=bucket, Key="COMMIT", Body=b"first", IfNoneMatch="*")
    with pytest.raises(ClientError) as refused:
        client.put_object(Bucket=bucket, Key="COMMIT", Body=b"second", IfNoneMatch="*")
    assert refused.value.response["ResponseMetadata"]["HTTPStatusCode"] == 412
    # s3fs's exclusive write (what a store's commit uses) sends the same header and says so as FileExistsError.
    with pytest.raises(FileExistsError):
        s3_server.filesystem().pipe_file(f"{bucket}/COMMIT", b"third", mode="create")
    assert client.get_object(Bucket=bucket, Key="COMMIT")["Body"].read() == b"first"


_PROBE = """
import json, os, sys
import s3fs
fs = s3fs.S3FileSystem(skip_instance_cache=True)  # endpoint and credentials from the environment only
print(json.dumps({"forked": "forkserver/server.py" in open(f"/proc/{os.getppid()}/cmdline").read(),
                  "data": fs.cat_file(sys.argv[1]).decode()}))
"""


def test_a_forked_process_reaches_the_server_from_the_environment_alone(s3_server, tmp_path):
    # A launch's processes are forked from a server that started without the AWS_* variables (the pools' servers
    # start before any fixture): that server must still serve them, since no import it ran reads an AWS_* variable.
    bucket = s3_server.bucket()
    s3_server.filesystem().pipe_file(f"{bucket}/hello", b"from the pytest process")
    plain = {k: v for k, v in launch.worker_env(tmp_path).items() if not k.startswith("AWS_")}
    assert "AWS_ENDPOINT_URL" not in plain
    forkserver.wait_until_serving(forkserver.prewarm(plain), timeout_s=120)
    script = tmp_path / "probe.py"
    script.write_text(_PROBE)
    run = subprocess.run([forkserver.python(), str(script), f"{bucket}/hello"], env={**plain, **s3_server.env},
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    got = json.loads(run.stdout.splitlines()[-1])
    assert got["data"] == "from the pytest process"
    if forkserver.enabled():
        assert got["forked"], f"the AWS_* variables made the process real: {run.stderr}"
