"""``gpt``: a decoder-only transformer for language modelling.

Pre-norm blocks (RMSNorm: :class:`layers.RMSNorm`), causal self-attention through
``F.scaled_dot_product_attention`` (flash or cuDNN kernels on GPUs), rotary position embeddings (in
training on GPUs, one kernel each way: :mod:`rotary_kernel`), an MLP, and an output layer tied to
the token embedding. The model returns logits (batch, time, vocabulary), or, given ``labels``, its
loss (the trainer passes them, as it does to HuggingFace's models: on GPUs, for 1,024 tokens or
more, the output layer and the loss are then one operator). ``generate`` samples with a key/value
cache, so each new token costs one position's work, not the whole prefix's. ``attention`` picks the
attention kernel (PyTorch's choice by default); ``pad_vocab`` rounds the embedding's rows up to a
multiple (a learned vocabulary has any size, and an odd one keeps the output layer's matrix products
off the tensor cores' fast path; the logits stay the vocabulary's).
"""

from __future__ import annotations

import contextlib
import math
from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..errors import GpuaccelError
from .cross_entropy_kernel import linear_cross_entropy
from .layers import Dropout, Linear, RMSNorm, attention, dropout_add
from .registry import register_model
from .rotary_kernel import rotary_qkv
from .rotary_kernel import usable as rotary_kernel_usable


def rotary_tables(length: int, head_dim: int, base: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Each position's rotation as two (length, head_dim) tables for :func:`rotate`: the cosines
    of its angles, repeated for both halves of a head, and their sines, negated for the first
    half (the rotation's sign)."""
    frequencies = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(length, dtype=torch.float32), frequencies)
    cos, sin = angles.cos(), angles.sin()
    return torch.cat([cos, cos], -1), torch.cat([-sin, sin], -1)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of (batch, heads, time, head_dim) at the positions of ``cos``/``sin``
    (:func:`rotary_tables`): each pair (x1, x2) of a head's two halves becomes (x1 cos - x2 sin,
    x2 cos + x1 sin). Two ways to write it, equal up to one rounding: eagerly as one fused
    multiply-add with the halves swapped (two kernels and a roll, where splitting and joining
    the halves take eight, and an eager step pays for each, on a CPU or on a GPU); compiled on
    a GPU, where torch.compile fuses either, with the halves (the rolled form's steps were
    slower there)."""
    return rotate_halves(x, cos, sin) if x.is_cuda and torch.compiler.is_compiling() else rotate_rolled(x, cos, sin)


def rotate_rolled(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    return torch.addcmul(xf * cos, xf.roll(x.shape[-1] // 2, -1), sin).type_as(x)


def rotate_halves(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    cos, sin = cos[..., :half], sin[..., half:]  # (the tables' halves repeat, with the sign of sin)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).type_as(x)


def linear(in_features: int, out_features: int) -> Linear:
    """A bias-free :class:`layers.Linear` whose weight :meth:`GPT._init_weights` draws: made on the meta
    device, where PyTorch's own initialisation draws nothing, then given an empty weight where
    tensors are made now (``to_empty`` would import sympy: half a second). Drawn and then
    overwritten, PyTorch's initialisation was 0.8 s of the 1.8 s that building GPT-2 small took on
    a 2-core CPU."""
    layer = Linear(in_features, out_features, bias=False, device="meta")
    layer.weight = nn.Parameter(torch.empty(out_features, in_features))
    return layer


class RotaryTables(nn.Module):
    """A module with rotary tables ``cos`` and ``sin`` that stay float32 when the module is
    cast to bf16 (``model.to(torch.bfloat16)``): bf16 angles would be off by up to 0.4%."""

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        self.cos, self.sin = self.cos.float(), self.sin.float()
        return self


class KVCache:
    """Keys and values of the positions seen so far, per layer, in tensors allocated once."""

    def __init__(self, layers: int, batch: int, heads: int, length: int, head_dim: int, device, dtype):
        shape = (layers, batch, heads, length, head_dim)
        self.keys = torch.zeros(shape, device=device, dtype=dtype)
        self.values = torch.zeros(shape, device=device, dtype=dtype)
        self.length, self.position = length, 0

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        end = self.position + k.shape[2]
        self.keys[layer, :, :, self.position:end] = k
        self.values[layer, :, :, self.position:end] = v
        return self.keys[layer, :, :, :end], self.values[layer, :, :, :end]


ATTENTION_KERNELS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
                     "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}


class Attention(RotaryTables):
    """Causal self-attention with rotary positions. Each layer holds its own rotary tables
    (12 layers x context 1024 x 64 dims: 3 MB), so a block takes only the residual stream and
    a pipeline stage boundary carries one activation. ``kernel``: one of ``ATTENTION_KERNELS``'
    SDPA backends, or None for PyTorch's choice."""

    def __init__(self, width: int, heads: int, dropout: float, context_length: int,
                 kernel: SDPBackend | None = None):
        super().__init__()
        self.heads, self.dropout, self.kernel = heads, dropout, kernel
        self.qkv = linear(width, 3 * width)
        self.proj = linear(width, width)
        cos, sin = rotary_tables(context_length, width // heads)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, x, cache: KVCache | None = None, layer: int = 0):
        b, t, c = x.shape
        start = cache.position if cache is not None else 0
        cos, sin = self.cos[start:start + t], self.sin[start:start + t]
        qkv = self.qkv(x).view(b, t, 3, self.heads, c // self.heads)
        # In training on a GPU, one kernel each way (rotary_kernel.py); evaluation, generation and export
        # rotate in PyTorch (the same rotation; compiled, its forward pass is also one kernel)
        if rotary_kernel_usable(qkv) and torch.is_grad_enabled():
            q, k, v = (z.transpose(1, 2) for z in rotary_qkv(qkv, cos, sin))
        else:
            q, k, v = qkv.permute(2, 0, 3, 1, 4)
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        causal = True
        if cache is not None:
            causal = cache.position == 0  # a prompt attends causally; a new token sees every cached one
            k, v = cache.append(layer, k, v)
        with contextlib.nullcontext() if self.kernel is None or cache is not None else sdpa_kernel(self.kernel):
            y = attention(q, k, v, self.dropout, self.training, causal=causal)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class MLP(nn.Module):
    """``drawn_later``: the weights are left for the model's own initialisation to draw (GPT's);
    otherwise PyTorch's (the sentence transformer's, models/text.py)."""

    def __init__(self, width: int, ratio: float, activation: str, drawn_later: bool = False):
        super().__init__()
        hidden = int(ratio * width)
        make = linear if drawn_later else partial(nn.Linear, bias=False)
        self.up = make(width, hidden)
        self.down = make(hidden, width)
        self.activation = activation

    def forward(self, x):
        h = self.up(x)
        h = F.relu(h).square() if self.activation == "relu2" else F.gelu(h)
        return self.down(h)


class Block(nn.Module):
    def __init__(self, width: int, heads: int, mlp_ratio: float, activation: str, dropout: float,
                 context_length: int, kernel: SDPBackend | None = None, norm_weights: bool = True):
        super().__init__()
        self.norm1 = RMSNorm(width, elementwise_affine=norm_weights)
        self.norm2 = RMSNorm(width, elementwise_affine=norm_weights)
        self.attention = Attention(width, heads, dropout, context_length, kernel)
        self.mlp = MLP(width, mlp_ratio, activation, drawn_later=True)
        self.dropout = Dropout(dropout)

    def forward(self, x, cache=None, layer=0):
        p, training = self.dropout.p, self.dropout.training
        x = dropout_add(self.attention(self.norm1(x), cache, layer), x, p, training)
        return dropout_add(self.mlp(self.norm2(x)), x, p, training)


class GPT(nn.Module):
    def __init__(self, vocab_size: int, context_length: int = 256, layers: int = 6, heads: int = 6,
                 width: int = 384, mlp_ratio: float = 4.0, activation: str = "gelu", dropout: float = 0.0,
                 attention: str = "auto", pad_vocab: int = 1, norm_weights: bool = True, head_fp8: bool = False,
                 residual_bf16: bool = False):
        super().__init__()
        if width % heads or (width // heads) % 2:
            raise GpuaccelError(f"gpt: width {width} must split into {heads} heads of an even size")
        if activation not in ("gelu", "relu2"):
            raise GpuaccelError(f"gpt: activation is gelu or relu2, not {activation!r}")
        if attention != "auto" and attention not in ATTENTION_KERNELS:
            raise GpuaccelError(f"gpt: attention is auto or one of {', '.join(ATTENTION_KERNELS)}, not {attention!r}")
        if isinstance(pad_vocab, bool) or not isinstance(pad_vocab, int) or pad_vocab < 1:
            raise GpuaccelError(f"gpt: pad_vocab must be a whole number >= 1, got {pad_vocab!r}")
        self.vocab_size, self.context_length, self.heads = vocab_size, context_length, heads
        self.residual_bf16 = residual_bf16
        # (FP8 products need NVIDIA's compute capability 8.9 or later; other GPUs keep the autocast dtype)
        self.head_fp8 = head_fp8 and not (torch.cuda.is_available() and (
            torch.version.hip or torch.cuda.get_device_capability() < (8, 9)))
        rows = -(-vocab_size // pad_vocab) * pad_vocab  # (rows past the vocabulary are never a target)
        self.embedding = nn.Embedding(rows, width)
        self.dropout = Dropout(dropout)
        kernel = ATTENTION_KERNELS.get(attention)
        self.blocks = nn.ModuleList(Block(width, heads, mlp_ratio, activation, dropout, context_length, kernel,
                                          norm_weights) for _ in range(layers))
        self.norm = RMSNorm(width, elementwise_affine=norm_weights)
        self.head = linear(width, rows)
        self.head.weight = self.embedding.weight  # tied: one matrix reads and writes tokens
        self._init_weights(layers)

    def _init_weights(self, layers: int) -> None:
        """GPT-2's: N(0, 0.02), with the projections into the residual stream scaled down by
        sqrt(2 x layers) so that the stream's variance does not grow with depth."""
        for name, p in self.named_parameters():
            if p.ndim == 2:
                std = 0.02 / math.sqrt(2 * layers) if name.endswith(("proj.weight", "down.weight")) else 0.02
                nn.init.normal_(p, 0.0, std)

    def forward(self, idx: torch.Tensor, cache: KVCache | None = None, labels: torch.Tensor | None = None):
        """The logits (batch, time, vocabulary); with ``labels`` (the next token at each
        position), ``{"loss": the mean cross-entropy}`` instead, computed with the output layer in
        one operator where Triton runs and the vocabulary is large (:mod:`cross_entropy_kernel`):
        the padded logits are never sliced, and their gradient is written by the pass that reads them
        (in FP8 with ``head_fp8``, and its products then take FP8 operands)."""
        t = idx.shape[1]
        start = cache.position if cache is not None else 0
        if start + t > self.context_length:
            raise GpuaccelError(f"gpt: {start + t} positions exceed the context length {self.context_length}")
        x = self.dropout(self.embedding(idx))
        if self.residual_bf16 and torch.is_autocast_enabled(x.device.type) \
                and torch.get_autocast_dtype(x.device.type) == torch.bfloat16:
            x = x.to(torch.bfloat16)  # (each block adds its bf16 output: the sums then stay bf16)
        for i, block in enumerate(self.blocks):
            x = block(x, cache, i)
        if cache is not None:
            cache.position += t
        if labels is not None:
            fp8 = self.head_fp8 and torch.is_grad_enabled()  # (in training: evaluations take exact logits)
            return {"loss": linear_cross_entropy(self.norm(x), self.head.weight, labels, self.vocab_size, fp8)}
        logits = self.head(self.norm(x))
        return logits if logits.shape[-1] == self.vocab_size else logits[..., :self.vocab_size]

    def new_cache(self, batch: int, device, dtype) -> KVCache:
        attention = self.blocks[0].attention
        width = self.embedding.embedding_dim
        return KVCache(len(self.blocks), batch, attention.heads, self.context_length, width // attention.heads,
                       device, dtype)

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, tokens: int, *, temperature: float = 1.0, top_k: int | None = None,
                 generator: torch.Generator | None = None, use_cache: bool = True) -> torch.Tensor:
        """``idx`` (batch, time) followed by ``tokens`` sampled tokens. ``temperature`` 0 takes
        the most likely token. Past the context length, the window slides (the cache is refilled
        from the last context's tokens), which is what recomputing on the cropped text gives."""
        device_type = idx.device.type
        dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) \
            else self.embedding.weight.dtype  # (keys and values as attention computes them)
        # Every token brings a new key length: cuDNN's attention builds a plan per shape, several
        # times slower than the shape-agnostic kernels used here
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
            return self._sample(idx, tokens, temperature, top_k, generator, use_cache, dtype)

    def _sample(self, idx, tokens, temperature, top_k, generator, use_cache, dtype):
        cache = None
        for _ in range(tokens):
            if not use_cache:
                logits = self(idx[:, -self.context_length:])
            elif cache is None or cache.position == self.context_length:
                cache = self.new_cache(idx.shape[0], idx.device, dtype)
                logits = self(idx[:, -self.context_length:], cache)
            else:
                logits = self(idx[:, -1:], cache)
            logits = logits[:, -1].float()
            if temperature == 0:
                next_id = logits.argmax(-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k is not None:
                    kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                next_id = torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)
            idx = torch.cat([idx, next_id], dim=1)
        return idx


@register_model("gpt", builds_on_device=True)
def gpt(vocab_size: int, context_length: int = 256, layers: int = 6, heads: int = 6, width: int = 384,
        mlp_ratio: float = 4.0, activation: str = "gelu", dropout: float = 0.0, attention: str = "auto",
        pad_vocab: int = 1, norm_weights: bool = True, head_fp8: bool = False, residual_bf16: bool = False) -> GPT:
    """Decoder-only transformer; the data gives ``vocab_size`` and ``context_length``, and
    ``--model-args layers=6,heads=6,width=384,dropout=0.2`` sets its size (``attention=cudnn``,
    ``pad_vocab=64``: see the module's notes; ``norm_weights=false``: RMSNorm without its scale,
    as modded-nanogpt's; ``head_fp8=true``: in training, the output layer's products in FP8 on
    GPUs that have them (:mod:`cross_entropy_kernel`), as modded-nanogpt's; ``residual_bf16=true``:
    under bf16 autocast, the residual stream (the embedding's output and each block's sum) in bf16, not
    float32, as modded-nanogpt's: each normalisation and addition then moves half the bytes; for GPT-2
    small on an H200 1.035x the tokens/s, at a validation loss up to 0.016 higher after 300 steps, so
    not the gpt2-small recipe's default: benchmarks/gpt2_speed/README.md)."""
    return GPT(vocab_size, context_length, layers, heads, width, mlp_ratio, activation, dropout, attention,
               pad_vocab, norm_weights, head_fp8, residual_bf16)
