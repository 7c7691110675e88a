"""Small needs far apart for their size merge into fewer ranged GETs, within a fetch-wide allowance of dropped bytes
(issue 43 item 6, load side). In process, through fsspec's local filesystem.

Rank 0 of ``benchmarks/object_storage.py`` reads ~70 replicated scalars (an item of ~1.5 KB each, in three needs)
that DCP saved among rank 1's tensors: 103 of its 114 requests were under 64 KiB, because a gap merges only when it
is at most 1/16 of the merged range. Each request costs a round trip and the server's time per request (~1.2 ms on
the benchmark's server, whatever its size), so that rank ended its reads ~50 ms after the other. Gaps of up to
``MAX_GAP`` now merge while the bytes dropped stay within 1/256 of what the fetch needs: 45 requests there, 0.64 MiB
more of 82 MiB.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.single_process

KIB, MIB = 2**10, 2**20


def test_a_gap_the_ratio_refuses_merges_while_the_spare_bytes_last():
    from lightning_fsdp.checkpoint.io.ranged_read import MAX_GAP, coalesce

    spans = [(i * 100 * KIB, i * 100 * KIB + KIB) for i in range(4)]  # 1 KiB needs, 99 KiB apart
    assert coalesce(spans, 8 * MIB) == spans  # the ratio alone: four requests, as before
    spare = [250 * KIB]
    assert coalesce(spans, 8 * MIB, spare) == [(0, 201 * KIB), (300 * KIB, 301 * KIB)]  # two gaps fit, not three
    assert spare == [250 * KIB - 2 * 99 * KIB]
    # Never past MAX_GAP or range_size, whatever is spare.
    far = [(0, KIB), (KIB + MAX_GAP + 1, 2 * KIB + MAX_GAP + 1)]
    assert coalesce(far, 8 * MIB, [MIB]) == far
    assert coalesce(spans, 100 * KIB, [MIB]) == spans


def _source(folder: Path) -> Any:
    import fsspec

    from lightning_fsdp.checkpoint.io.remote_source import RemoteObjects

    objects = {p.name: (p.stat().st_size, None) for p in folder.iterdir()}
    return RemoteObjects(fsspec.filesystem("file"), str(folder), str(folder), "sharded", objects, folder)


def test_scattered_small_items_cost_fewer_requests_for_few_more_bytes(tmp_path, monkeypatch):
    from lightning_fsdp.checkpoint.io import ranged_read

    data = bytes(range(256)) * (12 * 4 * KIB)  # 12 MiB
    (tmp_path / "other").write_bytes(data[:4 * MIB])  # another rank's object: scalars among its tensors
    (tmp_path / "own").write_bytes(data)  # the rank's own object, read whole
    # 40 items of 1.5 KB (head, 4-byte payload, tail) every 16 KiB, as in rank 0's reads of benchmarks/object_storage
    spans = [("other", at + a, at + b) for at in range(0, 40 * 16 * KIB, 16 * KIB)
             for a, b in ((0, 704), (704, 708), (708, 1577))]
    spans.append(("own", 0, len(data)))
    asked: list[tuple[str, int, int]] = []
    original = ranged_read._Fetcher._read

    def counted(self, url, start, end, view, reached, committed):
        asked.append((url.rsplit("/", 1)[1], start, end))
        return original(self, url, start, end, view, reached, committed)

    monkeypatch.setattr(ranged_read._Fetcher, "_read", counted)
    got: dict[tuple[str, int], bytes] = {}
    needs = [(n, a, b, lambda view, n=n, a=a: got.__setitem__((n, a), bytes(view))) for n, a, b in spans]
    ranged_read.fetch(_source(tmp_path), needs, ranges_in_flight=4, range_size=8 * MIB)

    assert got == {(n, a): data[a:b] for n, a, b in spans}
    small = [r for r in asked if r[0] == "other"]
    needed = sum(b - a for _, a, b in spans)
    fetched = sum(b - a for _, a, b in asked)
    # 12.65 MB needed: 49,398 bytes to spend (1/256), 3 gaps of 14,807: the first 4 items in one request, then one
    # each (one request per item before).
    assert len(small) == 37, small
    assert fetched - needed <= needed // 256, (fetched, needed)
