"""Two-rank cases where the S3 endpoint and credentials are ONLY in the strategy's ``storage_options`` (issue 45 item
9, issue 42 items 8 and 13): the environment has no ``AWS_*`` endpoint or keys (``tests/test_storage_secrets.py``
launches this with none, and with no credential files), so anything that builds its filesystem from the environment
fails with botocore's "Unable to locate credentials" instead of reaching the server. The secret used is a marker
that must appear in no object the saves write."""

from __future__ import annotations

import os

import torch

from common import full_params, make_fabric, same_tensors, train_steps
from harness import case, run_cases
from models import TinyTransformer

WORLD = 2
BUCKET = os.environ["LFSDP_TEST_BUCKET"]
SECRET = os.environ["LFSDP_TEST_SECRET"]  # moto accepts any key; this one is a marker to look for in the objects
OPTIONS = {"endpoint_url": os.environ["LFSDP_TEST_ENDPOINT"], "key": "testing", "secret": SECRET,
           "client_kwargs": {"region_name": "us-east-1"}}


def _setup(fabric, seed=0):
    torch.manual_seed(seed)
    plain = TinyTransformer()
    return fabric.setup(plain, torch.optim.AdamW(plain.parameters(), lr=1e-2))


def _fs():
    import s3fs

    return s3fs.S3FileSystem(skip_instance_cache=True, use_listings_cache=False, **OPTIONS)


def _secret_in_objects(prefix: str) -> list[str]:
    """The objects under ``prefix`` whose bytes hold the secret (none may)."""
    fs = _fs()
    return [path for path in fs.find(prefix) if SECRET.encode() in fs.cat_file(path)]


@case
def fabric_save_and_load_with_options_only_in_the_strategy_or_the_load():
    from lightning_fsdp import fabric_load

    fabric = make_fabric(WORLD, storage_options=OPTIONS)
    model, opt = _setup(fabric)
    train_steps(fabric, model, opt, 2)
    prefix = f"s3://{BUCKET}/fabric"  # the bucket is the launch's own
    fabric.save(f"{prefix}/step-2", {"model": model, "optimizer": opt, "step": 2})
    expected = full_params(model)
    model2, opt2 = _setup(fabric, seed=1)
    assert fabric.load(f"{prefix}/step-2", {"model": model2, "optimizer": opt2}) == {"step": 2}
    assert same_tensors(full_params(model2), expected)
    # A strategy without options: the load's own `storage_options` (through `fabric_load`, since Lightning's
    # `fabric.load` passes none on) reach the store; without them the environment has no credentials.
    bare = make_fabric(WORLD)
    model3, opt3 = _setup(bare, seed=2)
    try:
        bare.load(f"{prefix}/step-2", {"model": model3, "optimizer": opt3})
    except PermissionError as err:
        refused = str(err)
    else:
        raise AssertionError("a load with no options reached the server: the environment holds credentials")
    assert fabric_load(bare, f"{prefix}/step-2", {"model": model3, "optimizer": opt3},
                       storage_options=OPTIONS) == {"step": 2}
    assert same_tensors(full_params(model3), expected)
    assert SECRET not in refused, refused
    leaked = _secret_in_objects(prefix) if fabric.global_rank == 0 else []
    assert not leaked, f"the secret is in {leaked}"
    return {"refused": refused[:300]}


@case
def trainer_model_checkpoint_removes_and_resumes_with_options_only_in_the_strategy():
    from lightning.pytorch.callbacks import ModelCheckpoint

    from trainer_common import LitGPT, compare_params, gathered, loader, make_trainer, strategy

    dirpath = f"s3://{BUCKET}/trainer"  # the bucket is the launch's own

    def callbacks():
        # every 2 steps, keeping 1: each save after the first removes the one before (`remove_checkpoint`), and
        # `file_exists` and `save_last`'s listing ask the callback's own filesystem
        return [ModelCheckpoint(dirpath=dirpath, filename="{step}", every_n_train_steps=2, save_top_k=1,
                                save_last=True)]

    trained = LitGPT(optimizer="adamw")
    make_trainer(strategy(storage_options=OPTIONS), max_epochs=1, enable_checkpointing=True,
                 callbacks=callbacks()).fit(trained, loader())
    expected = gathered(trained.model)
    names = sorted(p.rsplit("/", 1)[-1] for p in _fs().ls(dirpath)) if torch.distributed.get_rank() == 0 else None
    if names is not None:
        assert names == ["last.ckpt", "step=4.ckpt"], names  # step=2 was removed
    # Both are the end of the only epoch: a resume loads them (through the strategy's options) and trains no more,
    # so the weights are the trained ones exactly. By its URL first: the run resumed by name has the callback again.
    for ckpt_path in (f"{dirpath}/step=4.ckpt", "last"):
        resumed = LitGPT(optimizer="adamw")
        by_name = ckpt_path == "last"
        trainer = make_trainer(strategy(storage_options=OPTIONS), max_epochs=1, enable_checkpointing=by_name,
                               callbacks=callbacks() if by_name else None)
        trainer.fit(resumed, loader(), ckpt_path=ckpt_path)
        assert trainer.ckpt_path in (f"{dirpath}/last.ckpt", f"{dirpath}/step=4.ckpt"), trainer.ckpt_path
        assert trainer.global_step == 4, (ckpt_path, trainer.global_step)
        compare_params(gathered(resumed.model), expected, atol=0.0)
    leaked = _secret_in_objects(dirpath) if torch.distributed.get_rank() == 0 else []
    assert not leaked, f"the secret is in {leaked}"
    return {"names": names}


if __name__ == "__main__":
    run_cases()
