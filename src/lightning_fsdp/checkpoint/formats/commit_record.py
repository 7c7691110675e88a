"""The ``COMMIT`` object of a checkpoint on object storage: what it holds, how it is written and how it is read.

It is the one object a save writes last and a load reads first (:mod:`~lightning_fsdp.checkpoint.io.remote`):

    {"format": "lightning-fsdp-commit", "version": 1, "token": ..., "kind": "sharded" | "full", "name": ...,
     "objects": {name: [size, digest or null]}, "commit_order": ..., "time": ...}

A COMMIT in a bucket is untrusted input: anyone who can write one object there can write it. :func:`parse_record`
is the one reader, and everything a load later does with the record (which objects to fetch, where to put them)
comes from what it returns.
"""

from __future__ import annotations

import json
import time
from typing import Any, Optional

from lightning_fsdp.checkpoint.formats.commit_order import COMMIT_ORDER_KEY

__all__ = ["COMMIT_NAME", "COMMIT_FORMAT", "COMMIT_VERSION", "build_record", "encode_record", "parse_record"]

COMMIT_NAME = "COMMIT"
COMMIT_FORMAT = "lightning-fsdp-commit"
COMMIT_VERSION = 1


def build_record(token: str, kind: str, name: str, objects: dict[str, list], commit_order: int) -> dict[str, Any]:
    return {"format": COMMIT_FORMAT, "version": COMMIT_VERSION, "token": token, "kind": kind, "name": name,
            "objects": objects, COMMIT_ORDER_KEY: commit_order, "time": time.time()}


def encode_record(record: dict[str, Any]) -> bytes:
    return json.dumps(record, sort_keys=True).encode()


def parse_record(payload: bytes, url: str) -> dict[str, Any]:
    """The record in ``payload`` (the bytes of the COMMIT at ``url``), or ``ValueError`` naming ``url``."""
    try:
        record: Optional[Any] = json.loads(payload)
    except ValueError as err:  # UnicodeDecodeError too
        record, why = None, repr(err)
    else:
        why = "not a lightning-fsdp commit record, or one without its token and objects"
    if not (isinstance(record, dict) and record.get("format") == COMMIT_FORMAT
            and isinstance(record.get("objects"), dict) and isinstance(record.get("token"), str)):
        raise ValueError(f"{url!r} is not a commit record this version reads ({why})."
                         " HINT: load it with the lightning-fsdp version that saved it, or a newer one.")
    return record
