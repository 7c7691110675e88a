"""Full (one-file) checkpoints in a bucket (issue 43 item 3): the load reads the file on rank 0 alone, by byte ranges
(the other ranks fetch nothing), checks each record as it arrives and keeps nothing on local disk; the save streams
the file from memory into its object. Two ranks against the session's S3 server (moto), one launch of
``workers/streaming_full.py``, in the launch pool of the scripts against that server (``s3server.pool_env``)."""

from __future__ import annotations

import pytest

import s3server
from launch import case_tests

CASES = [
    "a_full_load_from_a_bucket_reads_the_file_on_rank_0_alone_by_ranges_and_nothing_touches_local_disk",
    "a_flipped_byte_in_a_tensor_record_fails_the_load_on_every_rank_naming_the_url_and_the_tensor",
    "checkpoint_keys_of_a_full_checkpoint_in_a_bucket_read_its_index_alone",
]


# In the launch pool of the scripts that work against the session's S3 server (``s3server.pool_env``, which starts the
# server when the pool's turn comes, in the background): with ``workers/object_storage.py``, one launch for both.
results, test_full_checkpoints_in_a_bucket = case_tests("streaming_full.py", 2, CASES, env_from=s3server.pool_env)


# ------------------------------------------------------------------------------ in this process, on memory://


def _remote_file(data: bytes):
    """``data`` as the one object of a full checkpoint committed at a ``memory://`` URL, opened by ranges."""
    import uuid

    import fsspec

    from lightning_fsdp.checkpoint.io.remote_full import RemoteFullFile
    from lightning_fsdp.checkpoint.io.remote_source import RemoteObjects

    fs = fsspec.filesystem("memory")
    target = f"memory://full-{uuid.uuid4().hex[:8]}/ckpt"
    fs.pipe_file(f"{target}/.tok/ckpt", data)
    return RemoteFullFile(RemoteObjects(fs, target, f"{target}/.tok", "full", {"ckpt": (len(data), None)}))


def _torch_saved(obj) -> bytes:
    import io

    import torch

    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


@pytest.mark.single_process
def test_a_torch_save_file_with_views_ties_and_dtypes_reads_by_ranges_exactly():
    """A file ``torch.save`` wrote (Lightning's full checkpoints are), not this package's writer: storages shared by
    views and ties, an offset view, several dtypes, a 0-d tensor and an empty one all come back as saved."""
    import torch

    weight = torch.randn(5, 7)
    table = torch.arange(24, dtype=torch.int64).reshape(4, 6)
    state = {"model": {"w": weight, "tied": weight, "t": weight.t(), "rows": table[1:3], "half": torch.randn(3).half(),
                       "b": torch.tensor([True, False]), "empty": torch.empty(0, 3)},
             "optimizer": {"state": {0: {"step": torch.tensor(4.0)}}}, "epoch": 2}
    remote = _remote_file(_torch_saved(state))
    loaded = remote.materialize(remote.load(allow_pickle=False))
    remote.finish()
    for key, value in state["model"].items():
        assert torch.equal(loaded["model"][key], value) and loaded["model"][key].dtype == value.dtype, key
    assert loaded["model"]["t"].stride() == weight.t().stride()
    assert loaded["optimizer"]["state"][0]["step"].item() == 4.0 and loaded["epoch"] == 2


@pytest.mark.single_process
def test_damaged_bytes_read_by_ranges_raise_a_checkpoint_error_naming_the_url_or_load_exactly():
    """Every byte of a small full file flipped in turn (every 3rd position), and the file cut at many lengths: the
    range reader either loads exactly what was saved (a byte no reader uses) or raises a CheckpointError naming the
    checkpoint's URL; never another error, never a hang, never a buffer sized by a damaged field."""
    import torch

    from lightning_fsdp.checkpoint.integrity.agreement import CheckpointError

    state = {"model": {"w": torch.randn(6, 4), "b": torch.arange(5.0)}, "step": 3}
    data = _torch_saved(state)
    mutations = [data[:n] for n in range(0, len(data), max(1, len(data) // 40))]
    mutations += [data[:i] + bytes([data[i] ^ 0x5A]) + data[i + 1:] for i in range(0, len(data), 3)]
    unexpected = []
    for mutated in mutations:
        try:
            remote = _remote_file(mutated)
            loaded = remote.materialize(remote.load(allow_pickle=False))
            remote.finish()
        except CheckpointError as err:
            if "memory://full-" not in str(err):
                unexpected.append(f"{type(err).__name__} without the URL: {err}")
            continue
        except Exception as err:  # noqa: BLE001 - what the test is about
            unexpected.append(f"{type(err).__name__}: {str(err)[:200]}")
            continue
        if not all(torch.equal(loaded["model"][k], v) for k, v in state["model"].items()) or loaded["step"] != 3:
            unexpected.append("loaded other values than saved without an error")
    assert not unexpected, f"{len(unexpected)} of {len(mutations)} damaged files:\n" + "\n".join(unexpected[:10])


@pytest.mark.single_process
def test_a_full_save_streamed_into_a_bucket_leaves_no_object_when_it_fails_and_the_whole_file_when_it_succeeds():
    """The full writer streams into an upload sink (no local file): a tensor that fails half-way through the file
    aborts the upload, so no object appears; a save that succeeds leaves exactly what ``torch.load`` reads back."""
    import io
    import uuid

    import fsspec
    import torch

    from lightning_fsdp.checkpoint.io.full_writer import write_streaming
    from lightning_fsdp.checkpoint.io.sink import open_upload

    fs = fsspec.filesystem("memory")
    state = {"model": {f"w{i}": torch.full((64, 64), float(i)) for i in range(4)}, "step": 1}
    failed, good = (f"memory://sink-{uuid.uuid4().hex[:8]}/{name}" for name in ("failed", "good"))

    def breaks_at_the_third(tensor, seen=[]):  # noqa: B006 - counts calls within this test
        seen.append(tensor)
        if len(seen) == 3:
            raise OSError(28, "No space left on device (on purpose)")
        return tensor

    with pytest.raises(OSError, match="on purpose"):
        write_streaming(failed, state, breaks_at_the_third, sink=open_upload(fs, failed))
    assert not fs.exists(failed)
    sink = open_upload(fs, good)
    write_streaming(good, state, lambda tensor: tensor, sink=sink)
    data = fs.cat_file(good)
    assert sink.size == len(data)
    loaded = torch.load(io.BytesIO(data), weights_only=True)
    assert loaded["step"] == 1 and all(torch.equal(loaded["model"][k], v) for k, v in state["model"].items())
