"""Credentials in ``storage_options`` are never shown (issue 45 item 2), and the strategy's ``storage_options`` reach
every filesystem and every load (issue 45 item 9, issue 42 items 8 and 13).

In this process: which keys are secrets and how they are masked, the config's repr, the errors, LightningCLI's
``config.yaml`` (masked, and refused with a hint when run again), a ``ModelCheckpoint``'s filesystem. Against the
suite's S3 server, two ranks with the endpoint and credentials only in the strategy (``workers/storage_options_only.py``,
one launch): a Fabric save and load, a load's own options, and a Trainer fit whose ``ModelCheckpoint`` in the bucket
removes old checkpoints, then resumes."""

from __future__ import annotations

import importlib

import sys
from pathlib import Path

import pytest

from launch import launch
from lightning_fsdp._base.secrets import MASK, is_secret_key, mask_secrets
from lightning_fsdp.engine.config import FSDPConfig

SECRET = "sEcReT-h5-0b7f"  # a value that cannot appear by chance in a message or a file
OPTIONS = {
    "endpoint_url": "http://minio.internal:9000", "key": "AKIA-h5", "secret": SECRET, "profile": None,
    "client_kwargs": {"region_name": "eu-west-1", "aws_session_token": SECRET},
}


@pytest.mark.single_process
@pytest.mark.parametrize("name", ["key", "secret", "token", "password", "sas_token", "account_key", "credential",
                                  "credentials", "connection_string", "client_secret", "aws_secret_access_key",
                                  "aws_session_token", "accountKey", "SAS-Token", "private_key", "passphrase"])
def test_secret_looking_keys_are_secrets(name):
    assert is_secret_key(name)


@pytest.mark.single_process
@pytest.mark.parametrize("name", ["endpoint_url", "region_name", "anon", "profile", "account_name", "use_ssl",
                                  "client_kwargs", "config_kwargs", "default_block_size", "version_aware"])
def test_other_options_are_shown(name):
    assert not is_secret_key(name)


@pytest.mark.single_process
def test_masking_keeps_the_shape_and_the_public_values():
    masked = mask_secrets({**OPTIONS, "token": "google_default", "sas_token": None, "config_kwargs": [{"password": "p"}]})
    assert masked == {"endpoint_url": "http://minio.internal:9000", "key": MASK, "secret": MASK, "profile": None,
                      "client_kwargs": {"region_name": "eu-west-1", "aws_session_token": MASK},
                      "token": "google_default", "sas_token": None, "config_kwargs": [{"password": MASK}]}
    assert OPTIONS["secret"] == SECRET  # a copy: the options themselves keep their values


@pytest.mark.single_process
@pytest.mark.parametrize("front", ["fabric", "trainer"])
def test_the_config_and_strategy_reprs_mask_secrets_and_fsspec_gets_them(front):
    module = importlib.import_module(f"lightning_fsdp.{front}")
    strategy = module.FSDPStrategy(storage_options=OPTIONS)
    shown = " ".join([repr(strategy), repr(strategy.config), str(strategy.config), repr(strategy.config.storage_options)])
    assert SECRET not in shown and "AKIA-h5" not in shown, shown
    assert "'secret': '***'" in shown and "http://minio.internal:9000" in shown, shown
    assert strategy._storage_options(None) == OPTIONS  # what fsspec gets is the real thing
    assert type(strategy._storage_options(None)) is dict


@pytest.mark.single_process
@pytest.mark.parametrize("value", [f"key=AKIA-h5,secret={SECRET}", f"https://user:{SECRET}@host", {1: "x", "secret": SECRET}])
def test_errors_about_storage_options_do_not_show_secrets(value, tmp_path):
    from lightning_fsdp.fabric import FSDPStrategy as FabricStrategy
    from lightning_fsdp.trainer import FSDPStrategy

    with pytest.raises(TypeError, match="storage_options.*HINT") as constructed:
        FSDPConfig.from_arguments(storage_options=value)
    with pytest.raises(TypeError, match=r"save_checkpoint\(\.\.\., storage_options\).*HINT") as saved:
        FSDPStrategy().save_checkpoint({}, str(tmp_path / "x.ckpt"), storage_options=value)
    # a load's own options are checked as a save's are, naming the load (both fronts)
    with pytest.raises(TypeError, match=r"FSDPStrategy.load_checkpoint\(\.\.\., storage_options\).*HINT") as loaded:
        FSDPStrategy().load_checkpoint(str(tmp_path / "x.ckpt"), storage_options=value)
    with pytest.raises(TypeError, match=r"FSDPStrategy.load_checkpoint\(\.\.\., storage_options\).*HINT") as fabric:
        FabricStrategy().load_checkpoint(str(tmp_path / "x.ckpt"), {"a": 1}, storage_options=value)
    for err in (constructed, saved, loaded, fabric):
        assert SECRET not in str(err.value), str(err.value)
    assert not list(tmp_path.iterdir())


@pytest.mark.single_process
def test_a_value_that_names_no_secret_is_shown_in_the_error():
    with pytest.raises(TypeError, match=r"Invalid `storage_options='http://host:9000'`.*HINT"):
        FSDPConfig.from_arguments(storage_options="http://host:9000")


def _cli(args: list[str], tmp_path: Path):
    from lightning.pytorch.cli import LightningCLI

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    try:
        import cli_train
    finally:
        sys.path.pop(0)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sys, "argv", ["cli_train.py"])  # LightningCLI warns when pytest's own arguments are there too
        return LightningCLI(cli_train.GPTModule, cli_train.TokenData, run=False, args=[
            "--trainer.accelerator=cpu", "--trainer.devices=1", "--trainer.logger=false",
            f"--trainer.default_root_dir={tmp_path}", *args])


@pytest.mark.single_process
def test_lightning_cli_config_yaml_masks_secrets_and_refuses_them_when_run_again(tmp_path):
    import json

    from lightning.pytorch.cli import SaveConfigCallback

    cli = _cli(["--trainer.strategy=lightning_fsdp.trainer.FSDPStrategy",
                f"--trainer.strategy.init_args.storage_options={json.dumps(OPTIONS)}"], tmp_path)
    assert cli.trainer.strategy._storage_options(None) == OPTIONS  # the run itself has the real values
    save = next(c for c in cli.trainer.callbacks if isinstance(c, SaveConfigCallback))
    save.setup(cli.trainer, cli.model, "fit")  # what `fit` does first: write config.yaml
    written = (tmp_path / "config.yaml").read_text()
    assert SECRET not in written and "AKIA-h5" not in written, written
    assert "secret: '***'" in written and "endpoint_url: http://minio.internal:9000" in written, written
    # run again from the saved config: the masked secrets are refused with the fix, not sent as credentials
    with pytest.raises(ValueError, match=r"'key', 'secret', 'client_kwargs.aws_session_token' = '\*\*\*'.*masked"
                                         r".*HINT.*environment.*profile"):
        _cli([f"--config={tmp_path / 'config.yaml'}"], tmp_path / "again")


@pytest.mark.single_process
def test_a_model_checkpoint_in_a_bucket_gets_the_strategys_options(tmp_path):
    """Its own filesystem, built in `setup`, is the one that lists and checks names (the S3 cases below use it)."""
    from lightning.pytorch import LightningModule, Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_fsdp.trainer import FSDPStrategy

    import s3fs  # noqa: F401 - in the test extra: a missing s3fs fails here, it is never a skip
    callback = ModelCheckpoint(dirpath="s3://ckpt/run")
    local = ModelCheckpoint(dirpath=tmp_path, monitor="loss")  # another state key: two are allowed
    trainer = Trainer(accelerator="cpu", devices=1, strategy=FSDPStrategy(storage_options=OPTIONS), logger=False,
                      callbacks=[callback, local], default_root_dir=tmp_path)
    for each in (callback, local):
        each.setup(trainer, LightningModule(), "validate")
    assert callback._fs.storage_options == OPTIONS
    assert type(local._fs).__name__ == "LocalFileSystem"


# ---------------------------------------------------------------------------- two ranks, options only in the strategy

CASES = [
    "fabric_save_and_load_with_options_only_in_the_strategy_or_the_load",
    "trainer_model_checkpoint_removes_and_resumes_with_options_only_in_the_strategy",
]


@pytest.fixture(scope="module")
def results(s3_server, tmp_path_factory):
    # No endpoint, keys, profile or credential file in the ranks' environment: only the strategy's options (or a
    # load's) can reach the server. Instance metadata is off, so a client with no credentials fails at once.
    import os

    removed = ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE",
               "AWS_DEFAULT_REGION")
    assert not [name for name in removed if name in os.environ], "the pytest process itself holds AWS_* variables"
    none = str(tmp_path_factory.mktemp("no_aws") / "none")
    return launch("storage_options_only.py", 2, tmp_path_factory.mktemp("storage_options_only"),
                  LFSDP_TEST_BUCKET=s3_server.bucket(), LFSDP_TEST_ENDPOINT=s3_server.endpoint,
                  LFSDP_TEST_SECRET=SECRET, AWS_EC2_METADATA_DISABLED="true", AWS_SHARED_CREDENTIALS_FILE=none,
                  AWS_CONFIG_FILE=none)


@pytest.mark.parametrize("name", CASES)
def test_two_ranks_with_options_only_in_the_strategy(results, name):
    results.check(name)
