"""The download side of a load from object storage: the objects a COMMIT names, fetched into a load's own folder,
each destination checked before the first byte is fetched, each size (and small object's digest) checked after.

A COMMIT in a bucket is untrusted input (anyone who can write one object there can write it), and a sharded load
fetches its small objects whole, on rank 0, and hands their bytes to every rank. So before anything is fetched,
:func:`check_sharded` holds a sharded record to what a save writes: ``.metadata``, ``checksums.json``, ``meta.pt``
(the small objects) and shard files (``*.distcp``, read by ranges), nothing else, and each small object at most
:data:`MAX_SMALL_BYTES`. Anything else is a damaged checkpoint, said on every rank alike, so ``latest`` falls back."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import xxhash

from lightning_fsdp.checkpoint.formats.layout import CHECKSUMS_FILENAME, DCP_METADATA_FILENAME, METADATA_FILENAME
from lightning_fsdp.checkpoint.io.remote_errors import damaged
from lightning_fsdp.checkpoint.io.urls import join

__all__ = ["download", "RANGE", "SHARD_SUFFIX", "SMALL_NAMES", "MAX_SMALL_BYTES", "check_sharded", "small_names",
           "fetch_small", "write_skeleton"]

SHARD_SUFFIX = ".distcp"  # a sharded checkpoint's shard files: read by ranges, never fetched whole by a load
# The objects of a sharded checkpoint other than its shard files: what a save writes (`layout.foreign_entries` says
# the same of a local folder); a load fetches them whole, once.
SMALL_NAMES = (DCP_METADATA_FILENAME, CHECKSUMS_FILENAME, METADATA_FILENAME)
# The most bytes each small object may have: above what any save that can be loaded writes, and the most a crafted
# COMMIT makes a load fetch (rank 0) and hand to every rank. Measured per chunk (a tensor's piece saved by one rank):
# `.metadata` ~145 B; `checksums.json` ~210 B plus ~21 B per block digest (one per 64 KiB of the chunk, at most 64).
# 100,000 tensors (parameters and optimizer states) of 1,000 ranks, each split over a shard group of 64 (HSDP, or
# FSDP with tensor parallelism): 6.4M chunks, ~0.9 GB of `.metadata` (4 GiB: 28M chunks); `checksums.json` ~1.7 GB
# for 1 TB of state (3 digests a chunk), at most ~9.9 GB (64 a chunk, past 27 TB; 16 GiB: 11M such chunks).
# Every tensor split over all 1,000 ranks (100M chunks, ~14 GB of `.metadata`) is beyond what DCP plans and what
# every rank can unpickle. `meta.pt` holds the state that is neither model nor optimizer, loaded whole by every rank.
MAX_SMALL_BYTES = {DCP_METADATA_FILENAME: 4 * 2**30, CHECKSUMS_FILENAME: 16 * 2**30, METADATA_FILENAME: 4 * 2**30}

RANGE = 32 * 2**20  # larger objects are read in ranges of this size, in parallel
_RANGE = RANGE


def check_sharded(record: dict[str, Any], target: str) -> None:
    """Refuse a sharded record that names what no save writes, or gives a small object more than
    :data:`MAX_SMALL_BYTES`: a ``ChecksumError`` naming ``<target>/COMMIT``, before any object is fetched."""
    from lightning_fsdp.checkpoint.formats.commit_record import COMMIT_NAME

    objects = record["objects"]
    commit = join(target, COMMIT_NAME)
    others = sorted(n for n in objects if n not in SMALL_NAMES and not n.endswith(SHARD_SUFFIX))
    if others:
        shown = ", ".join(repr(n) for n in others[:3]) + (f" and {len(others) - 3} more" if len(others) > 3 else "")
        raise damaged(commit, f"it names {shown}, which no save writes into a sharded checkpoint (only"
                      f" {', '.join(repr(n) for n in SMALL_NAMES)} and shard files '*{SHARD_SUFFIX}'), so nothing of"
                      " it was fetched")
    for name in SMALL_NAMES:
        size = objects.get(name, (0, None))[0]
        if size > MAX_SMALL_BYTES[name]:
            raise damaged(commit, f"it gives {name!r} {size:,} bytes, more than the {MAX_SMALL_BYTES[name] // 2**30}"
                          " GiB that any loadable save writes there (a save of 100,000 tensors in 64 chunks each"
                          " writes at most 1 GB of .metadata and 10 GB of checksums.json), so it was not fetched")


def small_names(record: dict[str, Any]) -> list[str]:
    """The objects of a sharded checkpoint that a load fetches whole, once (rank 0): those of ``.metadata``,
    ``checksums.json`` and ``meta.pt`` that COMMIT names. Shard files are not, even small ones that COMMIT gives a
    digest: each rank reads only its own ranges of them."""
    return sorted(n for n in SMALL_NAMES if n in record["objects"])


def fetch_small(fs: Any, target: str, record: dict[str, Any]) -> dict[str, bytes]:
    """The bytes of :func:`small_names`, each checked against COMMIT's size and digest: one GET each, of the range
    COMMIT records (a whole-object read would cost a HEAD first, for its size), all side by side. From S3 through
    obstore where the load's ranged reads use it (:mod:`.transport_download`). One after another through s3fs, they
    were ~17 ms of rank 0's ~85 ms before its first shard GET (``benchmarks/profile_checkpoint.py``, 2026-11-29), while
    every other rank waited for their broadcast; an obstore GET of a small object costs a third of an s3fs one."""
    from lightning_fsdp.checkpoint.io.remote_clean import side_by_side

    check_sharded(record, target)
    prefix = join(target, "." + record["token"])
    fast = _fast_client(fs)

    def get(name: str) -> bytes:
        url = join(prefix, name)
        size, digest = record["objects"][name]
        data = _read_small(fs, fast, url, size) if size else b""
        if len(data) != size:
            raise damaged(url, f"it has {len(data)} bytes, its commit records {size}")
        if digest is not None and xxhash.xxh3_64_intdigest(data) != digest:
            raise damaged(url, "its bytes do not match the digest its commit records")
        return data

    names = small_names(record)
    return dict(zip(names, side_by_side(get, names, len(names))))


def _fast_client(fs: Any) -> Any:
    """The obstore client of an s3fs filesystem that translates to it, else None (s3fs's own GETs)."""
    from lightning_fsdp.checkpoint.io import transport_download

    if not (hasattr(fs, "_call_s3") and hasattr(fs, "split_path")):
        return None
    return transport_download.client_for(fs)


def _read_small(fs: Any, fast: Any, url: str, size: int) -> bytes:
    from lightning_fsdp.checkpoint.io import transport_download

    if fast is not None and fast.on:
        buffer = bytearray(size)
        try:
            fast.read(url, 0, size, memoryview(buffer), [0], size)
            return bytes(buffer)
        except transport_download.Short as short:  # the object's size is not COMMIT's: damage, never retried
            real = "another number of" if short.size is None else short.size
            raise damaged(url, f"it has {real} bytes, its commit records {size}") from None
        except transport_download.Unplaced:
            fast.on = False  # an answer obstore could not place, before any byte: s3fs from now on, as ranged reads
    # One byte more than COMMIT's size: an object longer than that is damage here too, as obstore's reader says.
    data = fs.cat_file(url, start=0, end=size + 1)
    if len(data) > size:
        raise damaged(url, f"it has more than {size} bytes, its commit records {size}")
    return data


def write_skeleton(record: dict[str, Any], small: dict[str, bytes], local: Path, target: str) -> None:
    """Write the small objects into ``local``, a new folder inside the load's own temporary folder
    (``local.parent``): the checks and readers that work on a folder read them there; the shards stay remote."""
    prefix = join(target, "." + record["token"])
    places = _places(prefix, list(small), local, True)
    local.mkdir(parents=True, exist_ok=False)
    for name, data in small.items():
        _check_free(prefix, name, places[name], local.parent.resolve())
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
        with open(os.open(places[name], flags, 0o600), "wb") as out:
            out.write(data)


def _places(prefix: str, names: list[str], local: Path, sharded: bool) -> dict[str, Path]:
    from lightning_fsdp.checkpoint.formats.commit_record import safe_object_name

    root = local.parent.resolve()

    def place_of(name: str) -> Path:
        place = local / name if sharded else local
        resolved = Path(os.path.realpath(place))
        if safe_object_name(name) is not None or "/" in local.name or root not in resolved.parents:
            raise damaged(join(prefix, name), f"its commit puts it at {str(place)!r}, outside the load's folder"
                          f" {str(root)!r}")
        return place

    return {name: place_of(name) for name in names}


def _check_free(prefix: str, name: str, place: Path, root: Path) -> None:
    place.parent.mkdir(parents=True, exist_ok=True)
    links = [p for p in (place, *place.parents) if p != root and root in p.parents and p.is_symlink()]
    if links or os.path.lexists(place):
        raise damaged(join(prefix, name), f"its place {str(place)!r} in the load's new folder is already"
                      " taken (a symbolic link or another object), so nothing is written through it")


def download(fs: Any, target: str, record: dict[str, Any], local: Path) -> None:
    """Fetch the objects ``record`` names into ``local``, inside the load's own temporary folder
    (``local.parent``, new and empty). Every destination is checked before the first byte is fetched."""
    prefix = join(target, "." + record["token"])
    objects = record["objects"]
    sharded = record.get("kind") == "sharded"
    # Defence in depth: parse_record already refused unsafe names on the rank that read COMMIT. Here every rank
    # checks again what it writes: the name, then where it resolves (a `..` or a symbolic link on the way would
    # lead out of the folder), and no symbolic link is followed or written through.
    root = local.parent.resolve()
    places = _places(prefix, list(objects), local, sharded)
    # A retried download (a transient failure) starts again from an empty folder: what the attempt before wrote
    # is ours, and is removed without following a link.
    if os.path.islink(local) or local.is_file():
        local.unlink()
    elif local.is_dir():
        shutil.rmtree(local)
    if sharded:
        local.mkdir(parents=True, exist_ok=True)
    for name, place in places.items():
        _check_free(prefix, name, place, root)
    small = [n for n, (size, _) in objects.items() if size <= _RANGE]
    if small:
        fs.get([join(prefix, n) for n in small], [str(places[n]) for n in small])
    for name in [n for n in objects if n not in small]:
        size = objects[name][0]
        starts = list(range(0, size, _RANGE))
        url = join(prefix, name)
        pieces = fs.cat_ranges([url] * len(starts), starts, [min(s + _RANGE, size) for s in starts])
        # O_EXCL and O_NOFOLLOW: a file or a link that appeared there since the check is not written through.
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
        with open(os.open(places[name], flags, 0o600), "wb") as out:
            for piece in pieces:
                if isinstance(piece, Exception):
                    raise piece
                out.write(piece)
    for name, (size, digest) in objects.items():
        place = places[name]
        actual = place.stat().st_size if place.is_file() else -1
        if actual != size:
            raise damaged(join(prefix, name), f"it has {actual} bytes, its commit records {size}")
        if digest is not None and xxhash.xxh3_64_intdigest(place.read_bytes()) != digest:
            raise damaged(join(prefix, name), "its bytes do not match the digest its commit records")
