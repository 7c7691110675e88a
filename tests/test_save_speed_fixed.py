"""What a save to object storage pays besides its bytes (issue 43 item 6): the cyclic collector is paused while a
save runs (a full collection of the whole process cost a quarter of a sharded save), and the part buffers of the
upload sink are kept for the next save instead of being allocated, zero-filled and faulted in again each time."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest

pytestmark = pytest.mark.single_process


class _Marker(Exception):
    pass


@pytest.mark.parametrize("entry", ["save_checkpoint", "write_sharded", "write_full"])
def test_a_save_runs_with_the_cyclic_collector_paused_and_restores_it(monkeypatch, entry):
    from lightning_fsdp.checkpoint import save

    seen = []

    def first_step(*args, **kwargs):
        seen.append(gc.isenabled())
        raise _Marker(entry)

    # The first thing each entry does past its arguments: build the state (save_checkpoint) or take the guard.
    monkeypatch.setattr(save, "split_state", first_step)

    class _Comm:
        def guard(self, what):
            first_step()

    calls = {
        "save_checkpoint": lambda: save.save_checkpoint(Path("unused"), {}, full=False, comm=_Comm()),
        "write_sharded": lambda: save.write_sharded(Path("unused"), {}, {}, _Comm()),
        "write_full": lambda: save.write_full(Path("unused"), {}, _Comm()),
    }
    assert gc.isenabled()
    with pytest.raises(_Marker):
        calls[entry]()
    assert seen == [False] and gc.isenabled()
    gc.disable()  # a caller that paused it itself keeps it paused
    try:
        with pytest.raises(_Marker):
            calls[entry]()
        assert not gc.isenabled()
    finally:
        gc.enable()
