"""Small models in plain PyTorch that mpidist's torch job and benchmark share.

GPT: a byte-level decoder-only transformer (pre-norm blocks of causal self-attention and a
4x GELU MLP, learned positions), the model of jobs/torch_gpt.py and `mpidist bench torch
--model gpt`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Block", "GPT", "windows"]


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then a 4x MLP."""

    def __init__(self, dim, heads):
        super().__init__()
        if dim % heads:
            raise ValueError(f"dim ({dim}) must be a multiple of heads ({heads})")
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Token ids (batch, t <= block) -> logits (batch, t, vocab)."""

    def __init__(self, block=64, dim=256, layers=4, heads=4, vocab=256):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, dim), nn.Embedding(block, dim)
        self.blocks = nn.Sequential(*[Block(dim, heads) for _ in range(layers)])
        self.ln, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab, bias=False)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        return self.head(self.ln(self.blocks(x)))


def windows(text, step: int, rank: int, size: int, block: int):
    """(inputs, next-byte targets): `size` random windows of `block` bytes of `text` (a
    uint8 tensor), drawn from a generator seeded by (step, rank), so that a resumed run or
    another variant of a benchmark sees the same data."""
    g = torch.Generator().manual_seed(step * 100_003 + rank)
    starts = torch.randint(0, len(text) - block - 1, (size,), generator=g)
    x = torch.stack([text[s:s + block] for s in starts])
    y = torch.stack([text[s + 1:s + block + 1] for s in starts])
    return x.long(), y.long()
