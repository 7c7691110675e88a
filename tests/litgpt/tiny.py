"""A tiny litgpt checkpoint directory and data modules, built offline, for running litgpt's own scripts.

``build_checkpoint(dir)`` writes what litgpt's ``check_valid_checkpoint_dir`` and ``Tokenizer`` read:
``model_config.yaml``, ``lit_model.pth`` (a seeded GPT), and a word-level ``tokenizer.json`` trained with the
``tokenizers`` library on a few sentences, plus ``tokenizer_config.json`` and ``generation_config.json``.

``TinySFT`` (finetune scripts) and ``TinyPretrain`` (``litgpt pretrain``) are data modules that litgpt's command line
builds from ``--data tiny.TinySFT`` when this folder is on ``PYTHONPATH``. Both make every sample the same length and
never shuffle, so that a step on 2 ranks (Fabric's ``DistributedSampler`` gives rank r the samples r, r+2, ...) sees
exactly the samples of the ``devices=1`` run's step, and each micro-batch's mean loss weighs the same in both.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import torch
import yaml
from torch.utils.data import DataLoader, Dataset

from litgpt.data import DataModule
from litgpt.prompts import Default
from litgpt.tokenizer import Tokenizer

SENTENCES = [
    "the quick brown fox jumps over the lazy dog",
    "a small model learns to copy short sentences",
    "every rank holds one shard of each weight",
    "gradients are reduced across ranks after backward",
    "the optimizer steps on its own shard only",
    "checkpoints hold full weights in one file",
    "low rank adapters train few weights",
    "prefix adapters add learned prompts to attention",
]

# A llama-like block (RMSNorm, SwiGLU MLP, grouped queries) so the scripts' LLaMAMLP branches run too. Three layers:
# litgpt's adapter inserts its prompts from layer `adapter_start_layer` (default 2) on.
CONFIG = dict(
    name="tiny-llama", block_size=32, vocab_size=64, padded_vocab_size=64, n_layer=3, n_head=4, n_query_groups=2,
    n_embd=32, rotary_percentage=1.0, parallel_residual=False, bias=False, norm_class_name="RMSNorm",
    mlp_class_name="LLaMAMLP", intermediate_size=64,
)
SEQ_LEN = 16  # tokens per finetune sample (the pretrain samples are block_size + 1 long)


def build_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from tokenizers.trainers import WordLevelTrainer

    tokenizer = HFTokenizer(WordLevel(unk_token="<unk>"))
    tokenizer.pre_tokenizer = Whitespace()
    trainer = WordLevelTrainer(vocab_size=CONFIG["vocab_size"], special_tokens=["<unk>", "<s>", "</s>"])
    tokenizer.train_from_iterator(SENTENCES + ["below is an instruction response input"], trainer=trainer)
    assert tokenizer.get_vocab_size() <= CONFIG["padded_vocab_size"]
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", "add_bos_token": False}
    ))
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))


def build_checkpoint(out: Path, seed: int = 0) -> Path:
    from litgpt.model import GPT, Config

    out.mkdir(parents=True, exist_ok=True)
    (out / "model_config.yaml").write_text(yaml.safe_dump(CONFIG))
    torch.manual_seed(seed)
    model = GPT(Config(**CONFIG))
    torch.save(model.state_dict(), out / "lit_model.pth")
    build_tokenizer(out)
    return out


def token_stream(tokenizer: Optional[Tokenizer], length: int) -> torch.Tensor:
    """``length`` token ids cycling through the sentences (through the tokenizer where the script gives one)."""
    if tokenizer is None:
        ids = torch.arange(3, CONFIG["vocab_size"]).repeat(length // (CONFIG["vocab_size"] - 3) + 1)
    else:
        ids = torch.cat([tokenizer.encode(s, bos=False, eos=True) for s in SENTENCES])
        ids = ids.repeat(length // len(ids) + 1)
    return ids[:length].long()


class _SFTSamples(Dataset):
    def __init__(self, ids: torch.Tensor) -> None:
        self.ids = ids.view(-1, SEQ_LEN)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, Any]:
        n = torch.tensor(SEQ_LEN)
        # no ignore_index in the labels: every micro-batch's mean loss is over the same number of tokens
        return {"input_ids": self.ids[i], "labels": self.ids[i].clone(),
                "token_counts": {"raw": n, "raw_plus_prompt_template": n}}


class TinySFT(DataModule):
    """Fixed-length samples for litgpt's finetune scripts: ``train_samples`` to train on, 2 to validate on."""

    def __init__(self, train_samples: int = 16) -> None:
        super().__init__()
        self.train_samples = train_samples
        self.prompt_style = Default()
        self.tokenizer: Optional[Tokenizer] = None
        self.batch_size = 1

    def connect(self, tokenizer: Optional[Tokenizer] = None, batch_size: int = 1,
                max_seq_length: Optional[int] = None) -> None:
        self.tokenizer, self.batch_size = tokenizer, batch_size

    def train_dataloader(self) -> DataLoader:
        ids = token_stream(self.tokenizer, self.train_samples * SEQ_LEN)
        return DataLoader(_SFTSamples(ids), batch_size=self.batch_size, shuffle=False)

    def val_dataloader(self) -> DataLoader:
        ids = token_stream(self.tokenizer, 2 * SEQ_LEN).flip(0)
        return DataLoader(_SFTSamples(ids), batch_size=self.batch_size, shuffle=False)


class ResumableLoader(DataLoader):
    """A ``DataLoader`` that litgpt's pretrain can save and restore (it keeps ``train_dataloader`` in its checkpoint
    state, as litdata's ``StreamingDataLoader`` allows): the state is how many batches of the current pass it has
    given out, and a restored loader skips that many on its next pass. No extra ``__init__`` arguments, so Fabric can
    rebuild it with a ``DistributedSampler``."""

    _given = 0
    _skip = 0

    def __iter__(self):
        skip, self._skip, self._given = self._skip, 0, 0
        for i, batch in enumerate(super().__iter__()):
            if i < skip:
                continue
            self._given = i + 1
            yield batch

    def state_dict(self) -> dict[str, int]:
        return {"batches_given": self._given}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self._skip = int(state["batches_given"])


class TinyPretrain(DataModule):
    """Rows of ``max_seq_length + 1`` token ids for litgpt's pretrain (which slices inputs and shifted targets)."""

    def __init__(self, train_samples: int = 32) -> None:
        super().__init__()
        self.train_samples = train_samples
        self.batch_size = 1
        self.seq_length = CONFIG["block_size"]

    def connect(self, tokenizer: Optional[Tokenizer] = None, batch_size: int = 1,
                max_seq_length: Optional[int] = None) -> None:
        self.batch_size = batch_size
        self.seq_length = max_seq_length or self.seq_length

    def _rows(self, n: int, shift: int) -> torch.Tensor:
        ids = token_stream(None, n * (self.seq_length + 1) + shift)[shift:]
        return ids.view(n, self.seq_length + 1)

    def train_dataloader(self) -> DataLoader:
        return ResumableLoader(list(self._rows(self.train_samples, 0)), batch_size=self.batch_size, shuffle=False)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(list(self._rows(2, 5)), batch_size=self.batch_size, shuffle=False)


if __name__ == "__main__":
    import sys

    print(build_checkpoint(Path(sys.argv[1])))
