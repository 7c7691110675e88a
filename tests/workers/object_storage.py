"""Two-rank cases against a real S3 server (moto, started by ``tests/test_object_storage.py``; its endpoint and
credentials arrive in the environment, as a user's would): both formats, async saves, replacing a checkpoint,
damage, a missing bucket. Weights compare exactly (atol=0)."""

from __future__ import annotations

import os
import uuid

import torch

from common import full_params, make_fabric, same_tensors, train_steps
from harness import TIMEOUT, case, run_cases
from models import TinyTransformer

WORLD = 2
BUCKET = os.environ.get("LFSDP_TEST_BUCKET", "ckpt")


def _url(fabric, name: str) -> str:
    return f"s3://{BUCKET}/{fabric.broadcast(uuid.uuid4().hex[:8])}/{name}"


def _setup(fabric, seed=0):
    torch.manual_seed(seed)
    plain = TinyTransformer()
    return fabric.setup(plain, torch.optim.AdamW(plain.parameters(), lr=1e-2))


def _s3():
    import s3fs

    return s3fs.S3FileSystem(skip_instance_cache=True)


def _round_trip(state_dict_type: str, async_save: bool = False, after_save=lambda: None) -> dict:
    fabric = make_fabric(WORLD, state_dict_type=state_dict_type, async_save=async_save)
    model, opt = _setup(fabric)
    train_steps(fabric, model, opt, 2)
    url = _url(fabric, "step-2")
    fabric.save(url, {"model": model, "optimizer": opt, "step": 2})
    after_save()  # called once the save has returned
    fabric.strategy.wait_for_saves()
    expected = full_params(model)
    model2, opt2 = _setup(fabric, seed=1)
    remainder = fabric.load(url, {"model": model2, "optimizer": opt2})
    assert same_tensors(full_params(model2), expected)
    assert remainder == {"step": 2}, remainder
    # training continues identically from the loaded state
    train_steps(fabric, model, opt, 1, start=2)
    train_steps(fabric, model2, opt2, 1, start=2)
    assert same_tensors(full_params(model2), full_params(model))
    assert not os.path.exists("s3:"), "a local folder named 's3:' was written"
    names = sorted(p.rsplit("/", 1)[-1] for p in _s3().ls(url)) if fabric.global_rank == 0 else None
    return {"objects": names}


@case
def sharded_save_and_load_in_a_bucket_are_exact():
    details = _round_trip("sharded")
    # the commit object and one token prefix holding the save's objects
    assert details["objects"] is None or len(details["objects"]) == 2 and "COMMIT" in details["objects"], details
    return details


@case
def full_save_and_load_in_a_bucket_are_exact():
    return _round_trip("full")


@case
def async_save_to_a_bucket_uploads_in_the_background_and_loads_exactly():
    """Each rank's upload waits until ``fabric.save`` has returned on that rank, so a save that returned with its
    upload done fails here: an upload on the saving thread is seen at once, one on a thread that the save waits for
    keeps the gate shut until the process group's timeout. Then the round trip is exact."""
    import threading

    from lightning_fsdp.checkpoint.io import remote_upload

    released, uploads, saving = threading.Event(), [], threading.get_ident()
    # Each rank's shard streams into its object (issue 43): the upload begins where that object is opened.
    open_streamed = remote_upload.open_streamed

    def gated_open(*args, **kwargs):
        if threading.get_ident() == saving:  # waiting here would wait for ourselves
            uploads.append("on the saving thread, before the save returned")
        elif released.wait(timeout=TIMEOUT.total_seconds()):
            uploads.append("in the background, finished after the save returned")
        else:
            uploads.append(f"in the background, but the save had not returned after {TIMEOUT}: it waited for it")
        return open_streamed(*args, **kwargs)

    remote_upload.open_streamed = gated_open
    try:
        details = _round_trip("sharded", async_save=True, after_save=released.set)
    finally:
        remote_upload.open_streamed = open_streamed
    assert uploads and set(uploads) == {"in the background, finished after the save returned"}, uploads
    return {**details, "uploads": uploads}


@case
def a_second_save_to_the_same_url_replaces_the_first_and_removes_its_objects():
    fabric = make_fabric(WORLD)
    model, opt = _setup(fabric)
    url = _url(fabric, "ckpt")
    fabric.save(url, {"model": model, "optimizer": opt})
    first = full_params(model)
    train_steps(fabric, model, opt, 1)
    fabric.save(url, {"model": model, "optimizer": opt})
    second = full_params(model)
    assert not same_tensors(first, second)
    model2, opt2 = _setup(fabric, seed=1)
    fabric.load(url, {"model": model2, "optimizer": opt2})
    assert same_tensors(full_params(model2), second)
    if fabric.global_rank == 0:
        entries = [p.rsplit("/", 1)[-1] for p in _s3().ls(url)]
        assert len(entries) == 2 and "COMMIT" in entries, entries  # one token prefix: the first save's is gone
    fabric.barrier()


@case
def a_flipped_byte_in_an_object_is_refused_on_every_rank_naming_the_url():
    fabric = make_fabric(WORLD)
    model, opt = _setup(fabric)
    url = _url(fabric, "ckpt")
    fabric.save(url, {"model": model, "optimizer": opt})
    if fabric.global_rank == 0:
        s3 = _s3()
        shard = next(p for p in s3.find(url) if p.endswith("__1_0.distcp"))
        data = bytearray(s3.cat_file(shard))
        data[len(data) // 2] ^= 0x01
        s3.pipe_file(shard, bytes(data))
    fabric.barrier()
    model2, opt2 = _setup(fabric, seed=1)
    try:
        fabric.load(url, {"model": model2, "optimizer": opt2})
    except Exception as err:  # noqa: BLE001
        message = str(err)
        assert type(err).__name__ == "ChecksumError", (type(err), message)
        assert url in message and "/tmp/" not in message, message
        return {"error": message[:300]}
    raise AssertionError("a damaged object loaded")


@case
def a_missing_bucket_is_one_clear_error_on_every_rank():
    fabric = make_fabric(WORLD)
    model, opt = _setup(fabric)
    url = "s3://no-such-bucket-h4/run/step-1"
    try:
        fabric.save(url, {"model": model, "optimizer": opt})
    except FileNotFoundError as err:
        assert "no-such-bucket-h4" in str(err) and "HINT" in str(err), str(err)
        return {"error": str(err)[:300]}
    raise AssertionError("a save to a missing bucket returned")



@case
def step_checkpoints_in_a_bucket_keep_the_last_two_and_latest_loads_the_newest():
    from lightning_fsdp.step_checkpoints import StepCheckpoints

    fabric = make_fabric(WORLD)
    model, opt = _setup(fabric)
    directory = _url(fabric, "run")
    checkpoints = StepCheckpoints(fabric, directory, keep_last=2)
    assert checkpoints.resume({"model": model, "optimizer": opt, "step": 0}) is None  # a fresh start
    for step in (1, 2, 3):
        train_steps(fabric, model, opt, 1, start=step - 1)
        checkpoints.save({"model": model, "optimizer": opt, "step": step})
    expected = full_params(model)
    if fabric.global_rank == 0:
        s3 = _s3()
        names = sorted(p.rsplit("/", 1)[-1] for p in s3.ls(directory))
        assert names == ["step-00000002", "step-00000003"], names
    fabric.barrier()
    model2, opt2 = _setup(fabric, seed=1)
    remainder = fabric.load(f"{directory}/latest", {"model": model2, "optimizer": opt2})
    assert remainder == {"step": 3} and same_tensors(full_params(model2), expected), remainder
    state = {"model": model2, "optimizer": opt2, "step": 0}
    assert checkpoints.resume(state) == f"{directory}/step-00000003" and state["step"] == 3


@case
def trainer_model_checkpoint_in_a_bucket_resumes_exactly():
    from lightning.pytorch.callbacks import ModelCheckpoint

    from trainer_common import LitGPT, compare_params, gathered, loader, make_trainer, strategy

    dirpath = _url(make_fabric(WORLD), "trainer")

    def callbacks():
        return [ModelCheckpoint(dirpath=dirpath, filename="{epoch}", save_top_k=-1, save_last=True)]

    uninterrupted = LitGPT(optimizer="adamw", scheduler=True)
    make_trainer(strategy(), enable_checkpointing=True, callbacks=callbacks()).fit(uninterrupted, loader())
    assert not os.path.exists("s3:"), "a local folder named 's3:' was written"
    expected = gathered(uninterrupted.model)
    for ckpt_path in (f"{dirpath}/epoch=0.ckpt", f"{dirpath}/latest"):
        resumed = LitGPT(optimizer="adamw", scheduler=True)
        trainer = make_trainer(strategy(), max_epochs=2 if "epoch" in ckpt_path else 3)
        trainer.fit(resumed, loader(), ckpt_path=ckpt_path)
        assert trainer.global_step == (8 if "epoch" in ckpt_path else 12), (ckpt_path, trainer.global_step)
        if "epoch" in ckpt_path:
            compare_params(gathered(resumed.model), expected, atol=0.0)
    # `last.ckpt`, refreshed after every epoch, is a checkpoint of the last epoch: by its URL, and as Lightning's
    # `ckpt_path="last"` (which finds it through the ModelCheckpoint's dirpath; Lightning alone loads nothing there)
    for ckpt_path in (f"{dirpath}/last.ckpt", "last"):
        resumed = LitGPT(optimizer="adamw", scheduler=True)
        by_name = ckpt_path == "last"
        trainer = make_trainer(strategy(), enable_checkpointing=by_name, callbacks=callbacks() if by_name else None)
        trainer.fit(resumed, loader(), ckpt_path=ckpt_path)
        assert trainer.ckpt_path == f"{dirpath}/last.ckpt", (ckpt_path, trainer.ckpt_path)  # None: trained anew
        assert trainer.global_step == 8, (ckpt_path, trainer.global_step)
        compare_params(gathered(resumed.model), expected, atol=0.0)



@case
def a_background_upload_that_fails_on_one_rank_is_raised_on_every_rank_and_keeps_the_previous_checkpoint():
    from lightning_fsdp.checkpoint.io import remote_errors
    from lightning_fsdp.checkpoint.io.transport_upload import S3Upload

    fabric = make_fabric(WORLD, async_save=True)
    model, opt = _setup(fabric)
    url = _url(fabric, "ckpt")
    fabric.save(url, {"model": model, "optimizer": opt, "step": 1})
    fabric.strategy.wait_for_saves()
    first = full_params(model)
    train_steps(fabric, model, opt, 1)
    # Each attempt of an upload's request, through whichever client sends it (s3fs, or obstore for single PUTs).
    send, backoff, attempts = S3Upload._send, remote_errors.BACKOFF_S, remote_errors.ATTEMPTS
    if fabric.global_rank == 1:  # the store answers rank 1's uploads (its streamed shard) with 503 SlowDown
        async def slow_down(self, method, kwargs):
            if method in ("put_object", "upload_part"):
                raise OSError("An error occurred (SlowDown) when calling the PutObject operation: Please reduce"
                              " your request rate.")
            return await send(self, method, kwargs)
        # Four attempts without waits: the bound alone would retry for its 60 s.
        S3Upload._send, remote_errors.BACKOFF_S, remote_errors.ATTEMPTS = slow_down, 0.0, 4
    try:
        fabric.save(url, {"model": model, "optimizer": opt, "step": 2})  # returns: the upload is in the background
        try:
            fabric.strategy.wait_for_saves()
        except ConnectionError as err:
            message = str(err)
        else:
            raise AssertionError("the failed background upload was not reported")
    finally:
        S3Upload._send, remote_errors.BACKOFF_S, remote_errors.ATTEMPTS = send, backoff, attempts
    assert "failed on rank 1" in message and url in message and "SlowDown" in message and "HINT" in message, message
    model2, opt2 = _setup(fabric, seed=1)
    assert fabric.load(url, {"model": model2, "optimizer": opt2}) == {"step": 1}
    assert same_tensors(full_params(model2), first)
    return {"error": message[:300]}


if __name__ == "__main__":
    run_cases()
