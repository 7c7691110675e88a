"""The single PUTs of a save through obstore (``checkpoint/io/transport_put.py``, issue 43 item 6), in this process
against the ledger's S3 server (``tests/ledger.py``): the same conditional PUT with the same mark, the same errors
and refusals as through s3fs, our retries the only ones (one request at the server per attempt we count), s3fs
kept wherever the loads keep it, and what an S3 error body echoes of the signature masked."""

from __future__ import annotations

import traceback
import uuid

import pytest
from fsspec.asyn import sync

from lightning_fsdp.checkpoint.io import remote_errors, transport_download, transport_put, transport_upload
from lightning_fsdp.checkpoint.io.transport_upload import MARK, S3Upload

pytestmark = pytest.mark.single_process
KEY = "fastput"  # the PUTs sign with their own key: the ledger counts them apart


@pytest.fixture()
def target(ledger, monkeypatch):
    """A filesystem built as a store builds its own (client retries off, timeouts within the bound), and a fresh
    prefix in a bucket of the ledger's server."""
    import s3fs

    for key, value in ledger.env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", KEY)
    monkeypatch.delenv(transport_download.VARIABLE, raising=False)
    fs = remote_errors.bounded_filesystem(s3fs.S3FileSystem, "s3", {})
    url = f"s3://{ledger.bucket()}/run-{uuid.uuid4().hex[:8]}/.tok"
    ledger.reset()
    return fs, url


class _Counted:
    """Counts the attempts each client made (obstore's ``FastPuts.put``, s3fs's ``_call_s3`` by method)."""

    def __init__(self, monkeypatch, fs) -> None:
        self.fast: list[str] = []
        self.s3fs: list[str] = []
        put, call = transport_put.FastPuts.put, fs._call_s3

        async def fast(this, bucket, key, *args, **kwargs):
            self.fast.append(key)
            return await put(this, bucket, key, *args, **kwargs)

        async def plain(method, *args, **kwargs):
            self.s3fs.append(method)
            return await call(method, *args, **kwargs)

        monkeypatch.setattr(transport_put.FastPuts, "put", fast)
        monkeypatch.setattr(fs, "_call_s3", plain)


def _put(fs, url: str, data: bytes, upload: S3Upload = None) -> S3Upload:
    upload = upload or S3Upload(fs, url)
    sync(fs.loop, lambda: upload.put_whole(bytearray(data)))
    return upload


def test_a_single_put_goes_through_obstore_conditional_and_marked(target, ledger, monkeypatch):
    fs, url = target
    counted = _Counted(monkeypatch, fs)
    data = bytes(range(256)) * 4096 + b"end"
    upload = _put(fs, f"{url}/__0_0.distcp", data)
    # Before transport_put, every PUT went through s3fs's client.
    assert counted.fast == [url.split("/", 3)[3] + "/__0_0.distcp"] and counted.s3fs == []
    assert upload.requests == 1
    records = ledger.records(KEY)
    assert [(r.method, r.query, r.status, r.bytes_in) for r in records] == [("PUT", {}, 200, len(data))]
    bucket, key, _ = fs.split_path(f"{url}/__0_0.distcp")
    head = ledger.client().head_object(Bucket=bucket, Key=key)
    assert head["Metadata"] == {MARK: upload.mark} and head["ContentLength"] == len(data)
    assert ledger.client().get_object(Bucket=bucket, Key=key)["Body"].read() == data


def test_a_key_another_writer_holds_is_refused_and_said_as_before(target, ledger, monkeypatch):
    fs, url = target
    counted = _Counted(monkeypatch, fs)
    bucket, key, _ = fs.split_path(f"{url}/__0_0.distcp")
    ledger.client(key="other").put_object(Bucket=bucket, Key=key, Body=b"theirs")
    with pytest.raises(FileExistsError, match="Another save committed .* while this one was uploading"):
        _put(fs, f"{url}/__0_0.distcp", b"ours")
    assert counted.fast and counted.s3fs == ["head_object"]  # the 412 was checked: not ours (no mark of this upload)
    assert [r.status for r in ledger.records(KEY, method="PUT")] == [412]
    assert ledger.client().get_object(Bucket=bucket, Key=key)["Body"].read() == b"theirs"


def test_a_put_whose_reply_was_lost_is_retried_once_and_recognised_as_ours(target, ledger, monkeypatch):
    fs, url = target
    counted = _Counted(monkeypatch, fs)
    ledger.lose_reply(f"PUT {fs.split_path(url)[0]}/*")
    upload = _put(fs, f"{url}/__0_0.distcp", b"x" * 1000)
    # Applied, its answer lost; sent again (our retry, obstore's are off), refused (412), found ours by the HEAD.
    assert [r.status for r in ledger.records(KEY, method="PUT")] == [200, 412]
    assert len(counted.fast) == 2 and counted.s3fs == ["head_object"] and upload.requests == 3


def test_our_retries_are_the_only_ones_and_the_error_names_them(target, ledger, monkeypatch):
    fs, url = target
    _Counted(monkeypatch, fs)
    monkeypatch.setattr(remote_errors, "ATTEMPTS", 3)
    monkeypatch.setattr(remote_errors, "BACKOFF_S", 0.01)
    ledger.fail(f"PUT {fs.split_path(url)[0]}/*", status=503, times=None)
    with pytest.raises(ConnectionError, match=r"failed while uploading to it, after 3 attempts") as raised:
        _put(fs, f"{url}/__0_0.distcp", b"x" * 1000)
    assert "HINT" in str(raised.value)
    # Each attempt we counted is one request at the server: obstore retried none of them itself.
    assert len(ledger.records(KEY, method="PUT")) == 3


def test_a_refusal_is_said_as_s3fs_says_it_with_the_signature_masked(target, monkeypatch):
    import obstore
    from obstore.exceptions import PermissionDeniedError

    fs, url = target
    body = ("<Error><Code>SignatureDoesNotMatch</Code><AWSAccessKeyId>AKIASECRETID</AWSAccessKeyId>"
            "<StringToSign>AWS4-HMAC-SHA256 signed</StringToSign><SignatureProvided>abc123</SignatureProvided></Error>")

    async def refused(*args, **kwargs):
        raise PermissionDeniedError(f"Server returned non-2xx status code: 403 Forbidden: {body}")

    monkeypatch.setattr(obstore, "put_async", refused)
    with pytest.raises(PermissionError, match="Access to .* was refused while uploading to it") as raised:
        _put(fs, f"{url}/__0_0.distcp", b"x")
    said = "".join(traceback.format_exception(raised.value))
    assert "SignatureDoesNotMatch" in said
    assert all(secret not in said for secret in ("AKIASECRETID", "signed", "abc123")), said


def test_s3fs_is_kept_where_the_loads_keep_it(target, ledger, monkeypatch):
    import s3fs

    fs, url = target
    monkeypatch.setenv(transport_download.VARIABLE, "s3fs")
    plain = remote_errors.bounded_filesystem(s3fs.S3FileSystem, "s3", {})
    assert transport_put.puts_for(plain) is None
    counted = _Counted(monkeypatch, plain)
    _put(plain, f"{url}/a", b"plain")
    assert counted.fast == [] and counted.s3fs == ["put_object"]
    monkeypatch.delenv(transport_download.VARIABLE)
    sse = remote_errors.bounded_filesystem(s3fs.S3FileSystem, "s3",
                                           {"s3_additional_kwargs": {"ServerSideEncryption": "AES256"}})
    assert transport_put.puts_for(sse) is None  # a setting obstore would not send: the whole save stays on s3fs
    assert transport_put.puts_for(fs) is transport_put.puts_for(fs) is not None  # made once per filesystem


def test_an_answer_obstore_cannot_place_sends_the_put_through_s3fs_from_then_on(target, ledger, monkeypatch):
    fs, url = target
    counted = _Counted(monkeypatch, fs)

    async def unplaced(*args, **kwargs):
        raise transport_download.Unplaced("a redirect")

    fast = transport_put.puts_for(fs)
    monkeypatch.setattr(fast, "put", unplaced)
    _put(fs, f"{url}/a", b"first")
    _put(fs, f"{url}/b", b"second")
    assert not fast.on and counted.s3fs == ["put_object", "put_object"]
    assert [r.status for r in ledger.records(KEY, method="PUT")] == [200, 200]


@pytest.mark.parametrize("endpoint, options, signed", [
    ("http://127.0.0.1:9", {}, True),  # botocore signs the payload over plain HTTP
    ("https://s3.example.com", {}, False),  # and not over HTTPS (TLS guards it)
    ("https://s3.example.com", {"config_kwargs": {"s3": {"payload_signing_enabled": True}}}, True),
])
def test_the_payload_is_signed_where_botocore_signs_it(monkeypatch, endpoint, options, signed):
    import s3fs

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret")
    monkeypatch.delenv(transport_download.VARIABLE, raising=False)
    fs = remote_errors.bounded_filesystem(s3fs.S3FileSystem, "s3", {"endpoint_url": endpoint,
                                                                      "client_kwargs": {"region_name": "us-east-1"},
                                                                      **options})
    fast = transport_put.puts_for(fs)
    assert fast is not None and fast._kwargs["retry_config"]["max_retries"] == 0
    assert fast._kwargs.get("unsigned_payload", False) is (not signed)
    assert fast._kwargs["endpoint"] == endpoint
    assert transport_upload.S3Upload(fs, "s3://bucket/key").fast is fast


def test_a_filesystem_equal_to_an_earlier_one_but_for_another_endpoint_gets_its_own_client(monkeypatch):
    # fsspec filesystems compare equal by their arguments alone; the endpoint may come from the environment, read
    # when each is made. The clients were cached by equality, so the second got the first one's endpoint (in the
    # suite: its PUTs and GETs went to another test's server).
    import s3fs

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.delenv(transport_download.VARIABLE, raising=False)
    made = []
    for endpoint in ("http://127.0.0.1:9", "http://127.0.0.1:10"):
        monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
        fs = remote_errors.bounded_filesystem(s3fs.S3FileSystem, "s3", {"skip_instance_cache": True})
        made.append((fs, transport_put.puts_for(fs)))  # used while the environment names its endpoint
    (first, first_puts), (second, second_puts) = made
    assert first is not second and first == second
    assert first_puts._kwargs["endpoint"] == "http://127.0.0.1:9"
    assert second_puts._kwargs["endpoint"] == "http://127.0.0.1:10"
    assert transport_download.client_for(second)._kwargs["endpoint"] == "http://127.0.0.1:10"
    assert transport_put.puts_for(first) is first_puts  # still one per filesystem
