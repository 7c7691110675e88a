"""Every reader of checkpoint bytes ends in one clear error naming the file, for any bytes (issue 26).

Real files are written once, in this process (a sharded checkpoint of one rank: ``.metadata``, ``meta.pt``,
``checksums.json``; a full ``.pt`` file; a safetensors file; the ``COMMIT`` object a save to object storage writes
last), then mutated with a fixed seed and a bounded count:
byte flips, truncations (at every offset for the small files), insertions, pickle opcode swaps, huge length fields,
JSON values of the wrong type, an empty file. Each reader is handed each mutation. What counts as a pass:

- the reader raises ``CheckpointError`` (``ChecksumError`` and ``UnsafeCheckpointError`` are kinds of it) whose
  message names the file; or
- the read succeeds and the result is honest: a reader that checks the bytes (the checksum and full-file readers,
  a checksummed sharded directory) returns exactly what was saved; a reader that only parses (the raw ``.metadata``
  unpickler, the safetensors header) returns an object of the right shape, since a flip inside a name or a number
  is still a well-formed file, and catching it is the checksums' job, tested by the checksummed-directory reader;
- and each case finishes within :data:`CASE_SECONDS` (a hang is stopped by an alarm and fails).

``tests/fixtures/fuzz_corpus/<reader>/`` keeps inputs that once failed (found by this test on the code before the
fix); each is replayed as a regression case of its own. ``FUZZ_SAVE_FAILURES=DIR`` writes new failures there.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pickle
import pickletools
import random
import re
import shutil
import signal
import struct
import time
import tracemalloc
import warnings
import zipfile
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from lightning_fsdp.checkpoint.formats.commit_record import build_record, encode_record, parse_record
from lightning_fsdp.checkpoint.io.one_process import OneProcess
from lightning_fsdp.checkpoint.integrity.agreement import CheckpointError
from lightning_fsdp.checkpoint.integrity.safe_pickle import load_dcp_metadata, load_file
from lightning_fsdp.checkpoint.integrity.sharded_read import verify_sharded
from lightning_fsdp.checkpoint.integrity.zipfiles import verify_loaded
from lightning_fsdp.checkpoint.load import load_checkpoint
from lightning_fsdp.cli import main

# Every test here keeps one core busy (this process, or one subprocess at a time): they run first, beside the
# background pools (tests/conftest.py).
pytestmark = pytest.mark.single_process

SEED = 26
CASES_PER_KIND = 40  # per reader and mutation kind (every offset for truncations of the small files)
CASE_SECONDS = 5.0  # only bounds a hang or a giant loop: the slowest of 2316 cases took 21 ms (2026-11-27)
CORPUS = Path(__file__).parent / "fixtures" / "fuzz_corpus"


# ---------------------------------------------------------------------------------------------- the real files


class _OneProcess(OneProcess):
    """The collectives of a save or load in one process (the package's own), plus the guard a save asks for."""

    def guard(self, phase: str) -> Any:
        return contextlib.nullcontext()


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(4, 3)


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    from safetensors.torch import save_file

    from lightning_fsdp.checkpoint.save import write_full, write_sharded

    root = tmp_path_factory.mktemp("fuzz_sources")
    model = _model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP "assumes" one process: that is the intent here
        write_sharded(root / "sharded", {"model": dict(model.state_dict())}, {"step": 3, "note": "x"}, _OneProcess())
    write_full(root / "full.pt", {"model": model.state_dict(), "step": 3}, _OneProcess())
    save_file(dict(model.state_dict()), str(root / "model.safetensors"))
    # The COMMIT a save of that checkpoint to object storage writes (remote.py's `_upload` and `_write_commit`).
    import xxhash

    objects = {p.name: [p.stat().st_size, xxhash.xxh3_64_intdigest(p.read_bytes())]
               for p in sorted((root / "sharded").iterdir())}
    (root / "remote").mkdir()
    record = build_record("0123456789ab", "sharded", "step-3", objects, 1_700_000_000_000_000_000)
    (root / "remote" / "COMMIT").write_bytes(encode_record({**record, "time": 1_700_000_000.5}))  # fixed bytes
    return {"sharded": root / "sharded", "full": root / "full.pt", "safetensors": root / "model.safetensors",
            "commit": root / "remote"}


# ------------------------------------------------------------------------------------------------- the readers


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype \
            and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def _read_metadata(file: Path, original: Path) -> None:
    """The allow-list unpickler alone: parsing only, so a well-formed result is enough."""
    from torch.distributed.checkpoint.metadata import Metadata

    loaded = load_dcp_metadata(file)
    assert isinstance(loaded, Metadata) and isinstance(loaded.state_dict_metadata, dict), \
        f"the unpickler returned {type(loaded).__name__} without raising"


def _read_torch_file(file: Path, original: Path) -> None:
    """The full-file reader as a load uses it: read, then check every record against its checksum."""
    contents = load_file(file)
    verify_loaded(file, contents)
    assert _same(contents, load_file(original)), "the full-file reader returned other values without raising"


def _read_checksums(directory: Path, original: Path) -> None:
    """The checksum reader: every item of the checkpoint against ``checksums.json``."""
    assert verify_sharded(directory), "the checksum reader found no checksums"


@pytest.fixture(scope="module")
def one_rank_group():
    """A process group of one rank in this process, for a real load into an FSDP2 model (`fully_shard`)."""
    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _read_sharded(directory: Path, original: Path) -> None:
    """``load_checkpoint`` of the checksummed directory into a sharded model, through the agreement layer: must
    load exactly what was saved, or raise."""
    from torch.distributed.fsdp import fully_shard

    model = fully_shard(_model())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rest = load_checkpoint(directory, {"model": model}, strict=False, comm=_OneProcess())
    saved = _model().weight
    assert torch.equal(model.weight.full_tensor(), saved) and rest == {"step": 3, "note": "x"}, \
        "the load returned other values without raising"


def _read_commit(directory: Path, original: Path) -> None:
    """The COMMIT reader of object storage (through the store, as a load reads it; the filesystem here is the local
    one): the saved record, or one damage error naming the COMMIT. Its names decide where a load writes, so a record
    other than the saved one is a failure even when it is well formed."""
    from lightning_fsdp.checkpoint.io.remote import FsspecStore

    record = FsspecStore("file", None).read_commit(str(directory))
    assert record == parse_record((original / "COMMIT").read_bytes(), str(original)), \
        f"the COMMIT reader returned another record without raising: {str(record)[:300]}"


def _read_safetensors(file: Path, original: Path) -> None:
    """The safetensors header reader of pretrained loading (it plans the reads from the header alone)."""
    from lightning_fsdp.checkpoint.hf import _RangedReader, _snapshot
    from lightning_fsdp.checkpoint.io.store import store_for

    store = store_for(file)  # what rank 0 reads (the header's bytes), then what every rank parses of them
    _RangedReader(_snapshot(store, file), progress=False, store=store).read_metadata()


# ----------------------------------------------------------------------------------------------- the mutations


def _pickle_ops(data: bytes) -> list[tuple[int, Any, Any]]:
    """``(position, opcode, argument)`` of every opcode of the pickle ``data``."""
    return [(pos, op, arg) for op, arg, pos in pickletools.genops(data)]


_LENGTH_OPS = {"BINUNICODE": "<I", "BINBYTES": "<I", "SHORT_BINUNICODE": "<B", "SHORT_BINSTRING": "<B",
               "SHORT_BINBYTES": "<B", "BINUNICODE8": "<Q", "BINBYTES8": "<Q", "BYTEARRAY8": "<Q", "FRAME": "<Q",
               "LONG4": "<i", "BINSTRING": "<i"}
_OPCODES = sorted({op.code.encode("latin-1")[0] for op in pickletools.opcodes})
_HUGE = (2**31 - 1, 2**32 - 1, 2**62, 2**63 - 1, 2**64 - 1)


def _pickle_mutations(data: bytes, rng: random.Random, base: int = 0, whole: bytes = b"") -> list[tuple[str, bytes]]:
    """Opcode swaps and huge length fields in the pickle ``data``, found at offset ``base`` of ``whole``."""
    whole = whole or data
    ops = _pickle_ops(data)
    cases = []
    for pos, op, _ in rng.sample(ops, min(CASES_PER_KIND, len(ops))):
        new = rng.choice([b for b in _OPCODES if b != data[pos]] + [0x00, 0xFF])
        at = base + pos
        cases.append((f"opcode-{op.name}@{pos}->{new:#x}", whole[:at] + bytes([new]) + whole[at + 1:]))
    for pos, op, _ in ops:
        fmt = _LENGTH_OPS.get(op.name)
        if fmt is None:
            continue
        size = struct.calcsize(fmt)
        for huge in _HUGE:
            value = huge if fmt[1] in "QI" else huge % (2 ** (8 * size - (fmt[1] == "i")))
            if fmt[1] == "B":
                value = 255
            if value >= 2 ** (8 * size):
                continue
            at = base + pos + 1
            cases.append((f"length-{op.name}@{pos}={value}", whole[:at] + struct.pack(fmt, value) + whole[at + size:]))
    return cases


def _byte_mutations(data: bytes, rng: random.Random, every_truncation: bool) -> list[tuple[str, bytes]]:
    cases = [("empty", b"")]
    cuts = range(len(data)) if every_truncation else sorted(rng.sample(range(len(data)), CASES_PER_KIND))
    cases += [(f"truncated@{cut}", data[:cut]) for cut in cuts]
    for _ in range(CASES_PER_KIND):
        at, mask = rng.randrange(len(data)), rng.randrange(1, 256)
        cases.append((f"flip@{at}^{mask:#x}", data[:at] + bytes([data[at] ^ mask]) + data[at + 1:]))
    for _ in range(CASES_PER_KIND):
        at, extra = rng.randrange(len(data) + 1), bytes(rng.randrange(256) for _ in range(rng.randrange(1, 9)))
        cases.append((f"insert@{at}+{extra.hex()}", data[:at] + extra + data[at:]))
    return cases


def _zip_pickle(data: bytes) -> tuple[int, bytes]:
    """Where a ``torch.save`` archive stores its ``data.pkl`` (uncompressed), and its bytes."""
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        info = next(i for i in archive.infolist() if i.filename.endswith("/data.pkl"))
        name_length, extra_length = struct.unpack("<HH", data[info.header_offset + 26:info.header_offset + 30])
        start = info.header_offset + 30 + name_length + extra_length
        return start, data[start:start + info.file_size]


def _json_mutations(text: bytes, variants: list[Callable[[Any], Any]]) -> list[tuple[str, bytes]]:
    cases = []
    for i, change in enumerate(variants):
        value = json.loads(text)
        value = change(value) or value
        cases.append((f"json-{i}", json.dumps(value).encode()))
    return cases


def _set(path: tuple, new: Any) -> Callable[[Any], Any]:
    def change(value: Any) -> Any:
        node = value
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = new
    return change


_MANIFEST_TYPES = [
    lambda v: [], lambda v: "x", lambda v: 7, _set(("items",), "x"), _set(("items",), {"a": 1}),
    _set(("items",), [[1, 2]]), _set(("items",), [["__0_0.distcp", "0", 1, 2, "w"]]),
    _set(("items",), [[["f"], 0, 1, 2, "w"]]), _set(("items",), [["__0_0.distcp", 0, -5, 2, "w"]]),
    _set(("items",), [["__0_0.distcp", 0, 2**70, 2, "w"]]), _set(("save_id",), 5), _set(("save_id",), None),
    _set(("algorithm",), [1]), _set(("algorithm",), "md5"), _set(("files",), []), _set(("files",), {"meta.pt": 1}),
    _set(("files",), {"meta.pt": ["a", "b"]}), _set(("files",), {"meta.pt": [1]}), _set(("format",), "two"),
    _set(("items",), None), _set(("files",), {".metadata": [2**70, 1]}),
]
_HEADER_TYPES = [
    lambda v: [], lambda v: 5, lambda v: {k: "x" for k in v}, lambda v: {k: {"dtype": 5} for k in v},
    lambda v: {k: {**e, "shape": "ab"} for k, e in v.items()},
    lambda v: {k: {**e, "shape": [2**62, 2**62]} for k, e in v.items()},
    lambda v: {k: {**e, "data_offsets": [-1, 2**70]} for k, e in v.items()},
    lambda v: {k: {**e, "data_offsets": [0]} for k, e in v.items()},
    lambda v: {**v, "__metadata__": {"a": 1}}, lambda v: {**v, "__metadata__": []},
    lambda v: {k: {**e, "dtype": "F33"} for k, e in v.items()},
]


_COMMIT_TYPES = [
    lambda v: [1], lambda v: "x", lambda v: 7, _set(("objects",), [1]), _set(("objects",), None),
    _set(("objects",), {"/abs/site-packages/x.pth": [1, None]}), _set(("objects",), {"../../../x.pth": [1, None]}),
    _set(("objects",), {"a\\b": [1, None]}), _set(("objects",), {"a/./b": [1, None]}), _set(("objects",), {"": [1, 2]}),
    _set(("objects",), {"a\u0000b": [1, None]}), _set(("objects",), {"C:x": [1, None]}), _set(("name",), ".."),
    _set(("name",), "a/b"), _set(("token",), "../x"), _set(("token",), None), _set(("kind",), 1),
    _set(("objects",), {"a": [-1, None]}), _set(("objects",), {"a": [2**70, None]}),
    _set(("objects",), {"a": ["1", None]}),
    _set(("objects",), {"a": [1, "d"]}), _set(("objects",), {"a": [1]}), _set(("commit_order",), -1),
    _set(("commit_order",), "1"), _set(("time",), None), _set(("version",), "1"), _set(("format",), "x"),
]


def _commit_mutations(data: bytes) -> list[tuple[str, bytes]]:
    """Each JSON variant twice: with its digest made again (the field checks must refuse it) and without one (a
    record as the previous release wrote it, still read when every field passes)."""
    cases = []
    for name, mutated in _json_mutations(data, _COMMIT_TYPES):
        value = json.loads(mutated)
        if not isinstance(value, dict):
            cases.append((name, mutated))
            continue
        value.pop("digest", None)
        cases += [(f"{name}-digest", encode_record(value)), (f"{name}-no-digest", json.dumps(value).encode())]
    return cases


def _safetensors_with_header(data: bytes, header: bytes) -> bytes:
    length, = struct.unpack("<Q", data[:8])
    return struct.pack("<Q", len(header)) + header + data[8 + length:]


def _safetensors_mutations(data: bytes, rng: random.Random) -> list[tuple[str, bytes]]:
    length, = struct.unpack("<Q", data[:8])
    header = data[8:8 + length]
    cases = _byte_mutations(data[:8 + length + 16], rng, every_truncation=True)  # the header and a little data
    cases = [(name, mutated + data[8 + length + 16:]) if not name.startswith(("truncated", "empty")) else
             (name, mutated) for name, mutated in cases]
    cases += [(f"header-length={huge}", struct.pack("<Q", huge) + data[8:]) for huge in (*_HUGE, length + 1, 0)]
    cases += [(name, _safetensors_with_header(data, mutated))
              for name, mutated in _json_mutations(header.rstrip(), _HEADER_TYPES)]
    return cases


# --------------------------------------------------------------------------------------------------- the checks


@contextlib.contextmanager
def _bounded(seconds: float):
    def hang(*_):
        raise TimeoutError(f"the reader took longer than {seconds} s")

    previous = signal.signal(signal.SIGALRM, hang)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _outcome(read: Callable[[Path, Path], None], where: Path, named: Path, original: Path) -> str:
    """'' for an honest outcome; else what went wrong."""
    started = time.perf_counter()
    try:
        with _bounded(CASE_SECONDS):
            read(where, original)
    except CheckpointError as err:
        if str(named) not in str(err):
            return f"CheckpointError without the file {str(named)!r}: {str(err)[:300]}"
    except TimeoutError as err:
        return str(err)
    except AssertionError as err:
        return f"no error, and {err}"
    except BaseException as err:  # noqa: BLE001 - any other type is the failure under test
        return f"{type(err).__name__}: {str(err)[:300]}"
    took = time.perf_counter() - started
    return f"took {took:.1f} s" if took > CASE_SECONDS else ""


class _Fuzz:
    """Runs one reader over mutations of one file, each in a fresh copy of its checkpoint."""

    def __init__(self, tmp: Path, reader: str, read: Callable[[Path, Path], None], source: Path,
                 file: str = "") -> None:
        self.tmp, self.reader, self.read, self.source, self.file = tmp, reader, read, source, file
        self.failures: list[str] = []
        self.count = 0

    @property
    def data(self) -> bytes:
        return (self.source / self.file if self.file else self.source).read_bytes()

    def run(self, name: str, data: bytes) -> str:
        self.count += 1
        case = self.tmp / f"{self.reader}-{self.count}"
        if self.file:  # a file inside a checkpoint directory: the reader gets the directory
            shutil.copytree(self.source, case)
            target = case / self.file
            target.write_bytes(data)
            where = case
        else:
            case.mkdir()
            target = where = case / self.source.name
            target.write_bytes(data)
        problem = _outcome(self.read, where, target, self.source)
        if problem:
            self.failures.append(f"{name}: {problem}")
            _save_failure(self.reader, name, data)
        shutil.rmtree(case, ignore_errors=True)
        return problem

    def check(self) -> None:
        assert self.count, "no case ran"
        assert not self.failures, (f"{len(self.failures)} of {self.count} mutations failed:\n  "
                                   + "\n  ".join(self.failures[:25]))


def _save_failure(reader: str, name: str, data: bytes) -> None:
    target = os.environ.get("FUZZ_SAVE_FAILURES")
    if target:
        folder = Path(target) / reader
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{_file_name(name)}.bin").write_bytes(data)


def _file_name(case: str) -> str:
    """A case's name as a portable file name: ``flip@58^0xab`` -> ``flip-at-58-xor-0xab``."""
    for old, new in (("->", "-to-"), ("^", "-xor-"), ("@", "-at-"), ("=", "-"), ("+", "-plus-"), ("/", "_")):
        case = case.replace(old, new)
    return case


# --------------------------------------------------------------------------------------------------- the tests


def test_readers_accept_the_files_as_saved(files, tmp_path, one_rank_group):
    """Each reader, handed the unchanged file, succeeds: so an error in the cases below is about the mutation."""
    for reader, (read, source, file) in _CORPUS_READERS.items():
        fuzz = _Fuzz(tmp_path, reader, read, source(files), file)
        assert not fuzz.run("unchanged", fuzz.data), reader


def test_dcp_metadata_unpickler(files, tmp_path):
    fuzz = _Fuzz(tmp_path, "metadata", _read_metadata, files["sharded"] / ".metadata")
    rng = random.Random(SEED)
    data = fuzz.data
    for name, mutated in _byte_mutations(data, rng, every_truncation=True) + _pickle_mutations(data, rng):
        fuzz.run(name, mutated)
    fuzz.check()


def test_checksummed_sharded_directory(files, tmp_path, one_rank_group):
    """``.metadata`` and ``meta.pt`` inside a checkpoint whose checksums bind them: every change is refused."""
    rng = random.Random(SEED + 1)
    for file in (".metadata", "meta.pt"):
        fuzz = _Fuzz(tmp_path, f"sharded-{file}", _read_sharded, files["sharded"], file)
        data = fuzz.data
        cases = _byte_mutations(data, rng, every_truncation=False)
        cases = rng.sample(cases, 30) + [("garbage", b"\x00garbage" * 10)]  # a load costs more: fewer cases
        for name, mutated in cases:
            fuzz.run(name, mutated)
        fuzz.check()


def test_torch_save_files(files, tmp_path):
    """A full checkpoint file and a ``meta.pt``: the zip archive, and the pickle inside it."""
    rng = random.Random(SEED + 2)
    for label, source in (("full", files["full"]), ("meta", files["sharded"] / "meta.pt")):
        fuzz = _Fuzz(tmp_path, label, _read_torch_file, source)
        data = fuzz.data
        start, pickled = _zip_pickle(data)
        for name, mutated in (_byte_mutations(data, rng, every_truncation=False)
                              + _pickle_mutations(pickled, rng, base=start, whole=data)):
            fuzz.run(name, mutated)
        fuzz.check()


def test_checksums_manifest(files, tmp_path):
    fuzz = _Fuzz(tmp_path, "checksums", _read_checksums, files["sharded"], "checksums.json")
    rng = random.Random(SEED + 3)
    data = fuzz.data
    cases = _byte_mutations(data, rng, every_truncation=False) + _json_mutations(data, _MANIFEST_TYPES)
    cases += [("deep", b"[" * 100_000 + b"]" * 100_000), ("huge-int", data.replace(b'"items": [', b'"items": [' + b"9" * 5000 + b", ", 1))]
    for name, mutated in cases:
        fuzz.run(name, mutated)
    fuzz.check()


def test_a_manifest_whose_file_name_is_damaged_names_the_manifest(files, tmp_path):
    """A flipped byte inside the name `.metadata` in `checksums.json` (seen once in CI: flip@264) left a manifest that
    parses but records no `.metadata`: the reader then blamed `.metadata` as copied in, not the damaged manifest."""
    fuzz = _Fuzz(tmp_path, "checksums", _read_checksums, files["sharded"], "checksums.json")
    data = fuzz.data
    assert b'".metadata"' in data, data[:300]
    # One flipped byte of the `t`: to a printable one (`t` ^ 0x01 is `u`), the manifest still parses and names a file
    # no save records, the case CI met; to the byte 0x14 (`t` ^ 0x60), a control character JSON refuses raw. And the
    # six characters `\u0014` (the JSON escape of that byte), with which the manifest parses into a name holding it.
    for name, renamed in (("printable", b'".meuadata"'), ("byte-0x14", b'".me\x14adata"'),
                          ("json-escape", rb'".me\u0014adata"')):
        fuzz.run(f"renamed-.metadata-{name}", data.replace(b'".metadata"', renamed, 1))
    fuzz.check()


def test_commit_record(files, tmp_path):
    """The COMMIT object (issue 45 item 1, issue 42 item 5): untrusted bytes whose names a load joins onto a folder."""
    fuzz = _Fuzz(tmp_path, "commit", _read_commit, files["commit"], "COMMIT")
    data = fuzz.data
    cases = _byte_mutations(data, random.Random(SEED + 6), every_truncation=True) + _commit_mutations(data)
    huge = b'"objects": {"x": [' + b"9" * 5000 + b", null], "
    cases += [("deep", b"[" * 100_000 + b"]" * 100_000), ("huge-int", data.replace(b'"objects": {', huge, 1)),
              ("twice", data[:-1] + b', "kind": "full"}')]
    for name, mutated in cases:
        fuzz.run(name, mutated)
    fuzz.check()


def test_safetensors_header(files, tmp_path):
    fuzz = _Fuzz(tmp_path, "safetensors", _read_safetensors, files["safetensors"])
    for name, mutated in _safetensors_mutations(fuzz.data, random.Random(SEED + 4)):
        fuzz.run(name, mutated)
    fuzz.check()


def test_huge_lengths_allocate_nothing_large(files, tmp_path):
    """A length field of 2**32 - 1 (or 2**63) makes no reader allocate anything near it: the bytes that are there
    bound every read."""
    data = (files["sharded"] / ".metadata").read_bytes()
    cases = [(n, d) for n, d in _pickle_mutations(data, random.Random(SEED)) if n.startswith("length-")]
    assert cases, "the metadata holds no opcode with a length field"
    tracemalloc.start()
    try:
        for name, mutated in cases:
            (tmp_path / ".metadata").write_bytes(mutated)
            tracemalloc.reset_peak()
            with contextlib.suppress(CheckpointError):
                load_dcp_metadata(tmp_path / ".metadata")
            peak = tracemalloc.get_traced_memory()[1]
            assert peak < 64 * 2**20, f"{name}: the read allocated {peak / 2**20:.0f} MiB for a {len(mutated)}-byte file"
    finally:
        tracemalloc.stop()


# The corpus folders are the readers' labels above: reader, the source file or directory, the file in it.
_CORPUS_READERS: dict[str, tuple[Callable[[Path, Path], None], Callable[[dict], Path], str]] = {
    "metadata": (_read_metadata, lambda f: f["sharded"] / ".metadata", ""),
    "sharded-.metadata": (_read_sharded, lambda f: f["sharded"], ".metadata"),
    "sharded-meta.pt": (_read_sharded, lambda f: f["sharded"], "meta.pt"),
    "full": (_read_torch_file, lambda f: f["full"], ""),
    "meta": (_read_torch_file, lambda f: f["sharded"] / "meta.pt", ""),
    "checksums": (_read_checksums, lambda f: f["sharded"], "checksums.json"),
    "safetensors": (_read_safetensors, lambda f: f["safetensors"], ""),
    "commit": (_read_commit, lambda f: f["commit"], "COMMIT"),
}
_CORPUS = sorted(CORPUS.glob("*/*.bin"))


@pytest.mark.parametrize("entry", _CORPUS, ids=[f"{p.parent.name}/{p.stem}" for p in _CORPUS])
def test_corpus_of_inputs_that_once_failed(files, tmp_path, one_rank_group, entry):
    read, source, file = _CORPUS_READERS[entry.parent.name]
    fuzz = _Fuzz(tmp_path, entry.parent.name, read, source(files), file)
    # The files bind themselves to their save's id (in `.metadata`, seeding every digest in `checksums.json`); an
    # input saved from an earlier run gets this run's id, so it is checked as damage, not as another save's file.
    fresh = json.loads((files["sharded"] / "checksums.json").read_bytes())["save_id"].encode()
    problem = fuzz.run(entry.stem, _SAVE_ID.sub(fresh, entry.read_bytes()))
    assert not problem, problem


_SAVE_ID = re.compile(rb"lightning-fsdp:bound:[0-9a-f]{32}")


def test_corpus_is_there():
    """The regression corpus is replayed above; an empty glob would pass by running nothing."""
    assert {p.parent.name for p in _CORPUS} >= {"metadata", "sharded-.metadata", "full", "checksums", "safetensors",
                                                "commit"}


# ------------------------------------------------------------------------------------------ the command line


@pytest.mark.parametrize("command", ["inspect", "convert"])
def test_command_prints_one_line_and_exits_2_for_damaged_metadata(files, tmp_path, capsys, command):
    """The issue's reproduction: `.metadata` overwritten with garbage, and a few mutations of it."""
    rng = random.Random(SEED + 5)
    data = (files["sharded"] / ".metadata").read_bytes()
    cases = [("garbage", b"\x00garbage" * 10), ("empty", b"")] + rng.sample(
        _byte_mutations(data, rng, every_truncation=False) + _pickle_mutations(data, rng), 12)
    for i, (name, mutated) in enumerate(cases):
        case = tmp_path / f"ck{i}"
        shutil.copytree(files["sharded"], case)
        (case / ".metadata").write_bytes(mutated)
        args = [command, str(case)] + ([str(tmp_path / f"out{i}.pt"), "--to", "full"] if command == "convert" else [])
        status = main(args)
        out, err = capsys.readouterr()
        assert status == 2, f"{name}: exit status {status}, stderr: {err[-500:]}"
        assert len(err.strip().splitlines()) == 1 and err.startswith("lightning-fsdp: error: "), f"{name}: {err}"
        assert str(case / ".metadata") in err, f"{name}: the damaged file is not named: {err}"
        assert err.count("HINT:") == 1 and not out, f"{name}: one message, one fix: {err}"
        assert not (tmp_path / f"out{i}.pt").exists()


def test_the_installed_command_prints_one_line_and_exits_2(files, tmp_path):
    """The issue's reproduction as a user runs it: `python -m lightning_fsdp inspect DIR`, a process of its own. It
    is forked from a warm server (``forkserver.python()`` in the launches' environment, ``worker_env``, whose server
    the suite starts when collection ends: this test runs early, before any other environment has one): its exit
    status, output and warnings are its own process's, and it skips the 4 s of imports of a real interpreter, which
    this check is not about (``tests/test_cli.py`` runs the installed entry points as real processes)."""
    import subprocess

    import forkserver
    from launch import worker_env

    case = tmp_path / "ck"
    shutil.copytree(files["sharded"], case)
    (case / ".metadata").write_bytes(b"\x00garbage" * 10)
    run = subprocess.run([forkserver.python(), "-m", "lightning_fsdp", "inspect", str(case)], capture_output=True,
                         text=True, timeout=120, env=worker_env(tmp_path / "out"))
    assert run.returncode == 2, (run.returncode, run.stderr[-2000:])
    assert len(run.stderr.strip().splitlines()) == 1 and str(case / ".metadata") in run.stderr, run.stderr[-2000:]
    assert "Traceback" not in run.stderr and not run.stdout
