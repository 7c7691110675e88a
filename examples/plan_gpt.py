"""Factories for `lightning-fsdp plan`: the example GPT of `train_gpt.py` at a size worth planning (GPT-2 small:
124M parameters) and one rank's batch. Nothing here allocates when the planner calls it: it builds on fake tensors.

    .venv/bin/python -m lightning_fsdp plan --model examples/plan_gpt.py:build --inputs examples/plan_gpt.py:batch \\
        --world-size 4 --auto-wrap-policy train_gpt.Block --memory-budget 1.5GiB
"""

import torch

from train_gpt import GPT, GPTConfig

CONFIG = GPTConfig(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768)
BATCH = 2


def build() -> GPT:
    return GPT(CONFIG)


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, targets): with targets, the model returns its loss."""
    tokens = torch.randint(0, CONFIG.vocab_size, (BATCH, CONFIG.block_size))
    return tokens, torch.randint(0, CONFIG.vocab_size, (BATCH, CONFIG.block_size))
