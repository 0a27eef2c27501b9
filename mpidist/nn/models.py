"""Models built from the layers (MLP, small CNN, small GPT-style LM) and their registry.

See docs/ARCHITECTURE.md (layers).
"""
from __future__ import annotations

import numpy as np

from mpidist.kernels.backend import get_array_module
from mpidist.nn.attention import CausalSelfAttention
from mpidist.nn.conv import Conv2d, MaxPool2d
from mpidist.nn.layers import GELU, Dropout, Embedding, Flatten, LayerNorm, Linear, ReLU
from mpidist.nn.module import Module, Sequential

__all__ = ["MLP", "CNN", "GPT", "MODELS", "build_model", "data_kwargs"]

_ACTIVATIONS = {"relu": ReLU, "gelu": GELU}


def _activation(name: str):
    if name not in _ACTIVATIONS:
        raise ValueError(f"unknown activation {name!r}; choose one of {sorted(_ACTIVATIONS)}")
    return _ACTIVATIONS[name]()


class MLP(Sequential):
    """in_features -> hidden... -> out_features, activation (and dropout) between layers."""

    def __init__(self, in_features: int, out_features: int, hidden=(256, 256), activation: str = "relu",
                 dropout: float = 0.0, seed: int = 0):
        sizes = [in_features, *hidden, out_features]
        layers, names = [], []
        for i in range(len(sizes) - 1):
            layers.append(Linear(sizes[i], sizes[i + 1]))
            names.append(f"fc{i + 1}")
            if i < len(sizes) - 2:
                layers.append(_activation(activation))
                names.append(f"act{i + 1}")
                if dropout:
                    layers.append(Dropout(dropout, seed=seed + i))
                    names.append(f"drop{i + 1}")
        super().__init__(*layers, names=names)


class CNN(Module):
    """Two conv3x3-ReLU-maxpool2 blocks and a linear classifier; flat input is reshaped to in_shape."""

    def __init__(self, in_shape, out_features: int, channels=(16, 32)):
        super().__init__()
        c, h, w = (int(s) for s in in_shape)
        self.in_shape = (c, h, w)
        layers, names = [], []
        for i, ch in enumerate(channels):
            if h < 2 or w < 2:
                raise ValueError(f"CNN: input {in_shape} is too small for {len(channels)} pooling blocks")
            layers += [Conv2d(c, ch, 3, padding=1), ReLU(), MaxPool2d(2)]
            names += [f"conv{i + 1}", f"relu{i + 1}", f"pool{i + 1}"]
            c, h, w = ch, h // 2, w // 2
        layers += [Flatten(), Linear(c * h * w, out_features)]
        names += ["flatten", "fc"]
        self.body = self.add_child("body", Sequential(*layers, names=names))

    def forward(self, x, train=True):
        self._in = x.shape
        return self.body.forward(x.reshape(x.shape[0], *self.in_shape), train)

    def backward(self, dy):
        dx = self.body.backward(dy)
        return None if dx is None else dx.reshape(self._in)


class Block(Module):
    """Pre-norm transformer block: x + attn(ln1(x)), then x + mlp(ln2(x))."""

    def __init__(self, dim: int, heads: int, dropout: float, seed: int):
        super().__init__()
        self.ln1 = self.add_child("ln1", LayerNorm(dim))
        self.attn = self.add_child("attn", CausalSelfAttention(dim, heads))
        self.ln2 = self.add_child("ln2", LayerNorm(dim))
        self.mlp = self.add_child("mlp", Sequential(Linear(dim, 4 * dim, init_std=0.02), GELU(),
                                                    Linear(4 * dim, dim, init_std=0.02), Dropout(dropout, seed),
                                                    names=["fc", "gelu", "proj", "drop"]))

    def forward(self, x, train=True):
        x = x + self.attn.forward(self.ln1.forward(x, train), train)
        return x + self.mlp.forward(self.ln2.forward(x, train), train)

    def backward(self, dy):
        dy = dy + self.ln2.backward(self.mlp.backward(dy))
        return dy + self.ln1.backward(self.attn.backward(dy))


class GPT(Module):
    """Token + position embeddings, `layers` blocks, final LayerNorm, linear head to vocab logits."""

    def __init__(self, vocab: int, block: int, dim: int = 64, heads: int = 4, layers: int = 2,
                 dropout: float = 0.0, seed: int = 0):
        super().__init__()
        self.block = int(block)
        self.tok = self.add_child("tok", Embedding(vocab, dim))
        self.pos = self.add_child("pos", Embedding(block, dim))
        self.blocks = [self.add_child(f"h{i}", Block(dim, heads, dropout, seed + i)) for i in range(layers)]
        self.ln_f = self.add_child("ln_f", LayerNorm(dim))
        self.head = self.add_child("head", Linear(dim, vocab, bias=False, init_std=0.02))

    def forward(self, ids, train=True):
        xp = get_array_module(ids)
        if ids.ndim != 2 or ids.shape[1] > self.block:
            raise ValueError(f"GPT takes ids of shape (batch, <= {self.block}), got {ids.shape}")
        x = self.tok.forward(ids, train) + self.pos.forward(xp.arange(ids.shape[1]), train)
        for blk in self.blocks:
            x = blk.forward(x, train)
        return self.head.forward(self.ln_f.forward(x, train), train)

    def backward(self, dy):
        dx = self.ln_f.backward(self.head.backward(dy))
        for blk in reversed(self.blocks):
            dx = blk.backward(dx)
        self.pos.backward(dx.sum(axis=0))
        self.tok.backward(dx)
        return None


MODELS = {"mlp": MLP, "cnn": CNN, "gpt": GPT}


def data_kwargs(name: str, meta: dict) -> dict:
    """The constructor arguments a model takes from the dataset's metadata."""
    if name == "mlp":
        return {"in_features": int(np.prod(meta["in_shape"])), "out_features": int(meta["classes"])}
    if name == "cnn":
        shape = tuple(meta["in_shape"])
        return {"in_shape": shape if len(shape) == 3 else (1, *shape), "out_features": int(meta["classes"])}
    if name == "gpt":
        return {"vocab": int(meta["vocab"]), "block": int(meta["block"])}
    raise ValueError(f"unknown model {name!r}; choose one of {sorted(MODELS)}")


def build_model(name: str, **kwargs) -> Module:
    """MODELS[name](**kwargs), with a ValueError naming the valid models or arguments."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose one of {sorted(MODELS)}")
    try:
        return MODELS[name](**kwargs)
    except TypeError as exc:
        raise ValueError(f"model {name!r}: {exc}") from None
