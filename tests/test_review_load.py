"""Review of issue 43's streaming load (defects 3 and 5): a sharded load fetches whole only its small objects, each
within a bound, and the ranged GETs of a load share the caller's one retry budget."""

from __future__ import annotations

import uuid

import fsspec

from lightning_fsdp.checkpoint.io import ranged_read, remote_errors
from lightning_fsdp.checkpoint.io.remote_source import RemoteObjects


def test_ranged_gets_share_the_callers_budget():
    # Before: the GETs ran on pool threads without the caller's context, so each got a fresh budget of the bound.
    fs = fsspec.filesystem("memory")
    target = f"memory://review-{uuid.uuid4().hex[:8]}/ck"
    fs.pipe_file(f"{target}/.tok/__0_0.distcp", b"x" * 4096)
    seen = []

    def retry(step):
        return remote_errors.retrying(fs, target, "downloading",
                                      lambda: (seen.append(remote_errors._SHARED.get()), step())[1])

    source = RemoteObjects(fs, target, f"{target}/.tok", "sharded", {"__0_0.distcp": (4096, None)}, retry=retry)
    with remote_errors.one_budget():
        outer = remote_errors._SHARED.get()
        ranged_read.fetch(source, [("__0_0.distcp", 0, 2048, lambda v: None),
                                   ("__0_0.distcp", 3000, 4096, lambda v: None)], range_size=1024, ranges_in_flight=2)
    assert outer is not None and len(seen) >= 3
    assert all(budget is outer for budget in seen), seen
