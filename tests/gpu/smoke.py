"""GPU smoke checks: what CPU CI cannot show. Run by hand on a machine with one CUDA GPU:

    python tests/gpu/smoke.py --out /tmp/gpu-smoke          # CUDA: NCCL, placement, bf16, pinned offload, memory
    python tests/gpu/smoke.py --out /tmp/gpu-smoke --cpu    # a dry run of the same code on CPU/gloo

It is not collected by pytest (CI has no GPU). Each check runs in this one process on a world of one rank; a check
that raises is recorded with its traceback and the others still run. It prints one line per check and writes
``results.json`` to ``--out``; the exit status is 1 if any check failed. On ``--cpu`` the CUDA-only assertions
(backend, pinned memory, CUDA memory counters) are replaced by their CPU meaning or left out, and say so.

A run on a GPU also appends its result to the record of GPU runs, ``docs/gpu_smoke.json`` (``--record`` names
another file): the device, the torch, CUDA, Lightning and lightning-fsdp versions, the commit, and each check's
outcome. The docs' GPU sentences are read from that file (``tests/test_docs.py``); commit it with the run.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

ROOT = Path(__file__).resolve().parents[2]
CHECKS = []


def check(fn):
    CHECKS.append(fn)
    return fn


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


class Net(nn.Module):
    def __init__(self, width: int = 256, depth: int = 4) -> None:
        super().__init__()
        self.embed = nn.Linear(32, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, 1)

    def forward(self, x):
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h).squeeze(-1)


def batches(n: int, device, seed: int = 0, rows: int = 64):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        x = torch.randn(rows, 16, 32, generator=g)
        out.append((x.to(device), x.sum(-1).tanh().to(device)))
    return out


def fabric_for(args, **strategy_kwargs):
    from lightning.fabric import Fabric

    from lightning_fsdp.fabric import FSDPStrategy

    precision = strategy_kwargs.pop("precision", "32-true")
    fabric = Fabric(accelerator="cpu" if args.cpu else "cuda", devices=1, precision=precision,
                    strategy=FSDPStrategy(auto_wrap_policy={Block}, **strategy_kwargs))
    fabric.launch()
    return fabric


def train_fabric(fabric, model, data, lr=1e-3):
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    model, optimizer = fabric.setup(model, optimizer)
    losses = []
    for x, y in data:
        loss = nn.functional.mse_loss(model(x), y)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return model, optimizer, losses


def train_plain(model, data, lr=1e-3):
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for x, y in data:
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def full(p):
    return (p.full_tensor() if isinstance(p, DTensor) else p).detach()


def max_diff(sharded, plain):
    return max((full(a).float().cpu() - b.detach().float().cpu()).abs().max().item()
               for a, b in zip(sharded.parameters(), plain.parameters()))


def local(p):
    return p.to_local() if isinstance(p, DTensor) else p


def device_of(args):
    return torch.device("cpu") if args.cpu else torch.device("cuda", 0)


def gpu_bytes(args) -> int:
    return 0 if args.cpu else torch.cuda.memory_allocated()


@check
def nccl_fp32_matches_plain_training(args):
    fabric = fabric_for(args)
    torch.manual_seed(0)
    model = Net()
    plain = copy.deepcopy(model).to(device_of(args))
    data = batches(6, device_of(args))
    sharded, optimizer, losses = train_fabric(fabric, model, data)
    train_plain(plain, data)
    backend = dist.get_backend()
    assert backend == ("gloo" if args.cpu else "nccl"), backend
    devices = {local(p).device for p in sharded.parameters()}
    assert devices == {device_of(args)}, devices
    assert all(isinstance(p, DTensor) for p in sharded.parameters())
    states = {t.device for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor) and t.dim()}
    assert states == {device_of(args)}, states
    diff = max_diff(sharded, plain)
    assert diff < 1e-5, f"weights differ from plain training by {diff}"
    assert losses[-1] < losses[0], losses
    # After setup the original parameters are gone: a model built on the host and set up again holds one copy
    # of its weights on the GPU (a world of one: the shard is the whole), not two.
    torch.manual_seed(0)
    again = Net()
    param_bytes = sum(p.numel() * p.element_size() for p in again.parameters())
    before = gpu_bytes(args)
    again = fabric.setup_module(again)
    held = gpu_bytes(args) - before
    if not args.cpu:
        assert held < 1.1 * param_bytes, f"setup left {held} bytes on the GPU for {param_bytes} bytes of weights"
    return {"backend": backend, "param_devices": sorted(map(str, devices)), "max_weight_diff": diff,
            "losses": [round(v, 5) for v in losses], "gpu_bytes_after_setup_over_weights": held / param_bytes}


@check
def bf16_mixed_computes_in_bf16_and_keeps_fp32_shards(args):
    fabric = fabric_for(args, precision="bf16-mixed")
    torch.manual_seed(0)
    model = Net()
    seen = {}

    def record(module, inputs, output):
        seen.setdefault("weight", module.weight.dtype)
        seen.setdefault("output", output.dtype)

    model.blocks[1].up.register_forward_hook(record)
    reference = copy.deepcopy(model).to(device_of(args))
    data = batches(4, device_of(args))
    sharded, optimizer, losses = train_fabric(fabric, model, data)
    reference_losses = train_plain(reference, data)  # fp32
    stored = {p.dtype for p in sharded.parameters()}
    assert seen["weight"] == torch.bfloat16, f"gathered weight in forward is {seen['weight']}"
    assert seen["output"] == torch.bfloat16, f"Linear output is {seen['output']}"
    assert stored == {torch.float32}, f"stored shards are {stored}"
    moments = {t.dtype for s in optimizer.state.values() for k, t in s.items() if k == "exp_avg"}
    assert moments == {torch.float32}, moments
    rel = abs(losses[-1] - reference_losses[-1]) / abs(reference_losses[-1])
    assert rel < 0.05, f"bf16-mixed final loss {losses[-1]} vs fp32 {reference_losses[-1]}"
    return {"forward_weight": str(seen["weight"]), "stored": sorted(map(str, stored)),
            "final_loss_bf16_vs_fp32": [losses[-1], reference_losses[-1]]}


@check
def bf16_true_trains_in_bf16(args):
    fabric = fabric_for(args, precision="bf16-true")
    torch.manual_seed(0)
    sharded, _, losses = train_fabric(fabric, Net(), batches(6, device_of(args)), lr=1e-3)
    dtypes = {p.dtype for p in sharded.parameters()}
    assert dtypes == {torch.bfloat16}, dtypes
    assert all(v == v and abs(v) < 1e4 for v in losses), losses
    return {"stored": sorted(map(str, dtypes)), "losses": [round(v, 4) for v in losses]}


@check
def fp16_mixed_follows_torch_amp(args):
    """``16-mixed`` against torch's own recipe on the unsharded model (autocast fp16 + ``GradScaler``): the same
    steps skipped for overflow (the same scale after each step) and the same losses, within fp16's precision."""
    if args.cpu:
        return "not run on --cpu (fp16 autocast and GradScaler are CUDA's here)"
    fabric = fabric_for(args, precision="16-mixed")
    torch.manual_seed(0)
    model = Net()
    reference = copy.deepcopy(model).to(device_of(args))
    data = batches(8, device_of(args))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sharded, optimizer = fabric.setup(model, optimizer)
    scaler = fabric.strategy.precision.scaler
    losses, scales = [], []
    for x, y in data:
        loss = nn.functional.mse_loss(sharded(x).float(), y)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        scales.append(scaler.get_scale())
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    ref_scaler = torch.amp.GradScaler("cuda")
    ref_losses, ref_scales = [], []
    for x, y in data:
        with torch.autocast("cuda", dtype=torch.float16):
            loss = nn.functional.mse_loss(reference(x).float(), y)
        ref_scaler.scale(loss).backward()
        ref_scaler.step(ref_optimizer)
        ref_scaler.update()
        ref_optimizer.zero_grad()
        ref_losses.append(loss.item())
        ref_scales.append(ref_scaler.get_scale())
    out = {"scales": scales, "torch_amp_scales": ref_scales, "losses": [round(v, 4) for v in losses],
           "torch_amp_losses": [round(v, 4) for v in ref_losses]}
    assert scales == ref_scales, out
    assert all(abs(a - b) <= 0.02 * abs(b) + 1e-3 for a, b in zip(losses, ref_losses)), out
    return out


@check
def cpu_offload_pins_shards_and_matches(args):
    torch.manual_seed(0)
    model = Net(depth=6)
    plain = copy.deepcopy(model).to(device_of(args))
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    fabric = fabric_for(args, cpu_offload=True)
    data = batches(4, device_of(args))
    before = gpu_bytes(args)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sharded, optimizer = fabric.setup(model, optimizer)
    after_setup = gpu_bytes(args) - before
    shards = [local(p) for p in sharded.parameters()]
    assert {t.device.type for t in shards} == {"cpu"}, {t.device for t in shards}
    pinned = all(t.is_pinned() for t in shards)
    if not args.cpu:
        assert pinned, "offloaded shards are not in pinned memory"
    in_forward = []
    for block in sharded.blocks:
        block.register_forward_hook(lambda m, i, o: in_forward.append(gpu_bytes(args) - before))
    for x, y in data:
        loss = nn.functional.mse_loss(sharded(x), y)
        fabric.backward(loss)
        grads = {local(p.grad).device.type for p in sharded.parameters()}
        assert grads == {"cpu"}, f"offloaded gradients live on {grads}"
        optimizer.step()
        optimizer.zero_grad()
    train_plain(plain, data)
    diff = max_diff(sharded, plain)
    assert diff < 1e-5, f"offloaded training differs from plain by {diff}"
    out = {"pinned": pinned, "max_weight_diff": diff, "param_bytes": param_bytes,
           "gpu_bytes_after_setup": after_setup}
    if not args.cpu:
        # Parameters live on the host: after setup the GPU holds none of them, and in forward at most a few units'
        # gathered weights plus activations, never the whole model's weights.
        assert after_setup < 0.05 * param_bytes, out
        block_bytes = sum(p.numel() * 4 for p in Block(256).parameters())
        out["gpu_bytes_in_forward_max"] = max(in_forward)
        out["block_bytes"] = block_bytes
    return out


@check
def meta_init_allocates_each_weight_once(args):
    fabric = fabric_for(args)
    before = gpu_bytes(args)
    with fabric.init_module(empty_init=True):
        model = Net(width=512, depth=4)
    assert all(p.is_meta for p in model.parameters())
    model = fabric.setup_module(model)
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    used = gpu_bytes(args) - before
    stds = [full(b.up.weight).std().item() for b in model.blocks]
    assert all(0.01 < s < 0.1 for s in stds), f"weights were not initialized: std {stds}"
    assert all((full(p) != 0).any() for n, p in model.named_parameters() if n.endswith("weight")), "zero weights"
    out = {"param_bytes": param_bytes, "gpu_bytes_after_setup": used, "up_weight_std": stds}
    if not args.cpu:
        assert param_bytes <= used < 1.1 * param_bytes, out
    return out


@check
def activation_checkpointing_lowers_peak(args):
    if args.cpu:
        return "not run on --cpu (reads CUDA's peak-memory counter)"
    peaks = {}
    for name, policy in (("none", None), ("blocks", {Block})):
        fabric = fabric_for(args, activation_checkpointing_policy=policy)
        torch.manual_seed(0)
        model = fabric.setup_module(Net(width=256, depth=8))
        x, y = batches(1, device_of(args), rows=256)[0]
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fabric.backward(nn.functional.mse_loss(model(x), y))
        torch.cuda.synchronize()
        peaks[name] = torch.cuda.max_memory_allocated() - base
        del model
    ratio = peaks["blocks"] / peaks["none"]
    assert ratio < 0.7, f"checkpointing every block left the peak at {ratio:.2f} of none's"
    return {"peak_bytes": peaks, "ratio_checkpointed_over_none": round(ratio, 3)}


@check
def async_save_and_load_are_exact(args):
    fabric = fabric_for(args, async_save=True)
    torch.manual_seed(0)
    model, optimizer, _ = train_fabric(fabric, Net(), batches(2, device_of(args)))
    path = Path(args.out) / "async-ckpt"
    state_bytes = sum(local(t).numel() * t.element_size() for t in [*model.parameters(), *(
        v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor))])
    before = gpu_bytes(args)
    fabric.save(path, {"model": model, "optimizer": optimizer})
    staged_on_gpu = gpu_bytes(args) - before  # the host copies must live on the host
    saved = [full(p).clone() for p in model.parameters()]
    x, y = batches(1, device_of(args), seed=5)[0]
    fabric.backward(nn.functional.mse_loss(model(x), y))  # training goes on while the save is written
    optimizer.step()
    moved = max((full(p) - s).abs().max().item() for p, s in zip(model.parameters(), saved))
    fabric.load(path, {"model": model, "optimizer": optimizer})
    back = max((full(p) - s).abs().max().item() for p, s in zip(model.parameters(), saved))
    assert moved > 0 and back == 0, (moved, back)
    assert staged_on_gpu < 0.05 * state_bytes, f"staging left {staged_on_gpu} bytes on the GPU ({state_bytes} staged)"
    return {"moved_after_save": moved, "diff_after_load": back, "staged_on_gpu": staged_on_gpu,
            "state_bytes": state_bytes}


@check
def trainer_fit_checkpoint_resume(args):
    import lightning as L

    from lightning_fsdp.trainer import FSDPStrategy

    x, y = batches(1, "cpu", rows=512)[0]
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=64)

    class Lit(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.seen_at_start = None

        def configure_model(self):
            if not hasattr(self, "net"):
                self.net = Net()

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def on_train_start(self):
            self.seen_at_start = [full(p).clone() for p in self.parameters()]

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    out = {}
    for state_dict_type in ("sharded", "full"):
        ckpt = Path(args.out) / f"trainer-{state_dict_type}.ckpt"
        kwargs = dict(accelerator="cpu" if args.cpu else "gpu", devices=1, logger=False, enable_progress_bar=False,
                      enable_checkpointing=False, enable_model_summary=False)
        torch.manual_seed(0)
        first = Lit()
        trainer = L.Trainer(max_steps=4, strategy=FSDPStrategy(auto_wrap_policy={Block},
                                                               state_dict_type=state_dict_type), **kwargs)
        trainer.fit(first, data)
        placement = {local(p).device.type for p in first.parameters()}
        assert placement == {"cpu" if args.cpu else "cuda"}, placement
        trainer.save_checkpoint(ckpt)
        saved = [full(p).clone() for p in first.parameters()]
        second = Lit()
        trainer = L.Trainer(max_steps=6, strategy=FSDPStrategy(auto_wrap_policy={Block},
                                                               state_dict_type=state_dict_type), **kwargs)
        trainer.fit(second, data, ckpt_path=ckpt)
        diff = max((a.cpu() - b.cpu()).abs().max().item() for a, b in zip(second.seen_at_start, saved))
        assert diff == 0, f"{state_dict_type}: resumed weights differ by {diff}"
        assert trainer.global_step == 6, trainer.global_step
        out[state_dict_type] = {"resumed_diff": diff, "global_step": trainer.global_step}
    return out


@check
def readme_main_job_on_one_device(args):
    """The README's main job (examples/train_gpt.py: train, save, fresh model, resume) on one GPU."""
    # The checks above made this process rank 0 of a world of one: its rendezvous variables must not reach the job.
    env = {k: v for k, v in os.environ.items()
           if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])
    if args.cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    command = [sys.executable, str(ROOT / "examples/train_gpt.py"), "--devices", "1", "--steps", "30",
               "--resume-steps", "10", "--log-every", "10", "--out", str(Path(args.out) / "main-job")]
    started = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    tail = (done.stdout + done.stderr)[-3000:]
    assert done.returncode == 0, tail
    return {"seconds": round(time.perf_counter() - started, 1), "output_tail": tail[-1200:]}


def _outcome(result: dict) -> str:
    if not result["ok"]:
        return "fail"
    return "not run" if isinstance(result["details"], str) and result["details"].startswith("not run") else "pass"


def record(path: Path, results: dict) -> None:
    """Append this GPU run to the record (a JSON file with a ``runs`` list), written whole then renamed."""
    import lightning_fsdp

    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    runs = json.loads(path.read_text())["runs"] if path.exists() else []
    runs.append(dict(results["header"], lightning_fsdp=lightning_fsdp.__version__, commit=commit or None,
                     date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                     checks={name: _outcome(r) for name, r in results["checks"].items()}))
    path.with_suffix(".tmp").write_text(json.dumps({"runs": runs}, indent=1) + "\n")
    path.with_suffix(".tmp").replace(path)
    print(f"recorded in {path}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--cpu", action="store_true", help="dry run on CPU/gloo")
    parser.add_argument("--only", nargs="*", help="names of the checks to run")
    parser.add_argument("--record", default=str(ROOT / "docs" / "gpu_smoke.json"),
                        help="the record of GPU runs this run is appended to (not on --cpu)")
    args = parser.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    if not args.cpu and not torch.cuda.is_available():
        print("no CUDA device: run with --cpu for a dry run", file=sys.stderr)
        return 2
    header = {"torch": torch.__version__, "cuda": torch.version.cuda,
              "device": "cpu" if args.cpu else torch.cuda.get_device_name(0)}
    try:
        import lightning

        header["lightning"] = lightning.__version__
    except ImportError:
        pass
    print(json.dumps(header), flush=True)
    results = {"header": header, "checks": {}}
    failed = 0
    for fn in CHECKS:
        if args.only and fn.__name__ not in args.only:
            continue
        started = time.perf_counter()
        try:
            details, ok = fn(args), True
        except BaseException:  # noqa: BLE001 - one failed check must not hide the others
            details, ok = traceback.format_exc(), False
            failed += 1
        seconds = round(time.perf_counter() - started, 1)
        results["checks"][fn.__name__] = {"ok": ok, "seconds": seconds, "details": details}
        skipped = ok and isinstance(details, str) and details.startswith("not run")
        print(f"{'SKIP' if skipped else 'PASS' if ok else 'FAIL'} {fn.__name__} ({seconds} s): "
              f"{json.dumps(details, default=str)[:1500] if ok else details}", flush=True)
        if not args.cpu:
            torch.cuda.empty_cache()
    (Path(args.out) / "results.json").write_text(json.dumps(results, indent=1, default=str))
    if not args.cpu:
        record(Path(args.record), results)
    if dist.is_initialized():
        dist.destroy_process_group()
    print(f"{len(results['checks']) - failed} passed, {failed} failed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
