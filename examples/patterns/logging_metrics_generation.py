"""Grad-free forwards around the training step, with Fabric on 2 CPU processes:

- a loss for logging, computed under no_grad between the backwards and the step of an accumulation window;
- a torchmetrics metric updated from those forwards and synced across ranks;
- greedy generation (many forwards under no_grad) in the middle of training.

None of them needs any care: after a forward that no backward follows, the strategy puts every unit back into its
sharded state, so the optimizer step updates what the next forward reads.

    python examples/patterns/logging_metrics_generation.py
"""

import torch
import torchmetrics
from lightning.fabric import Fabric

import lightning_fsdp  # noqa: F401 - registers "fsdp", usable on CPU
from common import TinyLM, batch, lm_loss

fabric = Fabric(accelerator="cpu", devices=2, strategy="fsdp")
fabric.launch()
torch.manual_seed(0)
model = TinyLM()
model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
probe_loss = torchmetrics.MeanMetric()

for step in range(6):
    for micro in range(2):  # two micro-batches per step; only the second backward communicates
        with fabric.no_backward_sync(model, enabled=micro == 0):
            fabric.backward(lm_loss(model, batch(10 * step + micro, fabric.global_rank)) / 2)
    with torch.no_grad():  # a logging forward before the step
        probe_loss.update(lm_loss(model, batch(999, fabric.global_rank)))
    optimizer.step()
    optimizer.zero_grad()
    if step % 3 == 2:
        tokens = batch(0, fabric.global_rank)[:1, :4]
        with torch.no_grad():  # generation: one forward per new token
            for _ in range(8):
                tokens = torch.cat([tokens, model(tokens)[:, -1:].argmax(-1)], dim=1)
        fabric.print(f"step {step}: probe loss {probe_loss.compute().item():.4f}, sample {tokens[0].tolist()}")
        probe_loss.reset()
