"""The start of a sharded load from a bucket, before its first shard GET (issue 43 item 6): what it reads and parses
there, in process.

- The small objects (``.metadata``, ``checksums.json``, ``meta.pt``) are fetched side by side, through obstore where
  the ranged reads use it (one after another through s3fs, they were ~17 ms of rank 0's ~85 ms before its first
  shard GET in ``benchmarks/profile_checkpoint.py``).
- ``.metadata`` is unpickled once and ``checksums.json``'s manifest read once: the file check, the load's own read
  and DCP's ``read_metadata`` each unpickled ``.metadata``, and the reader's set-up read the manifest again.
"""

from __future__ import annotations

import threading
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
import xxhash

from streamed import save_streamed

pytestmark = pytest.mark.single_process

SMALL = {".metadata": b"m" * 145, "checksums.json": b"{}" * 100, "meta.pt": b"p" * 700}


class _S3Like:
    """An s3fs-shaped filesystem whose own GETs must not be used: the fast client serves every small object."""

    _call_s3 = None

    def __init__(self) -> None:
        self.gets: list[str] = []

    def split_path(self, url: str) -> tuple[str, str, None]:
        bucket, _, key = url.split("://", 1)[-1].partition("/")
        return bucket, key, None

    def cat_file(self, url: str, start: int = 0, end: Any = None) -> bytes:
        self.gets.append(url)
        return SMALL[url.rsplit("/", 1)[1]][start:end]


class _Fast:
    """obstore's reader, faked: every GET waits until all three are in flight (a bound against a hang only: the
    barrier opens at once where they run side by side)."""

    on = True

    def __init__(self, sizes: dict[str, int]) -> None:
        self.sizes = sizes
        self.together = threading.Barrier(len(SMALL), timeout=60)
        self.urls: list[str] = []

    def read(self, url: str, start: int, end: int, view: memoryview, reached: list, committed: int) -> None:
        from lightning_fsdp.checkpoint.io import transport_download

        self.urls.append(url)
        self.together.wait()
        name = url.rsplit("/", 1)[1]
        if self.sizes[name] != committed:
            raise transport_download.Short("cut", self.sizes[name])
        view[:] = SMALL[name][start:end]
        reached[0] += end - start


def _record() -> dict[str, Any]:
    objects = {name: (len(data), xxhash.xxh3_64_intdigest(data)) for name, data in SMALL.items()}
    return {"kind": "sharded", "token": "tok", "objects": {**objects, "__0_0.distcp": (10, None)}}


def test_the_small_objects_are_fetched_side_by_side_through_the_fast_client(monkeypatch):
    from lightning_fsdp.checkpoint.io import remote_download, transport_download

    fs, fast = _S3Like(), _Fast({name: len(data) for name, data in SMALL.items()})
    monkeypatch.setattr(transport_download, "client_for", lambda _: fast)
    got = remote_download.fetch_small(fs, "s3://b/ck", _record())
    assert got == SMALL
    assert fs.gets == [], "small objects fetched through s3fs"
    assert sorted(fast.urls) == sorted(f"s3://b/ck/.tok/{name}" for name in SMALL)  # one GET each, no shard


def test_a_small_object_of_another_size_than_its_commit_is_named_damaged(monkeypatch):
    from lightning_fsdp.checkpoint.integrity.digests import ChecksumError
    from lightning_fsdp.checkpoint.io import remote_download, transport_download

    sizes = {name: len(data) for name, data in SMALL.items()}
    sizes["checksums.json"] -= 1
    monkeypatch.setattr(transport_download, "client_for", lambda _: _Fast(sizes))
    with pytest.raises(ChecksumError, match=r"'s3://b/ck/\.tok/checksums\.json' is damaged: it has 199 bytes, its"
                                            r" commit records 200"):
        remote_download.fetch_small(_S3Like(), "s3://b/ck", _record())


class _S3Changed(_S3Like):
    """The bucket's `checksums.json` is ``change`` bytes longer (or shorter) than the object COMMIT recorded, its
    first bytes untouched: what the size check alone can catch, the digest covering only COMMIT's bytes."""

    def __init__(self, change: int) -> None:
        super().__init__()
        self.change = change

    def cat_file(self, url: str, start: int = 0, end: Any = None) -> bytes:
        data = SMALL[url.rsplit("/", 1)[1]]
        if url.endswith("checksums.json"):
            data = data + b" " * self.change if self.change > 0 else data[:self.change]
        self.gets.append(url)
        return data[start:end]


@pytest.mark.parametrize("change, said", [(+1, "it has more than 200 bytes"), (-1, "it has 199 bytes")],
                         ids=["longer-than-recorded", "shorter-than-recorded"])
def test_through_s3fs_too_a_small_object_of_another_size_than_its_commit_is_named_damaged(monkeypatch, change, said):
    """Without the fast client (`LFSDP_S3_CLIENT=s3fs`, no obstore, or after an answer it could not place) the GET
    of a range reads one byte more than COMMIT's size: a longer object was accepted, only its first bytes checked."""
    from lightning_fsdp.checkpoint.integrity.digests import ChecksumError
    from lightning_fsdp.checkpoint.io import remote_download, transport_download

    monkeypatch.setattr(transport_download, "client_for", lambda _: None)
    with pytest.raises(ChecksumError, match=rf"'s3://b/ck/\.tok/checksums\.json' is damaged: {said}, its commit"
                                            r" records 200"):
        remote_download.fetch_small(_S3Changed(change), "s3://b/ck", _record())


def _saved_checkpoint(folder: Path) -> dict[str, torch.Tensor]:
    saved = {f"t{i}": torch.randn(64 + i, 33, generator=torch.Generator().manual_seed(i)) for i in range(3)}
    save_streamed(folder, saved)
    return saved


def _reader(folder: Path) -> Any:
    import fsspec

    from lightning_fsdp.checkpoint.integrity.streaming_read import StreamingReader
    from lightning_fsdp.checkpoint.io import ranged_read
    from lightning_fsdp.checkpoint.io.remote_source import RemoteObjects

    objects = {p.name: (p.stat().st_size, None) for p in folder.iterdir()}
    remote = RemoteObjects(fsspec.filesystem("file"), str(folder), str(folder), "sharded", objects, folder)
    return StreamingReader(folder, url_of=remote.url, fetch=lambda needs: ranged_read.fetch(remote, needs))


def _counting(monkeypatch) -> dict[str, int]:
    from lightning_fsdp.checkpoint.integrity import safe_pickle, sharded_read

    counts = {"unpickled": 0, "manifests": 0}
    unpickle, parse = safe_pickle._unpickle, sharded_read._parse_manifest

    def unpickled(*args: Any) -> Any:
        counts["unpickled"] += 1
        return unpickle(*args)

    def parsed(*args: Any) -> Any:
        counts["manifests"] += 1
        return parse(*args)

    monkeypatch.setattr(safe_pickle, "_unpickle", unpickled)
    monkeypatch.setattr(sharded_read, "_parse_manifest", parsed)
    return counts


def test_a_load_from_a_bucket_unpickles_metadata_once_and_reads_the_manifest_once(tmp_path, monkeypatch):
    saved = _saved_checkpoint(tmp_path / "ck")
    counts = _counting(monkeypatch)
    reader = _reader(tmp_path / "ck")
    verified, metadata = reader.adopt_metadata()  # what the load does first, in its agreed metadata read
    assert verified and set(metadata.state_dict_metadata) == set(saved)
    state = {name: torch.zeros_like(t) for name, t in saved.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, storage_reader=reader, no_dist=True)
    assert all(torch.equal(state[name], saved[name]) for name in saved)
    assert counts == {"unpickled": 1, "manifests": 1}, counts


def test_metadata_that_does_not_unpickle_is_left_to_the_file_check_which_names_it(tmp_path, monkeypatch):
    from lightning_fsdp.checkpoint.integrity.digests import ChecksumError
    from lightning_fsdp.checkpoint.integrity.sharded_read import check_files

    _saved_checkpoint(tmp_path / "ck")
    file = tmp_path / "ck" / ".metadata"
    file.write_bytes(file.read_bytes()[:-9])  # cut short
    counts = _counting(monkeypatch)
    assert _reader(tmp_path / "ck").adopt_metadata() is None
    assert counts["manifests"] == 0  # nothing checked with bytes that did not parse: the load's check follows
    with pytest.raises(ChecksumError, match=r"\.metadata"):
        check_files(tmp_path / "ck")
