"""An EMA teacher (BYOL, DINO, diffusion EMA) with Fabric on 2 CPU processes: the teacher is set up as a second
sharded model, evaluated under no_grad, and updated in place from the student after each step. Both models are
sharded alike, so each `lerp_` works on matching local shards: no communication, 1/N of the teacher per rank.

    python examples/patterns/ema_teacher.py
"""

import copy

import torch
from lightning.fabric import Fabric

import lightning_fsdp  # noqa: F401 - registers "fsdp", usable on CPU
from common import TinyLM, batch, lm_loss

MOMENTUM = 0.99

fabric = Fabric(accelerator="cpu", devices=2, strategy="fsdp")
fabric.launch()
torch.manual_seed(0)
student = TinyLM()
teacher = copy.deepcopy(student).requires_grad_(False)  # copy before setup: both start equal
student, optimizer = fabric.setup(student, torch.optim.AdamW(student.parameters(), lr=1e-2))
teacher = fabric.setup_module(teacher)

for step in range(6):
    tokens = batch(step, fabric.global_rank)
    with torch.no_grad():
        target = teacher(tokens[:, :-1]).softmax(-1)
    logits = student(tokens[:, :-1])
    loss = -(target * logits.log_softmax(-1)).sum(-1).mean() + lm_loss(student, tokens)
    fabric.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    with torch.no_grad():
        for p_teacher, p_student in zip(teacher.parameters(), student.parameters()):
            p_teacher.lerp_(p_student, 1 - MOMENTUM)
    fabric.print(f"step {step}: loss {loss.item():.4f}")

fabric.save("checkpoints/ema_teacher", {"student": student, "teacher": teacher, "optimizer": optimizer})
fabric.print("saved student, teacher and optimizer to checkpoints/ema_teacher")
