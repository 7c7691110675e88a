"""litgpt's own scripts, unchanged, on this strategy (issue 19 part 2; docs/guides/huggingface.md, "litgpt's scripts").

Each test runs one litgpt script three ways on the tiny checkpoint of ``tests/litgpt/tiny.py``, in fp32:
- litgpt's own ``devices=1`` run (``python -m litgpt ...``): the reference;
- ``tests/litgpt/as_user.py`` on 2 ranks under torchrun: the script with its ``FSDPStrategy`` name bound to ours;
- the same launcher with the name bound to Lightning's ``DDPStrategy``: the rounding plain data parallelism shows.

The rule: max |ours - single| <= max(FLOOR, SLACK * max |ddp - single|), over every tensor of the final weights,
with the same keys in both. So that the rule can fail, each test also checks that training moved the weights by far
more than the tolerance. The data is fixed-length and unshuffled, and the global batch is 2 samples of 1 (devices=1
accumulates 2 micro-batches, 2 ranks 1 each), so both runs take each optimizer step on the same samples.

LoRA and adapter: their weights are not in the base checkpoint, so each run draws them at random, and no sharded
initialization can draw litgpt's ``devices=1`` values: litgpt builds each attention's plain ``nn.Linear`` layers (the
``super().__init__``), which draws from the generator on one process, then replaces them with LoRA layers, and a
meta-device build draws nothing for the discarded ones. So ours trains from the base checkpoint as users run it,
and the reference runs start from that checkpoint plus the LoRA/adapter weights ours initialized (read from a run of
ours that stops before its first step): the comparison is of training, from the same start.

``TORCHDYNAMO_DISABLE=1`` for pretrain: its ``torch.compile`` costs about 30 s per process on this CPU, and Fabric sets
up the uncompiled module either way (it unwraps the compiled one, and compiles again after the strategy's setup).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import forkserver
from launch import free_port, script_env

LITGPT = Path(__file__).parent / "litgpt"
AS_USER = LITGPT / "as_user.py"
RUN_TIMEOUT_S = 300
FLOOR = 1e-6  # fp32 rounding of weights of size ~1 after a few Adam steps
SLACK = 10.0

import litgpt  # noqa: E402  (a test dependency: missing, the file fails rather than skips)
import tokenizers  # noqa: E402,F401

# `tests/` is on sys.path, so without the real package `import litgpt` above imports this folder's `litgpt/` (which
# has no __init__.py) as an empty namespace package and succeeds: a missing litgpt would show only as every run
# failing in its subprocess. A namespace package has no __file__.
if getattr(litgpt, "__file__", None) is None:
    raise ImportError(f"`import litgpt` found only the namespace folder(s) {list(litgpt.__path__)}, not the litgpt"
                      " package. HINT: install the test extra: `pip install -e '.[test]'` (litgpt>=0.5.9).")

# Its runs go side by side, two processes each: both cores stay busy (conftest.py runs such tests late).
pytestmark = pytest.mark.fills_both_cores

LR = 0.01
# Common to the finetune scripts: 3 optimizer steps of 2 samples, lr 0 for the first (litgpt's linear warmup starts
# at 0), no evaluation beyond the scripts' sanity check, CSV logs (nothing to install or reach).
FINETUNE_ARGS = [
    "--precision", "32-true", "--data", "tiny.TinySFT",
    "--train.global_batch_size", "2", "--train.micro_batch_size", "1", "--train.max_steps", "4",
    "--train.lr_warmup_steps", "1", "--train.epochs", "1",
    "--eval.interval", "1000", "--eval.final_validation", "false",
    "--optimizer", '{"class_path": "torch.optim.AdamW", "init_args": {"lr": %s}}' % LR,
    "--logger_name", "csv",
]


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    sys.path.insert(0, str(LITGPT))
    try:
        import tiny
    finally:
        sys.path.remove(str(LITGPT))
    return tiny.build_checkpoint(tmp_path_factory.mktemp("litgpt") / "tiny-llama")


def start(command: str, args: list[str], *, how: str, cwd: Path, env: dict[str, str] | None = None
          ) -> tuple[str, Path, subprocess.Popen]:
    """Start ``litgpt COMMAND ARGS`` as ``how``: ``single`` (litgpt itself, devices=1), ``ours`` or ``ddp`` (2 ranks).
    Its output goes to a log file in ``cwd`` (a pipe nobody reads while another run is awaited could fill)."""
    environ = script_env(PYTHONPATH=os.pathsep.join([str(LITGPT), os.environ.get("PYTHONPATH", "")]),
                         LITGPT_AS_USER_STRATEGY=how, **(env or {}))
    if how == "single":
        cmd = [forkserver.python(), "-m", "litgpt", command, *args, "--devices", "1"]
    else:
        cmd = [forkserver.python(), "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
               f"--master_port={free_port()}", str(AS_USER), command, *args, "--devices", "2"]
    cwd.mkdir(parents=True, exist_ok=True)
    log = cwd / f"{command}-{how}.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, env=environ, cwd=cwd, stdout=out, stderr=subprocess.STDOUT)
    return f"litgpt {command} ({how})", log, proc


def finish(*started: tuple[str, Path, subprocess.Popen]) -> None:
    """Wait for every started run; fail, with its log's tail, on the first that did not exit 0."""
    for name, log, proc in started:
        try:
            proc.wait(timeout=RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.returncode != 0:
            for _, _, other in started:
                if other.poll() is None:
                    other.kill()
                    other.wait()
            pytest.fail(f"{name} exited with status {proc.returncode}; log tail:\n{log.read_text()[-6000:]}")


def litgpt(command: str, args: list[str], *, how: str, cwd: Path, env: dict[str, str] | None = None) -> None:
    """Run ``litgpt COMMAND ARGS`` as ``how`` (see :func:`start`) to its end."""
    finish(start(command, args, how=how, cwd=cwd, env=env))


def weights(path: Path) -> dict[str, torch.Tensor]:
    state = torch.load(path, map_location="cpu", weights_only=True)
    return state.get("model", state)


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert sorted(a) == sorted(b), f"different keys: only in one {sorted(set(a) ^ set(b))}"
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def check_close(name: str, outs: dict[str, Path], start: dict[str, torch.Tensor]) -> None:
    """Compare the file ``name`` of the three runs' ``out_dir`` by the rule in the module docstring."""
    single, ours, ddp = (weights(outs[how] / name) for how in ("single", "ours", "ddp"))
    ours_diff, ddp_diff = max_diff(ours, single), max_diff(ddp, single)
    tolerance = max(FLOOR, SLACK * ddp_diff)
    moved = max((single[k].double() - start[k].double()).abs().max().item() for k in start)
    print(f"{name}: max|ours-single|={ours_diff:.3g} max|ddp-single|={ddp_diff:.3g} tolerance={tolerance:.3g}"
          f" moved={moved:.3g}")
    assert moved > 100 * tolerance, f"{name}: training moved the weights by only {moved:.3g}"
    assert ours_diff <= tolerance, (
        f"{name}: ours differs from litgpt's devices=1 run by {ours_diff:.3g}, more than {tolerance:.3g}"
        f" (max(FLOOR, {SLACK} x the {ddp_diff:.3g} Lightning's DDPStrategy shows))"
    )


def run_three(command: str, args: list[str], tmp_path: Path, *, reference_base: Path | None = None) -> dict[str, Path]:
    """Run ``litgpt COMMAND BASE ARGS`` as single, ours and ddp, side by side, each in a working directory of its
    own; the first of ``args`` is the base checkpoint, which ``reference_base`` replaces for the single and ddp
    runs."""
    outs, started = {}, []
    for how in ("single", "ours", "ddp"):
        outs[how] = tmp_path / how
        base = args[0] if reference_base is None or how == "ours" else str(reference_base)
        started.append(start(command, [base, *args[1:], "--out_dir", str(outs[how])], how=how,
                             cwd=tmp_path / f"cwd-{how}"))
    finish(*started)
    return outs


def base_with_ours_init(command: str, args: list[str], saved: str, tmp_path: Path) -> Path:
    """A copy of the base checkpoint directory whose ``lit_model.pth`` also holds the weights (LoRA's, the adapter's)
    that ours initialized: read from ``final/SAVED`` of a run of ours that ends before its first step (epochs 0)."""
    out = tmp_path / "ours-init"
    litgpt(command, [*args, "--train.epochs", "0", "--train.max_steps", "1", "--out_dir", str(out)], how="ours",
           cwd=tmp_path)
    initialized = weights(out / "final" / saved)
    reference = tmp_path / "base-with-ours-init"
    shutil.copytree(args[0], reference)
    state = weights(Path(args[0]) / "lit_model.pth")
    assert not set(state) & set(initialized), "the base checkpoint already holds these weights"
    torch.save({**state, **initialized}, reference / "lit_model.pth")
    return reference


def test_finetune_full(base, tmp_path):
    outs = run_three("finetune_full", [str(base), *FINETUNE_ARGS], tmp_path)
    check_close("final/lit_model.pth", outs, start=weights(base / "lit_model.pth"))


def test_finetune_lora_from_base_checkpoint(base, tmp_path):
    # the base checkpoint holds no LoRA weights: litgpt loads it with strict=False and its LoRA layers rename keys
    lora = ["--lora_r", "4", "--lora_alpha", "8", "--lora_dropout", "0", "--lora_mlp", "true", "--lora_head", "true"]
    args = [str(base), *FINETUNE_ARGS, *lora]
    outs = run_three("finetune_lora", args, tmp_path,
                     reference_base=base_with_ours_init("finetune_lora", args, "lit_model.pth.lora", tmp_path))
    check_close("final/lit_model.pth.lora", outs,
                start={k: torch.zeros(()) for k in weights(outs["single"] / "final/lit_model.pth.lora")
                       if k.endswith("lora_B")})
    check_close("final/lit_model.pth", outs, start=weights(base / "lit_model.pth"))  # merged by litgpt on rank 0


def test_finetune_adapter(base, tmp_path):
    args = [str(base), *FINETUNE_ARGS]
    outs = run_three("finetune_adapter", args, tmp_path,
                     reference_base=base_with_ours_init("finetune_adapter", args, "lit_model.pth.adapter", tmp_path))
    adapter = weights(outs["single"] / "final/lit_model.pth.adapter")
    check_close("final/lit_model.pth.adapter", outs,
                start={k: torch.zeros(()) for k in adapter if k.endswith("gating_factor")})


def test_pretrain_resume(base, tmp_path):
    """Ours stops after 2 of 4 steps and resumes with ``--resume true``; single and ddp run all 4 at once. The lr is
    constant (min_lr = lr, no warmup) so that the shorter first run's schedule is the same as the long run's."""

    def args(steps: int) -> list[str]:
        return [
            "tiny-llama", "--model_config", str(base / "model_config.yaml"), "--precision", "32-true",
            "--data", "tiny.TinyPretrain", "--train.global_batch_size", "2", "--train.micro_batch_size", "1",
            "--train.max_tokens", str(steps * 2 * 32), "--train.lr_warmup_steps", "0", "--train.min_lr", str(LR),
            "--optimizer", '{"class_path": "torch.optim.AdamW", "init_args": {"lr": %s}}' % LR,
            "--train.save_interval", "2", "--eval.interval", "1000", "--eval.final_validation", "false",
            "--logger_name", "csv",
        ]

    nodynamo = {"TORCHDYNAMO_DISABLE": "1"}
    initial = ["--initial_checkpoint_dir", str(base)]
    outs = {how: tmp_path / how for how in ("single", "ours", "ddp")}
    # The single and ddp runs go side by side with ours, which stops, then resumes; each in a directory of its own.
    others = [start("pretrain", [*args(4), *initial, "--out_dir", str(outs[how])], how=how, cwd=tmp_path / f"cwd-{how}",
                    env=nodynamo) for how in ("single", "ddp")]
    litgpt("pretrain", [*args(2), *initial, "--out_dir", str(outs["ours"])], how="ours", cwd=tmp_path / "cwd-ours",
           env=nodynamo)
    assert (outs["ours"] / "step-00000002" / "lit_model.pth").exists()
    litgpt("pretrain", [*args(4), "--resume", "true", "--out_dir", str(outs["ours"])], how="ours",
           cwd=tmp_path / "cwd-ours", env=nodynamo)
    finish(*others)
    check_close("final/lit_model.pth", outs, start=weights(base / "lit_model.pth"))
