"""Two ranks against a real S3 server while the store stops answering (issue 45 items 5 and 8): rank 0 reaches the
server through a proxy it runs itself (``store_proxy.py``), rank 1 straight; ``LFSDP_STORE_TIMEOUT_S`` (the bound)
comes in the environment from ``tests/test_store_outages.py``."""

from __future__ import annotations

import os
import time
import uuid

import torch

from common import make_fabric
from harness import TIMEOUT, case, rank, run_cases
from models import TinyTransformer
from store_proxy import StoreProxy

WORLD = 2
BUCKET = os.environ.get("LFSDP_TEST_BUCKET", "ckpt")


@case
def a_stalled_store_while_rank_0_verifies_is_the_same_error_on_every_rank_and_retention_deletes_nothing():
    """Rank 0 verifies the newest checkpoint while rank 1 waits in a collective; the store stops answering. The old
    code left rank 1 waiting into the process group's timeout (rank 0 sat in the client's retries), and a run that
    went on from step 0 deleted the real checkpoint at its first save with ``keep_last=1``."""
    import s3fs

    from lightning_fsdp.step_checkpoints import StepCheckpoints

    proxy = StoreProxy(os.environ["AWS_ENDPOINT_URL"]) if rank() == 0 else None
    try:
        fabric = make_fabric(WORLD, storage_options={"endpoint_url": proxy.endpoint} if proxy else None)
        torch.manual_seed(0)
        plain = TinyTransformer()
        model, opt = fabric.setup(plain, torch.optim.AdamW(plain.parameters(), lr=1e-2))
        directory = f"s3://{BUCKET}/{fabric.broadcast(uuid.uuid4().hex[:8])}/run"
        # Saved without retention, which would remember the save as verified: as in a requeued job, this
        # process has not read the checkpoint yet, and must verify it.
        StepCheckpoints(fabric, directory).save({"model": model, "optimizer": opt, "step": 1})
        checkpoints = StepCheckpoints(fabric, directory, keep_last=1)
        first = f"{directory}/step-00000001"

        if proxy is not None:
            proxy.set("stall-objects")  # the listing and COMMIT answer; the download to verify does not
        state = {"model": model, "optimizer": opt, "step": 0}
        started = time.monotonic()
        try:
            checkpoints.resume(state)
        except ConnectionError as err:
            message, elapsed = str(err), time.monotonic() - started
        else:
            raise AssertionError("resume returned while the store did not answer")
        assert "failed on rank 0" in message and first in message and "HINT" in message, message
        assert "not taken for damaged" in message and "Timed out" not in message, message
        assert elapsed < TIMEOUT.total_seconds(), elapsed  # ended by the store's bound, not by the group's timeout
        assert state["step"] == 0

        # A run that went on anyway: its save commits, and its retention deletes nothing.
        if proxy is not None:
            proxy.set("pass")
        state["step"] = 2
        try:
            checkpoints.save(state)
        except RuntimeError as err:
            refused = str(err)
        else:
            raise AssertionError("retention ran in a process whose resume could not read the store")
        assert "deletes nothing in this process" in refused and "HINT" in refused, refused
        listed = sorted(p.rsplit("/", 1)[-1] for p in s3fs.S3FileSystem(skip_instance_cache=True).ls(directory))
        assert listed == ["step-00000001", "step-00000002"], listed

        # Found again once the store answers: retention is back on.
        assert checkpoints.latest() == f"{directory}/step-00000002"
        state["step"] = 3
        checkpoints.save(state)
        listed = sorted(p.rsplit("/", 1)[-1] for p in s3fs.S3FileSystem(skip_instance_cache=True).ls(directory))
        assert listed == ["step-00000003"], listed
        return {"error": message[:400], "seconds": round(elapsed, 1)}
    finally:
        if proxy is not None:
            proxy.close()


if __name__ == "__main__":
    run_cases()
