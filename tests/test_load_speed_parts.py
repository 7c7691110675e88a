"""The allow-list unpickler of DCP's ``.metadata``, made faster without weakening it (issue 43, items 5 and 6, load
side): each ``.metadata`` is read with the Python allow-list unpickler once per process and by the C unpickler after
that (one load reads it three to five times), and the holes found on the way stay shut. All in process."""

import contextlib
import copyreg
import pickle
import struct
import tracemalloc

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.metadata as dcp_metadata

from lightning_fsdp.checkpoint.integrity import safe_pickle
from lightning_fsdp.checkpoint.integrity.agreement import CheckpointError
from lightning_fsdp.checkpoint.integrity.safe_pickle import UnsafeCheckpointError, load_dcp_metadata

MIB = 2**20
ENUM = dcp_metadata._MEM_FORMAT_ENCODING  # noqa: SLF001 - the one Enum the allow-list names


@pytest.fixture
def metadata_bytes(tmp_path):
    dcp.save({"w": torch.arange(6.0).reshape(2, 3), "opt": {"lr": 0.1, "step": torch.tensor(3)}},
             checkpoint_id=tmp_path, no_dist=True)
    return (tmp_path / ".metadata").read_bytes()


@pytest.fixture(autouse=True)
def _fresh_cache():
    """Each test starts with no bytes known to be checked (other tests may have read the same fixture bytes)."""
    getattr(safe_pickle, "_CHECKED", {}).clear()
    yield
    getattr(safe_pickle, "_CHECKED", {}).clear()


def _renumber_enum(call: bytes) -> bytes:
    """``_MEM_FORMAT_ENCODING(0)`` (``call``: REDUCE or NEWOBJ, how pickle writes an Enum member) returns the
    existing member, a global; then BUILD ``{"_value_": 99}`` on it."""
    return (b"\x80\x02c" + ENUM.__module__.encode() + b"\n_MEM_FORMAT_ENCODING\nK\x00\x85" + call
            + b"N}X\x07\x00\x00\x00_value_Kcs\x86b.")


@pytest.mark.parametrize("call", [b"R", b"\x81"], ids=["REDUCE", "NEWOBJ"])
def test_an_enum_member_is_not_something_the_unpickler_made(call):
    member = ENUM.TORCH_CONTIGUOUS_FORMAT
    try:
        with pytest.raises(UnsafeCheckpointError, match=r"applies state \(BUILD\) to `_MEM_FORMAT_ENCODING`"):
            load_dcp_metadata("crafted/.metadata", data=_renumber_enum(call))
        assert member.value == 0 and ENUM(0) is member
    finally:  # on the old code the member is renumbered: put it back, or every later save writes 99
        member._value_ = 0  # noqa: SLF001


def test_bytearray8_allocates_no_more_than_the_file_holds():
    """pickle's own BYTEARRAY8 allocates (and zeroes) the length it names before reading: 256 MiB here from a
    20-byte file."""
    crafted = b"\x80\x05\x96" + struct.pack("<Q", 256 * MIB) + b"x."
    tracemalloc.start()
    try:
        with pytest.raises(CheckpointError, match="could not be read"):
            load_dcp_metadata("crafted/.metadata", data=crafted)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 * MIB, f"the read of a {len(crafted)}-byte file allocated {peak / MIB:.0f} MiB"


def test_each_metadata_is_read_by_the_python_unpickler_once(metadata_bytes, monkeypatch):
    """Later reads of the same bytes give an equal, separate object (a reader stamps its load id on its own)."""
    reads = []
    python_load = safe_pickle._AllowListUnpickler.load  # noqa: SLF001
    monkeypatch.setattr(safe_pickle._AllowListUnpickler, "load",  # noqa: SLF001
                        lambda self: reads.append(1) or python_load(self))
    first, second, third = (load_dcp_metadata("ckpt/.metadata", data=metadata_bytes) for _ in range(3))
    assert len(reads) == 1
    assert first == second == third == pickle.loads(metadata_bytes)
    assert second is not first and second.storage_meta is not first.storage_meta
    assert second.state_dict_metadata["w"] is not first.state_dict_metadata["w"]
    # Other bytes are new bytes: a changed file is read with the allow-list again.
    changed = metadata_bytes.replace(b"opt.lr", b"opt.lR")
    assert "opt.lR" in load_dcp_metadata("ckpt/.metadata", data=changed).state_dict_metadata
    assert len(reads) == 2


def test_refused_bytes_are_refused_every_time(metadata_bytes):
    """Only bytes the allow-list read to the end are remembered; refused ones go through it again."""
    crafted = b"\x80\x02cos\nsystem\nX\x04\x00\x00\x00trueR."
    for _ in range(2):
        with pytest.raises(UnsafeCheckpointError, match="names `os.system`"):
            load_dcp_metadata("crafted/.metadata", data=crafted)
    copyreg.add_extension("os", "system", 0x7A5E)
    try:  # an extension code names the same global through the registry
        for _ in range(2):
            with pytest.raises(UnsafeCheckpointError, match="names `os.system`"):
                load_dcp_metadata("crafted/.metadata", data=b"\x80\x02\x83\x5e\x7a.")
    finally:
        copyreg.remove_extension("os", "system", 0x7A5E)
    persistent = b"\x80\x02X\x01\x00\x00\x00xQ."
    for _ in range(2):
        with pytest.raises(UnsafeCheckpointError, match="persistent reference"):
            load_dcp_metadata("crafted/.metadata", data=persistent)
    load_dcp_metadata("ckpt/.metadata", data=metadata_bytes)  # the cache holds good bytes, and them only
    assert list(safe_pickle._CHECKED) == [metadata_bytes]  # noqa: SLF001


def test_a_sparse_memo_is_never_handed_to_the_c_unpickler(metadata_bytes):
    """The C unpickler sizes its memo by the largest index a PUT names (16 bytes per index up to it): a valid
    `.metadata` with one `LONG_BINPUT 0x01000000` before its STOP would cost 256 MiB on every later read."""
    sparse = metadata_bytes[:-1] + b"r" + struct.pack("<I", 0x01000000) + b"."
    assert load_dcp_metadata("ckpt/.metadata", data=sparse) == pickle.loads(metadata_bytes)
    tracemalloc.start()
    try:
        with contextlib.suppress(CheckpointError):
            load_dcp_metadata("ckpt/.metadata", data=sparse)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 * MIB, f"the second read allocated {peak / MIB:.0f} MiB"
