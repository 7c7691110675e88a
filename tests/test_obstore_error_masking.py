"""An S3 error body that echoes the request's signing inputs is not shown (issue 43, left over from the review of
the obstore reads): obstore puts the whole body in its message, and AWS's ``SignatureDoesNotMatch`` body names the
access key id, the string to sign and the signature. The error we raise masks them, and obstore's own exception is
not chained to it, so neither the message nor a printed traceback shows them. In this process, against a one-route
HTTP server that refuses every request with such a body."""

from __future__ import annotations

import http.server
import threading
import traceback

import pytest

from skips import require

require("obstore")
require("s3fs")

KEY_ID = "AKIAh5ECHOEDKEYID77"
SIGNATURE = "5d41402abc4b2a76b9719d911017c592"
# One line, no XML declaration: the first line of the message is the whole body (some servers answer so).
BODY = ("<Error><Code>SignatureDoesNotMatch</Code><Message>The request signature we calculated does not match the"
        f" signature you provided.</Message><AWSAccessKeyId>{KEY_ID}</AWSAccessKeyId><StringToSign>AWS4-HMAC-SHA256"
        f" 20261129T000000Z {KEY_ID}/20261129/us-east-1/s3/aws4_request</StringToSign><SignatureProvided>{SIGNATURE}"
        "</SignatureProvided><RequestId>4442587FB7D0A2F9</RequestId></Error>").encode()


class _Refuses(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 (the handler's name)
        self.send_response(403)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(BODY)))
        self.end_headers()
        self.wfile.write(BODY)

    do_HEAD = do_GET

    def log_message(self, *args):
        pass


@pytest.fixture
def endpoint():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Refuses)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    thread.join(timeout=10)


@pytest.mark.single_process
def test_a_signature_refusal_neither_says_nor_chains_the_echoed_key_id(endpoint, monkeypatch):
    import s3fs

    from lightning_fsdp.checkpoint.io import transport_download

    monkeypatch.delenv(transport_download.VARIABLE, raising=False)
    fs = s3fs.S3FileSystem(key=KEY_ID, secret="not-shown", endpoint_url=endpoint,
                           client_kwargs={"region_name": "us-east-1"}, skip_instance_cache=True)
    fast = transport_download.client_for(fs)
    assert fast is not None, "the filesystem should translate to obstore"
    view = memoryview(bytearray(16))
    with pytest.raises(PermissionError) as caught:
        fast.read("bkt/obj", 0, 16, view, [0], committed=16)
    shown = "".join(traceback.format_exception(caught.value))
    assert "HINT: check the credentials" in shown and "SignatureDoesNotMatch" in shown  # the reason stays
    assert KEY_ID not in shown and SIGNATURE not in shown, shown
    assert caught.value.__cause__ is None and caught.value.__suppress_context__


@pytest.mark.single_process
def test_the_masking_keeps_the_elements_and_what_is_not_a_signing_input():
    from lightning_fsdp.checkpoint.io.transport_download import masked_body

    masked = masked_body(BODY.decode() + "\n" + BODY.decode().replace('"', '\\"'))
    assert KEY_ID not in masked and SIGNATURE not in masked and "20261129T000000Z" not in masked
    assert masked.count("<AWSAccessKeyId>***</AWSAccessKeyId>") == 2 and "<RequestId>4442587FB7D0A2F9" in masked


TOKEN = "FwoGZXIvYXdzEXAMPLESESSIONTOKENsecretpart0123"


@pytest.mark.single_process
@pytest.mark.parametrize("body", [
    # AWS's answers to an expired or malformed session token repeat it (reviewer's finding: it was shown).
    f"<Error><Code>ExpiredToken</Code><Message>The provided token has expired.</Message><Token-0>{TOKEN}</Token-0>"
    "<RequestId>R1</RequestId></Error>",
    f"<Error><Code>InvalidToken</Code><Message>bad</Message><SessionToken>{TOKEN}</SessionToken></Error>",
    f"<Error><Code>AccessDenied</Code><X-Amz-Security-Token>{TOKEN}</X-Amz-Security-Token></Error>",
    # A body cut before the closing tag (a message cut to a length) still hides what the element held.
    f"<Error><Code>SignatureDoesNotMatch</Code><Message>{'x' * 300}</Message><SignatureProvided>{TOKEN}",
])
def test_the_session_token_and_cut_elements_are_masked(body):
    from lightning_fsdp.checkpoint.io.transport_download import masked_body

    masked = masked_body(body)
    assert TOKEN[:8] not in masked, masked
    assert "<Code>" in masked and "***" in masked  # the error's reason stays, the element is named
