"""The streaming torch.save writer, on one process: exact round trips, and no lost collectives on errors."""

import pytest
import torch

from lightning_fsdp.checkpoint.full_writer import write_full_checkpoint, write_streaming


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
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
    with pytest.raises(Exception):
        write_streaming(tmp_path / "no" / "such" / "dir" / "ck.pt", OBJ, lambda t: seen.append(t) or t)
    assert len(seen) == 8


def test_a_write_that_fails_midway_still_visits_every_tensor(tmp_path, monkeypatch):
    import lightning_fsdp.checkpoint.full_writer as full_writer

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
