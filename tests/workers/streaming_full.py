"""Two-rank cases of full (one-file) checkpoints in a bucket (issue 43 item 3; ``tests/test_streaming_full.py``, moto
started by the test, its endpoint in the environment): the load reads the file on rank 0 alone, by ranges, and the
save streams it from memory; nothing of either lands under the temporary folder.

Bytes are counted at the socket: every byte a rank's Python sockets receive from, or send to, the S3 endpoint's port
(s3fs's, through asyncio; gloo's and the TCP store's sockets are C++ and not counted)."""

from __future__ import annotations

import contextlib
import io
import os
import socket
import tempfile
import uuid
import zipfile
from pathlib import Path
from urllib.parse import urlparse

import torch

from common import full_params, make_fabric, same_tensors, tensor_opt_state, train_steps
from harness import case, run_cases
from models import TinyTransformer

WORLD = 2
BUCKET = os.environ.get("LFSDP_TEST_BUCKET", "ckpt")
PORT = urlparse(os.environ.get("AWS_ENDPOINT_URL", "http://127.0.0.1:0")).port


def _setup(fabric, seed=0):
    torch.manual_seed(seed)
    plain = TinyTransformer(dim=128)  # 0.4M parameters: a 1.6 MB model, 4.9 MB with AdamW's state
    return fabric.setup(plain, torch.optim.AdamW(plain.parameters(), lr=1e-2))


def _url(fabric, name: str) -> str:
    return f"s3://{BUCKET}/{fabric.broadcast(uuid.uuid4().hex[:8])}/{name}"


def _s3():
    import s3fs

    return s3fs.S3FileSystem(skip_instance_cache=True)


@contextlib.contextmanager
def _counting():
    """Bytes this process receives from (``got``) and sends to (``sent``) the S3 endpoint while in the block."""
    counts = {"got": 0, "sent": 0}
    originals = {name: getattr(socket.socket, name) for name in ("recv", "recv_into", "send", "sendall")}

    def ours(sock) -> bool:
        try:
            peer = sock.getpeername()
        except OSError:
            return False
        return isinstance(peer, tuple) and peer[1] == PORT  # an AF_UNIX peer is a string

    def recv(self, *args, **kwargs):
        data = originals["recv"](self, *args, **kwargs)
        if ours(self):
            counts["got"] += len(data)
        return data

    def recv_into(self, *args, **kwargs):
        count = originals["recv_into"](self, *args, **kwargs)
        if ours(self):
            counts["got"] += count
        return count

    def send(self, data, *args):
        count = originals["send"](self, data, *args)
        if ours(self):
            counts["sent"] += count
        return count

    def sendall(self, data, *args):
        if ours(self):
            counts["sent"] += len(memoryview(data).cast("B"))
        return originals["sendall"](self, data, *args)

    for name, fn in (("recv", recv), ("recv_into", recv_into), ("send", send), ("sendall", sendall)):
        setattr(socket.socket, name, fn)
    try:
        yield counts
    finally:
        for name, fn in originals.items():
            setattr(socket.socket, name, fn)


def _files_under(folder: Path) -> list[str]:
    return sorted(str(p) for p in folder.rglob("*") if p.is_file())


@contextlib.contextmanager
def _watching_the_temp_folder(store):
    """A fresh temporary folder for the block, and the files in it when the save commits and when the load begins
    reading (a staged copy or a download would be there then, and gone after)."""
    import lightning_fsdp.checkpoint.load as load_module

    seen: dict[str, list[str]] = {"commit": [], "load": []}
    folder = Path(tempfile.mkdtemp(prefix="streaming-full-"))
    old_tempdir, commit, load = tempfile.tempdir, store.commit, load_module._load

    def watched_commit(*args, **kwargs):
        seen["commit"] += _files_under(folder)
        return commit(*args, **kwargs)

    def watched_load(*args, **kwargs):
        seen["load"] += _files_under(folder)
        return load(*args, **kwargs)

    tempfile.tempdir, store.commit, load_module._load = str(folder), watched_commit, watched_load
    try:
        yield seen
    finally:
        tempfile.tempdir, load_module._load = old_tempdir, load
        del store.commit  # the instance attribute: the method shows through again
        with contextlib.suppress(OSError):
            for path in sorted(folder.rglob("*"), reverse=True):
                path.rmdir() if path.is_dir() else path.unlink()
            folder.rmdir()


@case
def a_full_load_from_a_bucket_reads_the_file_on_rank_0_alone_by_ranges_and_nothing_touches_local_disk():
    from lightning_fsdp.checkpoint.io.store import store_for

    fabric = make_fabric(WORLD, state_dict_type="full")
    model, opt = _setup(fabric)
    train_steps(fabric, model, opt, 2)
    url = _url(fabric, "step-2")
    store = store_for(url)  # the process's one store for s3:// without options: the save's and the load's
    with _watching_the_temp_folder(store) as seen:
        fabric.save(url, {"model": model, "optimizer": opt, "step": 2})
        expected, expected_opt = full_params(model), tensor_opt_state(opt)
        model2, opt2 = _setup(fabric, seed=1)
        fabric.barrier()
        with _counting() as counts:
            remainder = fabric.load(url, {"model": model2, "optimizer": opt2})
    assert remainder == {"step": 2}, remainder
    assert same_tensors(full_params(model2), expected)
    assert same_tensors(tensor_opt_state(opt2), expected_opt)
    size = store.read_commit(url)["objects"]["step-2"][0] if fabric.global_rank == 0 else None
    got = fabric.all_gather(torch.tensor(counts["got"])).tolist()
    if fabric.global_rank == 0:
        assert got[1] == 0, f"rank 1 received {got[1]} bytes from the bucket; the file has {size}"
        assert 0 < got[0] <= 1.02 * size, f"rank 0 received {got[0]} bytes for a file of {size}"
    assert not seen["commit"] and not seen["load"], seen  # no staged copy, no download
    # Training goes on identically from the loaded state.
    train_steps(fabric, model, opt, 1, start=2)
    train_steps(fabric, model2, opt2, 1, start=2)
    assert same_tensors(full_params(model2), full_params(model))
    return {"received": got, "size": size}


@case
def a_flipped_byte_in_a_tensor_record_fails_the_load_on_every_rank_naming_the_url_and_the_tensor():
    fabric = make_fabric(WORLD, state_dict_type="full")
    model, _ = _setup(fabric)
    url = _url(fabric, "flipped")
    fabric.save(url, {"model": model})
    if fabric.global_rank == 0:
        fs = _s3()
        (name,) = [p for p in fs.find(url) if not p.endswith("/COMMIT")]
        data = bytearray(fs.cat_file(name))
        with zipfile.ZipFile(io.BytesIO(bytes(data))) as archive:
            info = max(archive.infolist(), key=lambda i: i.file_size)  # a tensor record (the largest weight)
        header = data[info.header_offset:info.header_offset + 30]
        name_length, extra_length = (int.from_bytes(header[i:i + 2], "little") for i in (26, 28))
        start = info.header_offset + 30 + name_length + extra_length
        data[start + info.file_size // 2] ^= 0x40
        fs.pipe_file(name, bytes(data))
    fabric.barrier()
    model2, _ = _setup(fabric, seed=1)
    try:
        fabric.load(url, {"model": model2})
    except Exception as err:  # noqa: BLE001 - the type is checked below
        error = err
    else:
        raise AssertionError("a flipped byte in a tensor record loaded without an error")
    from lightning_fsdp.checkpoint.integrity.digests import ChecksumError

    assert isinstance(error, ChecksumError), repr(error)
    message = str(error)
    # The checkpoint's URL, the tensor the record holds, and the fix; on every rank (rank 1 read nothing).
    assert url in message and "the tensor 'model." in message and "HINT:" in message, message
    return {"error": message[:300]}


@case
def checkpoint_keys_of_a_full_checkpoint_in_a_bucket_read_its_index_alone():
    from lightning_fsdp.checkpoint.load import checkpoint_keys

    fabric = make_fabric(WORLD, state_dict_type="full")
    model, opt = _setup(fabric)
    url = _url(fabric, "keys")
    fabric.save(url, {"model": model, "optimizer": opt, "step": 1})
    fabric.barrier()
    with _counting() as counts:
        keys = checkpoint_keys(url, comm=fabric.strategy._engine)
    assert keys == {"model", "optimizer", "step"}, keys
    got = fabric.all_gather(torch.tensor(counts["got"])).tolist()
    if fabric.global_rank == 0:
        size = sum(_s3().du(url, total=False).values())
        assert got[1] == 0 and got[0] < 0.1 * size, (got, size)
    return {"received": got}


if __name__ == "__main__":
    run_cases()
