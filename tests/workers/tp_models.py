"""The models of ``workers/tensor_parallel.py`` (4 ranks, a (shard=2, tp=2) mesh): a GPT-style model with its
explicit plan, a tiny Hugging Face Llama that carries its own, and the batches the memory plan of a tensor-parallel
step takes. It imports nothing of the test harness: the pytest process plans these models (a plan needs a process of
its own, without a process group), and the worker trains them for real."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, DIM, HEADS, SEQ = 64, 32, 4, 8

PLAN = {
    "blocks.*.attn.q_proj": "colwise", "blocks.*.attn.k_proj": "colwise", "blocks.*.attn.v_proj": "colwise",
    "blocks.*.attn.o_proj": "rowwise", "blocks.*.mlp.up": "colwise", "blocks.*.mlp.down": "rowwise",
}


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(DIM, DIM) for _ in range(3))
        self.o_proj = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds its share of the heads.
        q, k, v = (p(x).view(b, t, -1, DIM // HEADS).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.attn, self.ln2, self.mlp = nn.LayerNorm(DIM), Attention(), nn.LayerNorm(DIM), MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, layers: int = 2) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(layers))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class TiedGPT(GPT):
    """``GPT`` with its head tied to the token embedding (both ``(VOCAB, DIM)``), as many small models are."""

    def __init__(self, layers: int = 2) -> None:
        super().__init__(layers)
        self.head.weight = self.wte.weight


def llama(tie_word_embeddings: bool = False) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=DIM, intermediate_size=2 * DIM, num_hidden_layers=2, num_attention_heads=HEADS,
        num_key_value_heads=HEADS, max_position_embeddings=SEQ, tie_word_embeddings=tie_word_embeddings,
    ))


def tied_llama() -> nn.Module:
    """``llama()`` with ``tie_word_embeddings=True``: ``lm_head.weight is model.embed_tokens.weight``."""
    return llama(tie_word_embeddings=True)


def llama_block() -> type:
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    return LlamaDecoderLayer


# One rank's batch of the planned step (``test_tensor_parallel.py``'s plans against the worker's tracked steps): more
# rows than the parity cases' 2, so that activations, not only the model state, count in the peak.
PLANNED_ROWS = 8


def gpt_batch() -> torch.Tensor:
    """Token ids for ``GPT``: the planner backpropagates the sum of its logits, and so does the measured step."""
    return torch.randint(0, VOCAB, (PLANNED_ROWS, SEQ), generator=torch.Generator().manual_seed(0))


def llama_batch() -> dict:
    """Keyword arguments for ``llama()``, with labels: its output's ``.loss`` is the loss."""
    ids = torch.randint(0, VOCAB, (PLANNED_ROWS, SEQ), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids}
