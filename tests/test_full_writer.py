"""The streaming torch.save writer, on one process: exact round trips, and no lost collectives on errors."""

import pytest
import torch

from lightning_fsdp.checkpoint.io.full_writer import write_full_checkpoint, write_streaming


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's values as bytes: exact for every dtype (NaN payloads, float8 without `torch.equal`)."""
    return t.detach().resolve_conj().resolve_neg().contiguous().reshape(-1).view(torch.uint8)


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(_bytes(a), _bytes(b)))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


OBJ = {
    "model": {
        "w": torch.randn(3, 4),
        "ids": torch.arange(5),
        "half": torch.randn(2, 2).to(torch.bfloat16),
        "scalar": torch.tensor(3.0),
        "empty": torch.empty(0, 3),
        "view": torch.randn(4, 6)[:, 1:3],  # not contiguous: written as a contiguous copy
    },
    "optimizer": {"state": {"w": {"step": torch.tensor(1.0), "exp_avg": torch.randn(3, 4)}},
                  "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99), "params": ["w"]}]},
    "step": 7,
    "name": "run",
    "pair": (1, [2, 3]),
}


@pytest.mark.parametrize("mmap", [False, True])
def test_round_trip_with_weights_only(tmp_path, mmap):
    path = tmp_path / "ck.pt"
    write_full_checkpoint(path, OBJ, is_writer=True)
    assert _equal(OBJ, torch.load(path, weights_only=True, mmap=mmap))


def test_non_writer_writes_nothing_but_visits_every_tensor(tmp_path):
    seen = []
    write_streaming(None, OBJ, lambda t: seen.append(t) or t)
    assert len(seen) == 8 and not list(tmp_path.iterdir())


def test_a_file_that_cannot_be_opened_still_visits_every_tensor(tmp_path):
    # On a multi-rank save each visit is a gather the other ranks also take part in; skipping one would hang them.
    seen = []
    target = tmp_path / "no" / "such" / "dir" / "ck.pt"
    with pytest.raises(FileNotFoundError, match="No such file or directory") as info:
        write_streaming(target, OBJ, lambda t: seen.append(t) or t)
    assert info.value.filename == str(target)
    assert len(seen) == 8


def test_a_write_that_fails_midway_still_visits_every_tensor(tmp_path, monkeypatch):
    import lightning_fsdp.checkpoint.io.full_writer as full_writer

    real = full_writer.open_zipfile_writer

    class DiskFullAfterThreeRecords:
        def __init__(self, name):
            self.inner = real(name)

        def __enter__(self):
            writer = self.inner.__enter__()
            count = {"n": 0}

            class Proxy:
                def write_record(self, *args):
                    count["n"] += 1
                    if count["n"] > 3:
                        raise OSError("No space left on device (simulated)")
                    return writer.write_record(*args)

            return Proxy()

        def __exit__(self, *exc):
            return self.inner.__exit__(*exc)

    monkeypatch.setattr(full_writer, "open_zipfile_writer", DiskFullAfterThreeRecords)
    seen = []
    with pytest.raises(OSError, match="No space left"):
        write_streaming(tmp_path / "ck.pt", OBJ, lambda t: seen.append(t) or t)
    assert len(seen) == 8


# --- exact bytes: every record holds exactly the elements its pickled reference declares (offset 0, numel) -------

def _values(dtype: torch.dtype, *shape: int) -> torch.Tensor:
    """Distinct, non-trivial values of ``dtype`` (random bytes where no arithmetic exists, as for float8)."""
    g = torch.Generator().manual_seed(0)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_floating_point or dtype.is_complex:
        if dtype.itemsize == 1:  # float8 types: any byte is a value
            return torch.randint(0, 256, shape, generator=g, dtype=torch.uint8).view(dtype)
        return torch.randn(shape, generator=g, dtype=torch.float64 if not dtype.is_complex else torch.complex128
                           ).to(dtype)
    return torch.randint(0, 100, shape, generator=g).to(dtype)


# Every dtype torch.save writes, whether it names a legacy storage class (float32 -> FloatStorage) or writes an
# untyped storage plus the dtype (float8, uint16/32/64, complex32).
DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int8, torch.int16, torch.int32,
          torch.int64, torch.uint8, torch.bool, torch.complex64, torch.complex128, torch.float8_e4m3fn,
          torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz, torch.float8_e8m0fnu, torch.uint16,
          torch.uint32, torch.uint64, pytest.param(torch.complex32, marks=pytest.mark.filterwarnings(
              "ignore:ComplexHalf support is experimental"))]


def _views(dtype: torch.dtype) -> dict:
    """Tensors whose memory is not exactly their own elements in order."""
    base = _values(dtype, 40)
    padded = base.view(10, 4)[:9]  # offset 0, storage longer: what FSDP2's full_tensor() of an uneven dim 0 gives
    return {
        "whole": _values(dtype, 3, 5),
        "padded": padded,
        "offset": base[8:20],  # a view with an offset, e.g. {"recent": history[8:]}
        "offset_2d": base[4:40].view(6, 6)[2:],
        "transposed": base[:12].view(3, 4).t(),
        "strided": base[1::3],
        "columns": base.view(8, 5)[:, 1:3],
        "expanded": base[5:7].expand(3, 2),  # stride 0
        "scalar": _values(dtype),
        "scalar_view": base[7],  # 0-d, at an offset
        "empty": _values(dtype, 0, 3),
        "empty_at_end": base[40:],
        "empty_inside": base[5:5],
    }


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_dtype_and_view_round_trips_exactly(tmp_path, dtype):
    obj = {"model": _views(dtype), "step": 3}
    path = tmp_path / "ck.pt"
    write_full_checkpoint(path, obj, is_writer=True)
    # Without mmap, torch.load checks every record's size against the pickled reference; with it, it does not, and
    # only the values tell a record written from the wrong offset.
    assert _equal(obj, torch.load(path, weights_only=True))
    assert _equal(obj, torch.load(path, weights_only=True, mmap=True))


def test_lazy_conjugate_and_negative_views_round_trip_as_their_values(tmp_path):
    z = _values(torch.complex64, 6)
    obj = {"conj": z.conj(), "neg": z.conj().imag, "conj_offset": z[2:].conj()}
    assert obj["conj"].is_conj() and obj["neg"].is_neg()
    path = tmp_path / "ck.pt"
    write_full_checkpoint(path, obj, is_writer=True)
    for mmap in (False, True):
        loaded = torch.load(path, weights_only=True, mmap=mmap)
        assert _equal(obj, loaded) and torch.equal(loaded["conj"], torch.conj_physical(z))


def test_tensors_sharing_one_storage_are_written_separately(tmp_path):
    base = torch.arange(10.0)
    obj = {"a": base[:6], "b": base[4:], "tied": base, "again": base}  # overlapping views, and one tensor twice
    path = tmp_path / "ck.pt"
    write_full_checkpoint(path, obj, is_writer=True)
    assert _equal(obj, torch.load(path, weights_only=True))


def test_a_view_is_written_without_copying_its_elements(tmp_path, monkeypatch):
    # A full save holds each gathered parameter on rank 0; a copy of it on top would double the peak for a big one.
    import lightning_fsdp.checkpoint.io.full_writer as full_writer

    real = full_writer.open_zipfile_writer
    written = {}

    class Recording:
        def __init__(self, name):
            self.inner = real(name)

        def __enter__(self):
            writer = self.inner.__enter__()

            class Proxy:
                def write_record(self, name, data, size):
                    if isinstance(data, torch.UntypedStorage):
                        written[name] = (data.data_ptr(), size)
                    return writer.write_record(name, data, size)

            return Proxy()

        def __exit__(self, *exc):
            return self.inner.__exit__(*exc)

    monkeypatch.setattr(full_writer, "open_zipfile_writer", Recording)
    padded = torch.arange(40.0).view(10, 4)[:9]
    offset = torch.arange(40.0)[8:]
    write_full_checkpoint(tmp_path / "ck.pt", {"padded": padded, "offset": offset}, is_writer=True)
    assert written == {"data/0": (padded.data_ptr(), 9 * 4 * 4), "data/1": (offset.data_ptr(), 32 * 4)}


@pytest.mark.parametrize("make, problem", [
    (lambda: torch.eye(2).to_sparse(), "is a torch.sparse_coo tensor"),
    pytest.param(lambda: torch.quantize_per_tensor(torch.randn(3), 0.1, 0, torch.qint8), "is a quantized tensor",
                 marks=pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor.*deprecated")),
], ids=["sparse", "quantized"])
def test_a_tensor_the_skeleton_cannot_describe_is_refused_before_any_gather(tmp_path, make, problem):
    seen = []
    obj = {"model": {"w": torch.ones(2), "odd": make()}}
    with pytest.raises(TypeError, match=rf"The checkpoint entry state\['model'\]\['odd'\] {problem}.*HINT"):
        write_streaming(tmp_path / "ck.pt", obj, lambda t: seen.append(t) or t)
    with pytest.raises(TypeError, match=problem):
        write_streaming(None, obj, lambda t: seen.append(t) or t)  # a non-writer rank raises the same, at once
    assert seen == [] and not list(tmp_path.iterdir())
