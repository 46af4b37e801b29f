"""Models and batches shared by multi-process workers and the tests that check them."""

from __future__ import annotations

import torch

from fxspeed.models import GPT, GPTConfig


def build_model(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if name == "gpt":
        return GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32))
    if name == "gpt2":
        import transformers

        cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        return transformers.GPT2LMHeadModel(cfg)
    raise ValueError(name)


def global_batches(name: str, steps: int, batch: int = 8, seq: int = 16) -> list:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        x = torch.randint(0, 64, (batch, seq), generator=g)
        y = torch.randint(0, 64, (batch, seq), generator=g)
        out.append((x, y) if name == "gpt" else {"input_ids": x, "labels": x})
    return out
