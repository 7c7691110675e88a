"""Checkpoints in a bucket for the streaming-load tests (``tests/test_streaming_load.py`` and
``workers/streaming_load.py``), made here without the package's save path, so that the tests do not depend on how
saves upload:

- :func:`upload_folder`: a sharded checkpoint written on local disk (as the old staging save wrote it), put under a
  token prefix with a COMMIT of its objects (what ``remote_upload`` and ``_write_commit`` did before issue 43);
- :func:`add_payloads`: the block digests of the streaming writer (``checksums.json``'s ``"payloads"``, the contract
  of issue 43), computed here from the objects by a reading of the zip records of our own, and COMMIT rewritten to
  match; a checkpoint that has them already keeps its own.
"""

from __future__ import annotations

import io
import json
import struct
import zipfile
from pathlib import Path
from typing import Any

import xxhash

DIGEST_BELOW = 4 * 2**20  # COMMIT records a digest for objects under this size (remote.py's rule)


def _commit(fs: Any, url: str, token: str, objects: dict[str, list], name: str) -> None:
    from lightning_fsdp.checkpoint.formats.commit_record import build_record, encode_record

    fs.pipe_file(f"{url}/COMMIT", encode_record(build_record(token, "sharded", name, objects, 1)))


def upload_folder(fs: Any, folder: Path, url: str, token: str = "0123456789ab") -> dict[str, list]:
    objects = {}
    for path in sorted(folder.iterdir()):
        data = path.read_bytes()
        fs.pipe_file(f"{url}/.{token}/{path.name}", data)
        objects[path.name] = [len(data), xxhash.xxh3_64_intdigest(data) if len(data) < DIGEST_BELOW else None]
    _commit(fs, url, token, objects, url.rsplit("/", 1)[-1])
    return objects


def block_size(payload: int) -> int:
    size = 64 * 2**10
    while size < payload / 64 and size < 16 * 2**20:
        size *= 2
    return size


def _payload_start(item: bytes) -> tuple[int, int]:
    """(offset of the ``data/0`` record's bytes from the item's first byte, their length), from the zip's central
    directory and that record's local header."""
    with zipfile.ZipFile(io.BytesIO(item)) as archive:
        info = next(i for i in archive.infolist() if i.filename.endswith("/data/0"))
    name_length, extra_length = struct.unpack("<HH", item[info.header_offset + 26:info.header_offset + 30])
    return info.header_offset + 30 + name_length + extra_length, info.file_size


def add_payloads(fs: Any, url: str) -> bool:
    """Give the checkpoint at ``url`` block digests (see the module); False when it had them."""
    import torch
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from lightning_fsdp.checkpoint.formats.commit_record import parse_record
    from lightning_fsdp.checkpoint.integrity.digests import ALGORITHMS
    from lightning_fsdp.checkpoint.integrity.safe_pickle import load_dcp_metadata

    record = parse_record(fs.cat_file(f"{url}/COMMIT"), url)
    prefix = f"{url}/.{record['token']}"
    manifest = json.loads(fs.cat_file(f"{prefix}/checksums.json"))
    if "payloads" in manifest:
        return False
    scratch = Path(__import__("tempfile").mkdtemp())
    (scratch / ".metadata").write_bytes(fs.cat_file(f"{prefix}/.metadata"))
    metadata = load_dcp_metadata(scratch / ".metadata")
    (scratch / ".metadata").unlink()
    scratch.rmdir()
    algorithm = manifest.get("algorithm", "crc32")
    seed, new_hasher = ALGORITHMS[algorithm][0](manifest["save_id"]), ALGORITHMS[algorithm][1]
    files: dict[str, bytes] = {}
    rows = []
    for index, info in metadata.storage_data.items():
        entry = metadata.state_dict_metadata[index.fqn]
        if not isinstance(entry, TensorStorageMetadata):
            continue
        chunk = next(c for c in entry.chunks if list(c.offsets) == list(index.offset))
        payload = chunk.sizes.numel() * torch.empty((), dtype=entry.properties.dtype).element_size()
        data = files.setdefault(info.relative_path, fs.cat_file(f"{prefix}/{info.relative_path}"))
        item = data[info.offset:info.offset + info.length]
        start, length = _payload_start(item)
        if length != payload:
            continue  # a tensor saved with more storage than itself: read whole, by its item digest
        block = block_size(payload)
        digests = []
        for low in range(0, payload, block):
            hasher = new_hasher(seed)
            hasher.update(item[start + low:start + min(low + block, payload)])
            digests.append(hasher.intdigest())
        rows.append([info.relative_path, info.offset, start, block, digests])
    manifest["payloads"] = sorted(rows, key=lambda r: (r[0], r[1]))
    encoded = json.dumps(manifest).encode()
    fs.pipe_file(f"{prefix}/checksums.json", encoded)
    objects = dict(record["objects"])
    objects["checksums.json"] = [len(encoded), xxhash.xxh3_64_intdigest(encoded)]
    _commit(fs, url, record["token"], objects, record.get("name") or url.rsplit("/", 1)[-1])
    return True


def payload_of(fs: Any, url: str, file: str, fqn_prefix: str) -> tuple[int, int, int]:
    """(object byte where the payload starts, its length, its block size) of the first item recorded for ``file``
    whose tensor name starts with ``fqn_prefix``."""
    from lightning_fsdp.checkpoint.formats.commit_record import parse_record

    record = parse_record(fs.cat_file(f"{url}/COMMIT"), url)
    prefix = f"{url}/.{record['token']}"
    manifest = json.loads(fs.cat_file(f"{prefix}/checksums.json"))
    items = {(f, o): (n, name) for f, o, n, _, name in manifest["items"]}
    for f, offset, start, block, _ in manifest["payloads"]:
        length, name = items[(f, offset)]
        if f == file and name.startswith(fqn_prefix):
            item = fs.cat_file(f"{prefix}/{f}", start=offset, end=offset + length)
            return offset + start, _payload_start(item)[1], block
    raise KeyError(fqn_prefix)


def two_weights(seed: int):
    """The model of the streaming-load tests: two weights of 512 KiB each (fp32), split by rows on 2 ranks into
    halves of 4 blocks of 64 KiB each."""
    import torch
    from torch import nn

    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.l0 = nn.Linear(256, 512, bias=False)
            self.l1 = nn.Linear(512, 256, bias=False)

        def forward(self, x):
            return self.l1(self.l0(x))

    torch.manual_seed(seed)
    return Two()


def flip_in_rank_1_half(fs: Any, url: str) -> dict:
    """Flip one bit in row 448 of 512 of ``model.l0.weight`` of the one-file checkpoint at ``url``: in the half that
    rank 1 of 2 reads, in its block 7. Returns the shard's URL and the block."""
    from lightning_fsdp.checkpoint.formats.commit_record import parse_record

    token = parse_record(fs.cat_file(f"{url}/COMMIT"), url)["token"]
    start, length, block = payload_of(fs, url, "__0_0.distcp", "model.l0.weight")
    shard = f"{url}/.{token}/__0_0.distcp"
    data = bytearray(fs.cat_file(shard))
    at = start + length * 7 // 8
    data[at] ^= 0x10
    fs.pipe_file(shard, bytes(data))
    return {"shard": shard, "block": (at - start) // block}


def rewrite_object(fs: Any, url: str, name: str, change: Any) -> str:
    """Replace the object ``name`` of the checkpoint at ``url`` by ``change(bytes)`` and COMMIT's record of it to
    match (damage that only the checkpoint's own checks can find); returns the object's URL."""
    from lightning_fsdp.checkpoint.formats.commit_record import parse_record

    record = parse_record(fs.cat_file(f"{url}/COMMIT"), url)
    where = f"{url}/.{record['token']}/{name}"
    data = change(fs.cat_file(where))
    fs.pipe_file(where, data)
    objects = dict(record["objects"])
    objects[name] = [len(data), xxhash.xxh3_64_intdigest(data) if len(data) < DIGEST_BELOW else None]
    _commit(fs, url, record["token"], objects, record.get("name") or url.rsplit("/", 1)[-1])
    return where
