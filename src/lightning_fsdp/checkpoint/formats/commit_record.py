"""The ``COMMIT`` object of a checkpoint on object storage: what it holds, how it is written and how it is read.

It is the one object a save writes last and a load reads first (:mod:`~lightning_fsdp.checkpoint.io.remote`):

    {"format": "lightning-fsdp-commit", "version": 1, "token": ..., "kind": "sharded" | "full", "name": ...,
     "objects": {name: [size, digest or null]}, "commit_order": ..., "time": ..., "digest": "sha256:..."}

A COMMIT in a bucket is untrusted input: anyone who can write one object there can write it, and a load joins its
object names onto a local folder. :func:`parse_record` is the one reader, and everything a load later does with the
record (which objects to fetch, where to put them) comes from what it returns: only the fields below, each checked
for its type and range, before anything else is fetched.

- ``token``: lowercase hex, as saves make it (``uuid4().hex[:12]``; the command line's ``[:16]``).
- ``kind``: ``"sharded"`` or ``"full"`` (a full checkpoint is one object).
- ``name``: the checkpoint's own name, one path component (or empty).
- ``objects``: at most :data:`MAX_OBJECTS`, each name a relative POSIX path (no empty, ``.`` or ``..`` component, no
  backslash, no control character, no drive letter, bounded length and depth, no name that is another's folder),
  each value ``[size, digest]``: an int in ``[0, MAX_OBJECT_SIZE]`` and an xxh3-64 int or null.
- ``commit_order``: an int >= 0, or null or absent (saves older than the key; converts of such checkpoints);
  ``time``: a finite number >= 0.
- ``digest``: ``"sha256:<hex>"`` of the record without this field, in its canonical encoding (:func:`encode_record`).
  It finds damage (a flipped byte, a cut or hand-edited record: an order key changed by hand would otherwise sort the
  checkpoint anywhere); it cannot stop a writer who means harm, who can compute it too: the checks of every field
  are what does. sha256 rather than the xxh3 the objects use: this layer imports only the standard library, and the
  record is small.

A COMMIT without ``digest`` was written by a release before this one. It is read when every field passes, so old
checkpoints keep loading; only the check of its own bytes is missing (a damaged one whose fields still parse is not
found here, but its objects' sizes and digests, and the checkpoint's own checksums, still are). Unknown fields are
ignored, and not returned. A record of a newer ``version`` is refused as such, not as damage.

Every refusal is a :class:`CommitRecordError` naming the COMMIT's URL; the store raises it as damage.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import time
from typing import Any, Optional

from lightning_fsdp.checkpoint.formats.commit_order import COMMIT_ORDER_KEY

__all__ = [
    "COMMIT_NAME", "COMMIT_FORMAT", "COMMIT_VERSION", "CommitRecordError", "build_record", "encode_record",
    "parse_record", "safe_object_name",
]

COMMIT_NAME = "COMMIT"
COMMIT_FORMAT = "lightning-fsdp-commit"
COMMIT_VERSION = 1
DIGEST_KEY = "digest"
_DIGEST_PREFIX = "sha256:"

# Bounds far above any save (a DCP save writes a few files per rank; S3 keys are at most 1024 bytes; one object at
# most 5 TiB on S3 and GCS), low enough that a crafted record cannot make the load build giant lists.
MAX_OBJECTS = 1_000_000
MAX_NAME_BYTES = 1024
MAX_COMPONENT_BYTES = 255
MAX_DEPTH = 16
MAX_OBJECT_SIZE = 2**45
_TOKEN = re.compile(r"[0-9a-f]{8,64}")
_DRIVE = re.compile(r"[A-Za-z]:")
_KINDS = ("sharded", "full")


class CommitRecordError(ValueError):
    """The bytes of a COMMIT are not a record a save of this version wrote: ``why`` says what is wrong, ``damage``
    whether it is damage (cut short, flipped, crafted) rather than a record of a newer version."""

    def __init__(self, message: str, url: str, why: str, damage: bool) -> None:
        super().__init__(message)
        self.url, self.why, self.damage = url, why, damage


def _damaged(url: str, why: str) -> CommitRecordError:
    return CommitRecordError(f"The commit object {url!r} is damaged: {why}. HINT: load an earlier checkpoint, or save"
                             " this one again.", url, why, damage=True)


def build_record(token: str, kind: str, name: str, objects: dict[str, list], commit_order: int) -> dict[str, Any]:
    return {"format": COMMIT_FORMAT, "version": COMMIT_VERSION, "token": token, "kind": kind, "name": name,
            "objects": objects, COMMIT_ORDER_KEY: commit_order, "time": time.time()}


def _canonical(record: dict[str, Any]) -> bytes:
    return json.dumps({k: v for k, v in record.items() if k != DIGEST_KEY}, sort_keys=True).encode()


def _digest(record: dict[str, Any]) -> str:
    return _DIGEST_PREFIX + hashlib.sha256(_canonical(record)).hexdigest()


def encode_record(record: dict[str, Any]) -> bytes:
    """The bytes of ``record``, carrying the digest of its canonical encoding."""
    return json.dumps({**record, DIGEST_KEY: _digest(record)}, sort_keys=True).encode()


def safe_object_name(name: Any) -> Optional[str]:
    """None when ``name`` is a safe relative POSIX path to put under a local folder, else why not."""
    if not isinstance(name, str) or not name:
        return f"a name must be a non-empty string, not {name!r}"
    try:
        size = len(name.encode("utf-8"))
    except UnicodeEncodeError:
        return f"the name {name[:80]!r} is not valid text (a lone surrogate)"
    if size > MAX_NAME_BYTES:
        return f"the name {name[:80]!r}... has {size} bytes, more than {MAX_NAME_BYTES}"
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in name):
        return f"the name {name[:80]!r} holds a control character"
    if "\\" in name:
        return f"the name {name[:80]!r} holds a backslash"
    if name.startswith("/"):
        return f"the name {name[:80]!r} is absolute"
    parts = name.split("/")
    if len(parts) > MAX_DEPTH:
        return f"the name {name[:80]!r} is {len(parts)} folders deep, more than {MAX_DEPTH}"
    for part in parts:
        if part in ("", ".", ".."):
            return f"the name {name[:80]!r} has an empty, '.' or '..' component"
        if _DRIVE.match(part):
            return f"the name {name[:80]!r} has a drive letter"
        if len(part.encode("utf-8")) > MAX_COMPONENT_BYTES:
            return f"the name {name[:80]!r} has a component longer than {MAX_COMPONENT_BYTES} bytes"
    return None


def parse_record(payload: bytes, url: str) -> dict[str, Any]:
    """The checked record in ``payload`` (the bytes of the COMMIT at ``url``), or :class:`CommitRecordError`."""
    def no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        """A JSON object, refusing a key given twice (json keeps the last, so the two copies could disagree)."""
        out = dict(pairs)
        if len(out) != len(pairs):
            raise _damaged(url, "a key appears twice in one of its objects")
        return out

    try:
        record = json.loads(payload, object_pairs_hook=no_duplicates)
    except CommitRecordError:
        raise
    except (ValueError, RecursionError) as err:  # UnicodeDecodeError is a ValueError
        raise _damaged(url, f"it is not JSON, or cut short ({type(err).__name__}: {str(err)[:200]})") \
            from None
    if not isinstance(record, dict) or record.get("format") != COMMIT_FORMAT:
        raise _damaged(url, "it is not a lightning-fsdp commit record")
    digest = record.get(DIGEST_KEY)
    try:
        matches = DIGEST_KEY not in record or digest == _digest(record)
    except (ValueError, RecursionError):  # nested deeper than the encoder goes: no record a save wrote
        matches = False
    if not matches:
        raise _damaged(url, "its bytes do not match the digest it records (edited or damaged)")
    version = record.get("version")
    if _is_int(version) and version > COMMIT_VERSION:
        why = f"it is version {version} of the record, and this lightning-fsdp reads {COMMIT_VERSION}"
        raise CommitRecordError(f"The commit object {url!r} is not readable here: {why}. HINT: load it with the"
                                " lightning-fsdp version that saved it, or a newer one.", url, why, damage=False)
    checked = {"format": COMMIT_FORMAT, "version": _field(record, "version", url, _is_int, "an int", None)}
    if checked["version"] < 1:
        raise _damaged(url, f"its version {version!r} is not one any release wrote")
    checked["token"] = _field(record, "token", url, lambda v: isinstance(v, str) and _TOKEN.fullmatch(v),
                              "lowercase hex, as a save makes it", None)
    checked["kind"] = _field(record, "kind", url, lambda v: v in _KINDS, f"one of {_KINDS}", None)
    checked["name"] = _field(record, "name", url, lambda v: v == "" or isinstance(v, str) and "/" not in v
                             and safe_object_name(v) is None, "one safe path component", None)
    checked["objects"] = _objects(record.get("objects"), checked["kind"], url)
    # Absent from records saved before the key existed, null where a convert's source recorded none: both sort first.
    checked[COMMIT_ORDER_KEY] = _field(record, COMMIT_ORDER_KEY, url, lambda v: v is None or _is_int(v) and v >= 0,
                                       "an int >= 0 or null", None)
    checked["time"] = _field(record, "time", url, lambda v: _is_int(v) and v >= 0
                             or isinstance(v, float) and math.isfinite(v) and v >= 0, "a finite number >= 0", None)
    return checked


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _field(record: dict[str, Any], key: str, url: str, valid: Any, allowed: str, default: Any) -> Any:
    value = record.get(key, default)
    if not valid(value):
        shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:80] + "..."
        raise _damaged(url, f"its {key!r} is {shown}, where it must be {allowed}")
    return value


def _objects(objects: Any, kind: str, url: str) -> dict[str, list]:
    if not isinstance(objects, dict):
        raise _damaged(url, f"its 'objects' is a {type(objects).__name__}, not a mapping of names")
    if len(objects) > MAX_OBJECTS:
        raise _damaged(url, f"it names {len(objects)} objects, more than {MAX_OBJECTS}")
    if kind == "full" and len(objects) != 1:
        raise _damaged(url, f"a full checkpoint is one object, and it names {len(objects)}")
    checked: dict[str, list] = {}
    for name, entry in objects.items():
        problem = safe_object_name(name)
        if problem is not None:
            raise _damaged(url, f"{problem}, so it is refused before anything is fetched")
        if not (isinstance(entry, list) and len(entry) == 2 and _is_int(entry[0])
                and 0 <= entry[0] <= MAX_OBJECT_SIZE
                and (entry[1] is None or _is_int(entry[1]) and 0 <= entry[1] < 2**64)):
            shown = repr(entry) if len(repr(entry)) <= 80 else repr(entry)[:80] + "..."
            raise _damaged(url, f"the object {name!r} has {shown}, where it must be [size, digest]: an int"
                                         f" in [0, {MAX_OBJECT_SIZE}] and an xxh3-64 int or null")
        checked[name] = [entry[0], entry[1]]
    # "a" and "a/b" cannot both be files: the load would fail half-way, after fetching.
    folders = {name.rsplit("/", 1)[0] for name in checked if "/" in name}
    folders |= {folder.rsplit("/", i)[0] for folder in folders for i in range(1, folder.count("/") + 1)}
    clash = sorted(folders & set(checked))
    if clash:
        raise _damaged(url, f"the name {clash[0]!r} is both an object and a folder of others")
    return checked
