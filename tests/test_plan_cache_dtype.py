"""The save's plan cache (``save._CachedPlans``, DCP's own cache) must not keep a tensor's old dtype in ``.metadata``:
DCP calls a plan unchanged when names, offsets and sizes match, so a tensor cast to another dtype of the same size
between two saves in one process (fp16 -> bf16) was written in its new dtype under a ``.metadata`` that recorded the
old one, and a reader trusting ``.metadata`` (a resharded load reads partial payloads by it) loaded other numbers."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp

from lightning_fsdp.checkpoint.io.one_process import OneProcess
from lightning_fsdp.checkpoint.load import load_checkpoint
from lightning_fsdp.checkpoint.save import write_sharded


@pytest.mark.single_process
def test_a_tensor_that_changed_dtype_between_saves_is_recorded_and_loaded_in_its_new_dtype(tmp_path):
    torch.manual_seed(0)
    half = torch.randn(8, 8).half()
    write_sharded(tmp_path / "a", {"model": {"w": half, "b": torch.ones(3)}}, {"step": 1}, OneProcess())
    brain = half.bfloat16()  # the same element size: DCP's plan comparison saw no change
    write_sharded(tmp_path / "b", {"model": {"w": brain, "b": torch.ones(3)}}, {"step": 2}, OneProcess())
    recorded = {n: dcp.FileSystemReader(tmp_path / n).read_metadata().state_dict_metadata["model.w"].properties.dtype
                for n in "ab"}
    assert recorded == {"a": torch.float16, "b": torch.bfloat16}
    into = {"model": {"w": torch.zeros(8, 8, dtype=torch.bfloat16), "b": torch.zeros(3)}}
    load_checkpoint(tmp_path / "b", into, comm=OneProcess())
    assert torch.equal(into["model"]["w"], brain)
    # an unchanged save after that records the same dtype (whether it came from the cache is not checked here)
    write_sharded(tmp_path / "c", {"model": {"w": brain, "b": torch.ones(3)}}, {"step": 3}, OneProcess())
    assert dcp.FileSystemReader(tmp_path / "c").read_metadata().state_dict_metadata["model.w"].properties.dtype \
        == torch.bfloat16
