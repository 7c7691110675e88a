"""Train a tiny character-level GPT with lightning-fsdp's FSDPStrategy, save a checkpoint, then resume from it.

    bash examples/train.sh                          # sets up .venv, then runs this script on 2 processes
    .venv/bin/python examples/train_gpt.py --help   # the script alone, once .venv exists

Read it top to bottom: command line, data, model, training loop, then main(): train, save, build a fresh model,
load, continue. On a machine with CUDA it uses the GPUs in bf16-mixed; otherwise it runs on CPU processes in fp32
with gloo. Fabric's launcher starts the other processes by running this script again, so every rank runs all of it;
`fabric.print` prints on rank 0 only.
"""

from __future__ import annotations

import argparse
import math
import random
import time
from dataclasses import asdict, dataclass
from itertools import islice
from pathlib import Path
from typing import Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F
from lightning.fabric import Fabric
from torch.utils.data import DataLoader, Dataset

from lightning_fsdp.fabric import FSDPStrategy


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, default=2, help="processes (CPU) or GPUs to train on")
    parser.add_argument("--steps", type=int, default=150, help="optimizer steps before the checkpoint")
    parser.add_argument("--resume-steps", type=int, default=50, help="optimizer steps after resuming")
    parser.add_argument("--out", type=Path, default=Path("checkpoints/gpt"), help="directory for the checkpoints")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--state-dict-type", choices=("sharded", "full"), default="sharded",
                        help="sharded: a directory of DCP files, one per rank; full: one torch.save file")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per rank per micro-batch")
    parser.add_argument("--accumulate", type=int, default=2, help="micro-batches per optimizer step")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--log-every", type=int, default=25)
    args = parser.parse_args()
    if min(args.devices, args.steps, args.batch_size, args.accumulate, args.log_every) < 1 or args.resume_steps < 0:
        parser.error("--devices, --steps, --batch-size, --accumulate and --log-every must be >= 1, --resume-steps >= 0")
    return args


# ------------------------------------------------------------------------------------------------------------------
# Data: a made-up language, generated the same way on every rank, so nothing is downloaded.
# ------------------------------------------------------------------------------------------------------------------

WORDS = {
    "det": ["the", "a", "every", "one", "that"],
    "adj": ["small", "old", "quiet", "green", "clever", "brave", "sleepy", "golden"],
    "noun": ["fox", "bird", "river", "king", "lantern", "garden", "sailor", "mountain", "owl", "baker"],
    "verb": ["sees", "follows", "finds", "carries", "remembers", "paints", "guards", "visits"],
    "prep": ["near", "under", "behind", "beyond", "inside"],
}


def make_text(num_chars: int, seed: int = 0) -> str:
    """Sentences like 'the old fox finds a lantern near the river.', from a fixed-seed random generator."""
    rng = random.Random(seed)

    def phrase() -> str:
        adjective = [rng.choice(WORDS["adj"])] if rng.random() < 0.5 else []
        return " ".join([rng.choice(WORDS["det"]), *adjective, rng.choice(WORDS["noun"])])

    sentences, size = [], 0
    while size < num_chars:
        sentence = f"{phrase()} {rng.choice(WORDS['verb'])} {phrase()}"
        if rng.random() < 0.4:
            sentence += f" {rng.choice(WORDS['prep'])} {phrase()}"
        sentence += "." if rng.random() < 0.8 else "!"
        sentences.append(sentence)
        size += len(sentence) + 1
    return "\n".join(sentences)


class CharWindows(Dataset):
    """Windows of ``block_size + 1`` characters (input plus the next-character targets).

    Which window index ``i`` stands for is reshuffled every epoch from ``seed + epoch``. Fabric's distributed sampler
    then deals the indices out to the ranks without shuffling again, so a position ``(epoch, batch)`` is all that a
    checkpoint needs to continue the data stream exactly.
    """

    def __init__(self, data: torch.Tensor, block_size: int, seed: int) -> None:
        self.data, self.block_size, self.seed = data, block_size, seed
        self.starts = torch.arange(0, len(data) - block_size - 1, block_size // 2)
        self.set_epoch(0)

    def set_epoch(self, epoch: int) -> None:
        generator = torch.Generator().manual_seed(self.seed + epoch)
        self.order = self.starts[torch.randperm(len(self.starts), generator=generator)]

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = int(self.order[i])
        chunk = self.data[start : start + self.block_size + 1]
        return chunk[:-1], chunk[1:]


def endless(loader: DataLoader, data_state: dict) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Yield batches forever. ``data_state`` ({"epoch", "batch"}) always names the next batch to come."""
    while True:
        loader.dataset.set_epoch(data_state["epoch"])
        for x, y in islice(loader, data_state["batch"], None):  # skips what a resumed run already used
            data_state["batch"] += 1
            yield x, y
        data_state["epoch"] += 1
        data_state["batch"] = 0


# ------------------------------------------------------------------------------------------------------------------
# Model: a GPT in the style of nanoGPT. The Blocks in `blocks` become the FSDP units (auto_wrap_policy="auto" finds
# the repeated class in the ModuleList; naming it, `auto_wrap_policy={Block}`, does the same).
# ------------------------------------------------------------------------------------------------------------------


@dataclass
class GPTConfig:
    vocab_size: int
    block_size: int = 64
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 64


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.proj = nn.Linear(config.n_embd, config.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.proj = nn.Linear(4 * config.n_embd, config.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.n_embd)
        # A bare Parameter: no torch layer initializes it, so `reset_parameters` below must.
        self.pos_emb = nn.Parameter(torch.empty(config.block_size, config.n_embd))
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.head = nn.Linear(config.n_embd, config.vocab_size)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # With `fabric.init_module(empty_init=True)` the model is built on the meta device; after sharding, the
        # strategy allocates each rank's shards and calls `reset_parameters()` on every module that owns tensors
        # directly (nn.Linear, nn.LayerNorm and nn.Embedding bring their own). Initialize only this module's own
        # tensors here; on the sharded parameter this draws just the local shard.
        nn.init.normal_(self.pos_emb, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """The next-character logits, or with ``targets`` the mean cross-entropy loss."""
        x = self.tok_emb(idx) + self.pos_emb[: idx.shape[1]]
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def make_optimizer(model: nn.Module, lr: float) -> torch.optim.Optimizer:
    # Weight decay on matrices only. The strategy keeps these param groups when it swaps in the sharded parameters.
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))


def build(fabric: Fabric, config: GPTConfig, lr: float) -> tuple[nn.Module, torch.optim.Optimizer]:
    """Model on the meta device, optimizer on its (still meta) parameters, then one joint `fabric.setup`.

    No rank ever allocates the full model: `setup` shards first and only then materializes the local shards. The
    optimizer must be created before `setup` and set up together with the model, because sharding replaces the
    parameter objects; the strategy points the optimizer at the new ones.
    """
    with fabric.init_module(empty_init=True):
        model = GPT(config)
    optimizer = make_optimizer(model, lr)
    return fabric.setup(model, optimizer)


# ------------------------------------------------------------------------------------------------------------------
# Training and evaluation
# ------------------------------------------------------------------------------------------------------------------


def lr_at(step: int, max_lr: float, total_steps: int, warmup: int = 20) -> float:
    """Linear warmup, then cosine decay to a tenth: a function of the step alone, so resuming needs no state."""
    if step < warmup:
        return max_lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
    return max_lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


def train(
    fabric: Fabric,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: Iterator[tuple[torch.Tensor, torch.Tensor]],
    first_step: int,
    last_step: int,
    args: argparse.Namespace,
) -> None:
    total_steps = args.steps + args.resume_steps
    model.train()
    started = time.perf_counter()
    for step in range(first_step, last_step):
        lr = lr_at(step, args.lr, total_steps)
        for group in optimizer.param_groups:
            group["lr"] = lr
        step_loss = torch.zeros((), device=fabric.device)
        for micro in range(args.accumulate):
            x, y = next(batches)
            # Only the last micro-batch reduces gradients across ranks; the others accumulate them locally.
            with fabric.no_backward_sync(model, enabled=micro < args.accumulate - 1):
                loss = model(x, y) / args.accumulate
                fabric.backward(loss)
            step_loss += loss.detach()
        fabric.clip_gradients(model, optimizer, max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

        done = step + 1
        if done % args.log_every == 0 or done == last_step:
            mean_loss = fabric.all_reduce(step_loss, reduce_op="mean").item()  # every rank must join this call
            ms = 1000 * (time.perf_counter() - started) / (done - first_step)
            fabric.print(f"step {done:5d}/{total_steps} | loss {mean_loss:.4f} | lr {lr:.2e} | {ms:.0f} ms/step")


@torch.no_grad()
def evaluate(fabric: Fabric, model: nn.Module, val_loader: DataLoader, max_batches: int = 8) -> float:
    """Mean validation loss over every rank's share of the first `max_batches` batches."""
    model.eval()
    losses = [model(x, y) for x, y in islice(val_loader, max_batches)]
    model.train()
    return fabric.all_reduce(torch.stack(losses).mean(), reduce_op="mean").item()


@torch.no_grad()
def sample(model: nn.Module, prompt: torch.Tensor, new_chars: int, seed: int) -> torch.Tensor:
    """Every rank must run the same number of forward passes (each one all-gathers the shards), so all ranks sample."""
    model.eval()
    generator = torch.Generator(device=prompt.device).manual_seed(seed)
    idx = prompt
    for _ in range(new_chars):
        logits = model(idx[:, -model.config.block_size :])[:, -1, :].float()
        probs = torch.softmax(logits / 0.8, dim=-1)
        idx = torch.cat([idx, torch.multinomial(probs, 1, generator=generator)], dim=1)
    model.train()
    return idx


# ------------------------------------------------------------------------------------------------------------------
# main: train -> save -> fresh model -> load -> continue
# ------------------------------------------------------------------------------------------------------------------


def main() -> None:
    args = parse_args()
    started = time.perf_counter()
    cuda = torch.cuda.is_available()
    strategy = FSDPStrategy(state_dict_type=args.state_dict_type)  # auto_wrap_policy="auto": one unit per Block
    fabric = Fabric(
        accelerator="cuda" if cuda else "cpu",
        devices=args.devices,
        strategy=strategy,  # an instance: Lightning refuses the string "fsdp" on CPU
        precision="bf16-mixed" if cuda else "32-true",
    )
    fabric.launch()  # starts the other processes (they re-run this script) and joins the process group
    if not cuda:
        torch.set_num_threads(1)  # one thread per process; the ranks share the machine's cores
    fabric.seed_everything(args.seed, verbose=False)  # the same seed on every rank: init and data order rely on it

    # --- data: 90% train, 10% validation; fabric.setup_dataloaders gives each rank its own share ----------------
    text = make_text(200_000)
    chars = sorted(set(text))
    encode = {c: i for i, c in enumerate(chars)}
    data = torch.tensor([encode[c] for c in text], dtype=torch.long)
    split = int(0.9 * len(data))
    config = GPTConfig(vocab_size=len(chars))
    train_loader, val_loader = fabric.setup_dataloaders(
        DataLoader(CharWindows(data[:split], config.block_size, args.seed), batch_size=args.batch_size),
        DataLoader(CharWindows(data[split:], config.block_size, args.seed + 1), batch_size=args.batch_size),
    )

    # --- model and optimizer ---------------------------------------------------------------------------------
    model, optimizer = build(fabric, config, args.lr)
    n_params = sum(p.numel() for p in model.parameters())  # numel() of a sharded parameter is its full size
    fabric.print(f"GPT: {n_params / 1e3:.0f}k parameters, vocab {len(chars)}, {fabric.world_size} ranks on "
                 f"{fabric.device.type}, precision {'bf16-mixed' if cuda else '32-true'}, "
                 f"{args.state_dict_type} checkpoints")

    # --- train ---------------------------------------------------------------------------------------------------
    data_state = {"epoch": 0, "batch": 0}
    fabric.print(f"val loss before training: {evaluate(fabric, model, val_loader):.4f}")
    train(fabric, model, optimizer, endless(train_loader, data_state), 0, args.steps, args)

    # --- save: model and optimizer through DCP (sharded) or gathered on rank 0 (full); the rest as plain values --
    suffix = ".pt" if args.state_dict_type == "full" else ""
    path = (args.out / f"step-{args.steps:06d}{suffix}").resolve()
    state = {"model": model, "optimizer": optimizer, "step": args.steps, "data_state": dict(data_state),
             "config": asdict(config)}
    fabric.save(path, state)
    fabric.print(f"saved checkpoint: {path}")
    val_before_save = evaluate(fabric, model, val_loader)
    fabric.print(f"val loss after {args.steps} steps: {val_before_save:.4f}")
    del model, optimizer, state

    # --- resume: a fresh model and optimizer, as a new run would build them, then fabric.load ----------------------
    model, optimizer = build(fabric, config, args.lr)
    state = {"model": model, "optimizer": optimizer, "step": 0, "data_state": {}, "config": {}}
    fabric.load(path, state)  # restores model and optimizer in place; plain values come back in `state`
    if state["config"] != asdict(config):
        raise RuntimeError(f"checkpoint config {state['config']} differs from {asdict(config)}")
    resumed_step, data_state = state["step"], state["data_state"]
    val_after_load = evaluate(fabric, model, val_loader)
    if not math.isclose(val_after_load, val_before_save, rel_tol=1e-5, abs_tol=1e-6):
        raise RuntimeError(f"val loss after loading ({val_after_load}) differs from before saving ({val_before_save})")
    fabric.print(f"resumed from step {resumed_step} (data epoch {data_state['epoch']}, batch {data_state['batch']}):"
                 f" val loss {val_after_load:.4f}, the same as before saving")

    last_step = resumed_step + args.resume_steps
    train(fabric, model, optimizer, endless(train_loader, data_state), resumed_step, last_step, args)

    final = (args.out / f"step-{last_step:06d}{suffix}").resolve()
    fabric.save(final, {"model": model, "optimizer": optimizer, "step": last_step, "data_state": dict(data_state),
                        "config": asdict(config)})
    fabric.print(f"val loss after {last_step} steps: {evaluate(fabric, model, val_loader):.4f}")

    prompt = torch.tensor([[encode[c] for c in "the "]], device=fabric.device)
    generated = sample(model, prompt, new_chars=120, seed=args.seed)[0].tolist()
    fabric.print("sample: " + repr("".join(chars[i] for i in generated)))
    fabric.barrier()  # rank 0 ends last: its exit status then speaks for every rank
    fabric.print(f"resumed run continued from step {resumed_step} to step {last_step}")
    fabric.print(f"checkpoints: {path} (resumed from), {final} (final)")
    fabric.print(f"done in {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    main()
