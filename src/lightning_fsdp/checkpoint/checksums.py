"""Checksums that make a corrupted checkpoint raise instead of loading wrong numbers.

Neither DCP nor ``torch.load`` checks what it reads. Design:

- **Sharded**: one CRC-32 per DCP item (a tensor's chunk, or a non-tensor entry), over the exact bytes DCP stored
  for it, seeded with the save's id. Per item, not per file, because a load reads items, not files: each rank
  reads only the items it needs (any of them after a resize), and verifies each one as it reads it, so nothing is
  read twice. :class:`ChecksumWriter` records them as DCP writes (each rank hashes the items it just wrote, from the
  page cache) and DCP's own gather brings them to the coordinator, which writes ``checksums.json`` before
  ``.metadata``, so both are committed together. The save id goes into DCP's ``.metadata`` too
  (``storage_meta.save_id``); the seed ties every checksum to it, so a shard file or a ``checksums.json`` copied
  in from another checkpoint does not verify.
- **Full** (and ``meta.pt``): ``torch.save`` files are zip archives that already carry a CRC-32 per record,
  computed by torch's writer as it writes each record (the streaming full writer uses the same writer, so there
  is no second pass over the model). Only nothing ever checked them: :func:`verify_zip` does.

CRC-32 (zlib) runs at about 3.8 GB/s here, several times faster than the copies a load makes anyway.
"""

from __future__ import annotations

import io
import json
import os
import struct
import uuid
import warnings
import zipfile
import zlib
from dataclasses import replace
from pathlib import Path
from typing import IO, Any, Optional, Union

import torch.distributed.checkpoint as dcp
from torch.futures import Future

from lightning_fsdp.checkpoint.agreement import CheckpointError
from lightning_fsdp.checkpoint.layout import CHECKSUMS_FILENAME, DCP_METADATA_FILENAME
from lightning_fsdp.checkpoint.safe_pickle import SafeFileSystemReader, load_dcp_metadata, tensor_record_names

__all__ = [
    "ChecksumError",
    "ChecksumWriter",
    "VerifyingReader",
    "new_save_id",
    "verify_zip",
    "verify_sharded",
    "verify_checkpoint",
    "note_unverified",
]

SAVE_ID_PREFIX = "lightning-fsdp:"
_HINT = " HINT: the checkpoint is damaged; load an earlier one, or save this one again."


class ChecksumError(CheckpointError):
    """A checkpoint's bytes do not match the checksums recorded when it was saved."""


def new_save_id() -> str:
    """An id for one save; every rank must use the same one (broadcast it)."""
    return SAVE_ID_PREFIX + uuid.uuid4().hex


def _seed(save_id: str) -> int:
    return zlib.crc32(save_id.encode())


def _item_name(index: Any) -> str:
    offsets = list(getattr(index, "offset", None) or [])
    return index.fqn + (f" (chunk at {offsets})" if any(offsets) else "")


# ------------------------------------------------------------------------------------------------------ sharded


class ChecksumWriter(dcp.FileSystemWriter):
    """DCP's file writer that also records a checksum per item (see the module docstring)."""

    def __init__(self, path: Union[str, Path], *, save_id: str, **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        self._save_id = self.save_id = save_id

    def reset(self, checkpoint_id: Any = None) -> None:
        super().reset(checkpoint_id)
        self.save_id = self._save_id  # DCP draws a fresh id per rank; ours is the same on every rank

    def write_data(self, plan: Any, planner: Any) -> Future:
        results = super().write_data(plan, planner).wait()
        seed = _seed(self._save_id)
        by_file: dict[str, list] = {}
        for result in results:
            by_file.setdefault(result.storage_data.relative_path, []).append(result)
        stamped = []
        for name, items in by_file.items():
            with open(Path(self.path) / name, "rb") as file:
                for result in sorted(items, key=lambda r: r.storage_data.offset):
                    info = result.storage_data
                    file.seek(info.offset)
                    crc = zlib.crc32(file.read(info.length), seed)
                    # DCP gathers write results to the coordinator as they are; `finish` unpacks them again.
                    stamped.append(replace(result, storage_data=(info, crc)))
        future: Future = Future()  # torch's future, as DCP expects
        future.set_result(stamped)
        return future

    def finish(self, metadata: Any, results: list) -> None:
        items, plain = [], []
        for rank_results in results:
            unpacked = []
            for result in rank_results:
                info, crc = result.storage_data
                items.append([info.relative_path, info.offset, info.length, crc, _item_name(result.index)])
                unpacked.append(replace(result, storage_data=info))
            plain.append(unpacked)
        manifest = {"format": 1, "algorithm": "crc32", "save_id": self._save_id, "items": items}
        with open(Path(self.path) / CHECKSUMS_FILENAME, "w") as file:
            json.dump(manifest, file)
            file.flush()
            os.fsync(file.fileno())
        super().finish(metadata, plain)


def _read_manifest(path: Path, metadata: Any) -> Optional[dict[tuple[str, int], tuple[int, int, str]]]:
    """The recorded checksums by (file, offset), or None for a checkpoint saved without them. Raises when they
    should be there and are not, or belong to another save."""
    save_id = getattr(getattr(metadata, "storage_meta", None), "save_id", None) or ""
    file = path / CHECKSUMS_FILENAME
    if not file.is_file():
        if save_id.startswith(SAVE_ID_PREFIX):
            raise ChecksumError(f"{str(file)!r} is missing, though {str(path)!r} was saved with checksums.{_HINT}")
        return None
    try:
        manifest = json.loads(file.read_text())
        recorded_id, items = manifest["save_id"], manifest["items"]
    except (ValueError, KeyError, TypeError) as err:
        raise ChecksumError(f"{str(file)!r} is not readable ({err}).{_HINT}") from err
    if recorded_id != save_id:
        raise ChecksumError(f"{str(file)!r} belongs to another save than {str(path / DCP_METADATA_FILENAME)!r}"
                            f" (their save ids differ), e.g. it was copied in from another checkpoint.{_HINT}")
    return {(f, o): (n, c, name) for f, o, n, c, name in items}


class VerifyingReader(SafeFileSystemReader):
    """The reader every sharded load uses: ``.metadata`` through the allow-list, and every item checked against
    its recorded checksum as DCP reads it (the item's bytes are read once, checked, and handed to DCP)."""

    def __init__(self, path: Union[str, Path], *, allow_pickle: bool = False, verify: bool = True) -> None:
        super().__init__(path, allow_pickle=allow_pickle)
        self.verify = verify
        self._expected: Optional[dict] = None
        self._expected_for: Optional[str] = None
        self._seed = 0

    def set_up_storage_reader(self, metadata: Any, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        save_id = getattr(metadata.storage_meta, "save_id", None)
        if not (self._expected is not None and save_id == self._expected_for):  # one read per reader and save
            self._expected = _read_manifest(Path(self.path), metadata) if self.verify else None
            self._expected_for = save_id
        if self._expected is not None:
            self._seed = _seed(metadata.storage_meta.save_id)
        elif self.verify and is_coordinator:
            note_unverified(Path(self.path))

    # DCP's reader asks this for a readable view of one item's bytes (torch 2.13's `_slice_file`).
    def _slice_file(self, file: IO[bytes], sinfo: Any) -> IO[bytes]:
        if self._expected is None:
            return super()._slice_file(file, sinfo)
        file.seek(sinfo.offset)
        data = file.read(sinfo.length)
        _check_item(Path(self.path), sinfo, data, self._expected, self._seed)
        return io.BytesIO(data)


def _check_item(root: Path, sinfo: Any, data: bytes, expected: dict, seed: int) -> None:
    where = str(root / sinfo.relative_path)
    recorded = expected.get((sinfo.relative_path, sinfo.offset))
    if recorded is None:
        raise ChecksumError(f"{where!r} has no recorded checksum for the item at byte {sinfo.offset}; the"
                            f" checkpoint's .metadata and {CHECKSUMS_FILENAME} disagree.{_HINT}")
    length, crc, name = recorded
    if len(data) < sinfo.length:
        raise ChecksumError(f"{where!r} could not be read: it is truncated (the tensor {name!r} needs bytes up to"
                            f" {sinfo.offset + sinfo.length}).{_HINT}")
    if sinfo.length != length or zlib.crc32(data, seed) != crc:
        raise ChecksumError(f"{where!r} is corrupted: the bytes of the tensor {name!r} do not match the checksum"
                            " recorded when the checkpoint was saved (damaged, or copied from another"
                            f" checkpoint).{_HINT}")


def verify_sharded(path: Union[str, Path]) -> bool:
    """Check every item of a sharded checkpoint and its ``meta.pt`` without loading them into a model; False when
    the checkpoint carries no checksums (saved before checksums existed)."""
    path = Path(path)
    metadata = load_dcp_metadata(path / DCP_METADATA_FILENAME)
    expected = _read_manifest(path, metadata)
    from lightning_fsdp.checkpoint.layout import METADATA_FILENAME

    if (path / METADATA_FILENAME).is_file():
        verify_zip(path / METADATA_FILENAME)
    if expected is None:
        return False
    seed = _seed(metadata.storage_meta.save_id)
    by_file: dict[str, list] = {}
    for info in metadata.storage_data.values():
        by_file.setdefault(info.relative_path, []).append(info)
    for name, infos in sorted(by_file.items()):
        with open(path / name, "rb") as file:
            for info in sorted(infos, key=lambda i: i.offset):
                file.seek(info.offset)
                _check_item(path, info, file.read(info.length), expected, seed)
    return True


# ---------------------------------------------------------------------------------------------------- zip files


_LOCAL_HEADER = struct.Struct("<4s22xHH")  # signature, ..., file name length, extra field length
_CHUNK = 8 * 2**20


def verify_zip(path: Union[str, Path]) -> bool:
    """Check every record of a ``torch.save`` file against the CRC-32 its zip directory holds; False when the
    writer recorded none (``torch.serialization.set_crc32_options(False)``)."""
    path = Path(path)
    with open(path, "rb") as file, zipfile.ZipFile(file) as archive:
        infos = [i for i in archive.infolist() if i.compress_type == zipfile.ZIP_STORED and not i.is_dir()]
        if infos and all(i.CRC == 0 for i in infos if i.file_size):
            return False
        # Read in chunks into one buffer rather than through a memory mapping: mapped file pages would count as
        # this process's resident memory (the whole file), read ones stay in the page cache only.
        buffer = memoryview(bytearray(_CHUNK))
        for info in infos:
            file.seek(info.header_offset)
            signature, name_length, extra_length = _LOCAL_HEADER.unpack(file.read(_LOCAL_HEADER.size))
            file.seek(name_length + extra_length, os.SEEK_CUR)
            crc, left = 0, info.file_size
            while left > 0:
                count = file.readinto(buffer[:min(left, _CHUNK)])
                if not count:
                    break
                crc, left = zlib.crc32(buffer[:count], crc), left - count
            if signature != b"PK\x03\x04" or left or crc != info.CRC:
                raise ChecksumError(f"{str(path)!r} is corrupted: {_record_name(archive, info)} does not"
                                    f" match the checksum recorded when it was saved.{_HINT}")
    return True


def _record_name(archive: zipfile.ZipFile, info: zipfile.ZipInfo) -> str:
    """``the tensor 'model.fc.weight' (record data/3)``, or the record alone when the index cannot say."""
    prefix, _, record = info.filename.partition("/")
    if not record.startswith("data/"):
        return f"the record {record!r}"
    try:
        names = tensor_record_names(archive.read(f"{prefix}/data.pkl"))  # zipfile checks data.pkl's own CRC
    except (zipfile.BadZipFile, KeyError):
        names = {}
    key = record.removeprefix("data/")
    return f"the tensor {names[key]!r} (record {record!r})" if key in names else f"the record {record!r}"


def verify_checkpoint(path: Union[str, Path]) -> bool:
    """Check a full or sharded checkpoint against its checksums; False when it carries none. Raises
    :class:`ChecksumError` naming the file and the tensor on the first mismatch."""
    from lightning_fsdp.checkpoint.layout import is_sharded_checkpoint

    path = Path(path)
    return verify_sharded(path) if is_sharded_checkpoint(path) else verify_zip(path)


# ---------------------------------------------------------------------------------------------------- the note


_NOTED: set[str] = set()


def note_unverified(path: Path) -> None:
    """Warn once per checkpoint and process that ``path`` carries no checksums, so it loads unchecked."""
    if str(path) in _NOTED:
        return
    _NOTED.add(str(path))
    warnings.warn(f"{str(path)!r} carries no checksums (it was saved before lightning-fsdp recorded them), so"
                  " its integrity is not checked. HINT: save it again to add them.", stacklevel=3)
