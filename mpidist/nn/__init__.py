"""Layers with forward and hand-written backward on the array module of their input.

Parameters and gradients are views into flat buffers (see Module); backward accumulates.
See docs/ARCHITECTURE.md (layers).
"""
from mpidist.nn.attention import CausalSelfAttention
from mpidist.nn.conv import AvgPool2d, Conv2d, MaxPool2d
from mpidist.nn.layers import GELU, Dropout, Embedding, Flatten, LayerNorm, Linear, ReLU
from mpidist.nn.loss import SoftmaxCrossEntropy
from mpidist.nn.models import CNN, GPT, MLP, MODELS, build_model, data_kwargs
from mpidist.nn.module import Module, Sequential, materialize

__all__ = ["Module", "Sequential", "materialize", "Linear", "ReLU", "GELU", "LayerNorm", "Dropout",
           "Flatten", "Embedding", "Conv2d", "MaxPool2d", "AvgPool2d", "CausalSelfAttention",
           "SoftmaxCrossEntropy", "MLP", "CNN", "GPT", "MODELS", "build_model", "data_kwargs"]
