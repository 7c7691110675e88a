"""A sharded save reads each DTensor's local shard with autograd off: DCP's ``resolve_data`` calls ``to_local``,
which with grad mode on goes through an autograd Function per item, as DCP's local planning does (together about a
tenth of a save's main-thread samples in ``benchmarks/profile_checkpoint.py --mode save --py-spy``). Grad mode is
per thread, so it is turned off where they run: in the save's planner (``save._CachedPlans``) and in the writers
(the streaming one of object storage, also on a background save's thread, and the local one)."""

from __future__ import annotations

import threading
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from one_rank import one_rank_group
from streamed import streaming_writer

pytestmark = pytest.mark.single_process


@pytest.fixture(scope="module")
def one_rank():
    with one_rank_group():
        yield


def _state() -> dict:
    from torch.distributed.fsdp import fully_shard

    model = fully_shard(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)))
    return {"model": {name: p for name, p in model.state_dict().items()}}


def _streaming(folder: Path):
    return streaming_writer(folder)


def _local(folder: Path):
    from lightning_fsdp.checkpoint.integrity.digests import new_save_id
    from lightning_fsdp.checkpoint.integrity.sharded_write import ChecksumWriter

    return ChecksumWriter(folder, save_id=new_save_id())


@pytest.mark.parametrize("writer", [_streaming, _local], ids=["streaming", "local"])
@pytest.mark.parametrize("thread", ["caller", "background"])
def test_a_save_reads_every_dtensor_with_autograd_off(one_rank, tmp_path, monkeypatch, writer, thread):
    from torch.distributed.tensor import _api

    from lightning_fsdp.checkpoint.save import _CachedPlans

    applied: list[str] = []
    original = _api._ToTorchTensor.apply
    monkeypatch.setattr(_api._ToTorchTensor, "apply", lambda *a: applied.append("to_local") or original(*a))
    state = _state()
    assert all(type(t).__name__ == "DTensor" for t in state["model"].values())
    folder = tmp_path / "ckpt"
    folder.mkdir()

    def save() -> None:
        with warnings.catch_warnings():  # DCP says it saves as one process: it does
            warnings.simplefilter("ignore")
            dcp.save(state, storage_writer=writer(folder), planner=_CachedPlans(), no_dist=True)

    if thread == "caller":
        save()
    else:  # a thread of its own, where grad mode starts on whatever the caller set (a background save's writer)
        errors: list[BaseException] = []
        runner = threading.Thread(target=lambda: _catching(save, errors))
        runner.start()
        runner.join(60)
        assert not runner.is_alive() and not errors, errors
    assert applied == [], f"{len(applied)} items were read through autograd"
    loaded = {"model": {name: torch.zeros_like(t.full_tensor()) for name, t in state["model"].items()}}
    dcp.load(loaded, storage_reader=dcp.FileSystemReader(folder), no_dist=True)
    for name, tensor in state["model"].items():
        assert torch.equal(loaded["model"][name], tensor.full_tensor()), name


def _catching(action, errors: list) -> None:
    try:
        action()
    except BaseException as err:  # noqa: BLE001 - reported by the test
        errors.append(err)
