"""The parts in flight of one upload share one retry budget (``LFSDP_STORE_TIMEOUT_S``), and the time they fail
through together is spent once: four parts waiting out one outage side by side spend its duration, not four times
it. Found by review (2026-11-28): the reads' budget (``remote_errors._Budget.spend``) counted overlapping failures
once, the uploads' did not, so an upload with 4 parts in flight gave up at about a quarter of the bound."""

from __future__ import annotations

import asyncio
import time

import pytest

pytestmark = pytest.mark.single_process


class _Unanswering:
    """An S3 client whose every request waits a little, then fails as a dropped connection does."""

    loop = None

    def split_path(self, url):
        return "bucket", "key", None

    async def _call_s3(self, method, **kwargs):
        await asyncio.sleep(0.25)
        raise ConnectionError("the store did not answer")


@pytest.mark.parametrize("parts", [1, 4])
def test_parts_failing_together_spend_the_bound_once(monkeypatch, parts):
    from lightning_fsdp.checkpoint.io.transport_upload import S3Upload

    monkeypatch.setenv("LFSDP_STORE_TIMEOUT_S", "2")  # each request may wait 1 s; retries end once 1 s is left

    async def upload():
        up = S3Upload(_Unanswering(), "s3://bucket/key")
        up.upload_id = "upload"
        started = time.monotonic()
        results = await asyncio.gather(*(up.put_part(i + 1, b"x" * 16) for i in range(parts)),
                                       return_exceptions=True)
        return up.budget.spent, time.monotonic() - started, results

    spent, elapsed, results = asyncio.run(upload())
    assert all(isinstance(r, ConnectionError) and "HINT" in str(r) for r in results), results
    # The budget counts time that passed: never more than the wall clock (old code, 4 parts: 1.5 s spent in 0.5 s).
    assert spent <= elapsed + 0.01, (spent, elapsed)
