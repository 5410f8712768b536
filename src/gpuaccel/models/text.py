"""Sentence classifiers over token ids (0 = padding), trained from scratch.

``bag_of_ngrams``: fastText's design. Each word and each pair of neighbouring words (hashed
into ``buckets`` rows) has an embedding; the sentence is their mean; a linear layer
classifies it. Word order is seen only through the pairs; it trains in seconds.

``text_transformer``: a small bidirectional transformer encoder (the GPT's blocks without
the causal mask, padding masked out), pooled over the words (mean, max, or both side by side),
then a linear layer. ``word_dropout`` hides a random share of each training sentence's words
from attention and pooling, as if they were padding.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..errors import GpuaccelError
from .gpt import MLP, RotaryTables, rotary_tables, rotate
from .layers import Dropout, RMSNorm, attention, dropout_add
from .registry import register_model

_PAIR_PRIME = 1_000_003


POOLINGS = ("mean", "max", "mean_max")


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over dimension 1 of the positions where ``mask`` (batch, time) is true."""
    weights = mask.to(x.dtype).unsqueeze(-1)
    return (x * weights).sum(1) / weights.sum(1).clamp_min(1)


def masked_pool(x: torch.Tensor, mask: torch.Tensor, pooling: str) -> torch.Tensor:
    """``pooling`` over dimension 1 of the positions where ``mask`` is true: their mean, their
    maximum, or both concatenated (twice the width)."""
    if pooling == "mean":
        return masked_mean(x, mask)
    peak = x.masked_fill(~mask.unsqueeze(-1), float("-inf")).amax(1)
    return peak if pooling == "max" else torch.cat([masked_mean(x, mask), peak], -1)


class BagOfNgrams(nn.Module):
    def __init__(self, vocab_size: int, num_classes: int, width: int = 64, buckets: int = 2 ** 18,
                 dropout: float = 0.0):
        super().__init__()
        self.words = nn.Embedding(vocab_size, width, padding_idx=0)
        self.pairs = nn.Embedding(buckets, width) if buckets else None
        self.buckets = buckets
        self.dropout = nn.Dropout(dropout)
        self.classifier = nn.Linear(width, num_classes)
        nn.init.normal_(self.words.weight, 0, 0.1)
        if self.pairs is not None:
            nn.init.normal_(self.pairs.weight, 0, 0.1)
        with torch.no_grad():
            self.words.weight[0].zero_()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        mask = ids != 0
        features = self.words(ids)
        if self.pairs is not None and ids.shape[1] > 1:
            pair_ids = (ids[:, :-1] * _PAIR_PRIME + ids[:, 1:]) % self.buckets
            pair_mask = mask[:, 1:]
            pooled = (features * mask.unsqueeze(-1)).sum(1) + (self.pairs(pair_ids) * pair_mask.unsqueeze(-1)).sum(1)
            pooled = pooled / (mask.sum(1) + pair_mask.sum(1)).clamp_min(1).unsqueeze(-1)
        else:
            pooled = masked_mean(features, mask)
        return self.classifier(self.dropout(pooled))


class EncoderBlock(nn.Module):
    def __init__(self, width: int, heads: int, dropout: float):
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.norm1, self.norm2 = RMSNorm(width), RMSNorm(width)
        self.qkv = nn.Linear(width, 3 * width, bias=False)
        self.proj = nn.Linear(width, width, bias=False)
        self.mlp = MLP(width, 4.0, "gelu")

    def forward(self, x, cos, sin, attend):
        b, t, c = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        y = attention(q, k, v, self.dropout, self.training, attend=attend)
        x = dropout_add(self.proj(y.transpose(1, 2).reshape(b, t, c)), x, self.dropout, self.training)
        return dropout_add(self.mlp(self.norm2(x)), x, self.dropout, self.training)


class TextTransformer(RotaryTables):
    def __init__(self, vocab_size: int, num_classes: int, context_length: int = 256, layers: int = 2,
                 heads: int = 4, width: int = 128, dropout: float = 0.1, word_dropout: float = 0.0,
                 pooling: str = "mean"):
        super().__init__()
        if width % heads or (width // heads) % 2:
            raise GpuaccelError(f"text_transformer: width {width} must split into {heads} heads of an even size")
        if pooling not in POOLINGS:
            raise GpuaccelError(f"text_transformer: pooling {pooling!r} is not one of {', '.join(POOLINGS)}")
        self.word_dropout, self.pooling = word_dropout, pooling
        self.embedding = nn.Embedding(vocab_size, width, padding_idx=0)
        self.blocks = nn.ModuleList(EncoderBlock(width, heads, dropout) for _ in range(layers))
        self.norm = RMSNorm(width)
        self.dropout = Dropout(dropout)
        self.classifier = nn.Linear(2 * width if pooling == "mean_max" else width, num_classes)
        cos, sin = rotary_tables(context_length, width // heads)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        nn.init.normal_(self.embedding.weight, 0, 0.02)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        t = ids.shape[1]
        mask = ids != 0
        if self.training and self.word_dropout > 0:
            kept = mask & (torch.rand(mask.shape, device=ids.device) >= self.word_dropout)
            # a sentence that lost every word keeps them all: attention needs one position to attend to
            mask = torch.where(kept.any(1, keepdim=True), kept, mask)
        attend = mask[:, None, None, :]  # every position attends to the words, not the padding
        x = self.embedding(ids)
        for block in self.blocks:
            x = block(x, self.cos[:t], self.sin[:t], attend)
        return self.classifier(self.dropout(masked_pool(self.norm(x), mask, self.pooling)))


class TextCNN(nn.Module):
    """Kim (2014): convolutions of several widths over the word embeddings, each filter's
    maximum over the sentence (padding excluded), dropout, a linear layer."""

    def __init__(self, vocab_size: int, num_classes: int, width: int = 128, filters: int = 100,
                 kernel_sizes: tuple[int, ...] = (3, 4, 5), dropout: float = 0.5):
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, width, padding_idx=0)
        self.convs = nn.ModuleList(nn.Conv1d(width, filters, k, padding=k // 2) for k in kernel_sizes)
        self.dropout = nn.Dropout(dropout)
        self.classifier = nn.Linear(filters * len(kernel_sizes), num_classes)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        pad = (ids == 0).unsqueeze(1)
        x = self.embedding(ids).transpose(1, 2)  # (batch, width, time)
        pooled = []
        for conv in self.convs:
            h = F.relu(conv(x))[..., :ids.shape[1]]
            pooled.append(h.masked_fill(pad, float("-inf")).amax(-1).clamp_min(0))
        return self.classifier(self.dropout(torch.cat(pooled, 1)))


@register_model("bag_of_ngrams")
def bag_of_ngrams(vocab_size: int, num_classes: int, width: int = 64, buckets: int = 2 ** 18,
                  dropout: float = 0.0) -> BagOfNgrams:
    """fastText-style sentence classifier: mean of word and hashed word-pair embeddings."""
    return BagOfNgrams(vocab_size, num_classes, width, buckets, dropout)


@register_model("text_transformer")
def text_transformer(vocab_size: int, num_classes: int, context_length: int = 256, layers: int = 2,
                     heads: int = 4, width: int = 128, dropout: float = 0.1, word_dropout: float = 0.0,
                     pooling: str = "mean") -> TextTransformer:
    """A small transformer encoder for sentence classification."""
    return TextTransformer(vocab_size, num_classes, context_length, layers, heads, width, dropout, word_dropout,
                           pooling)


@register_model("text_cnn")
def text_cnn(vocab_size: int, num_classes: int, width: int = 128, filters: int = 100,
             kernel_sizes: tuple[int, ...] = (3, 4, 5), dropout: float = 0.5) -> TextCNN:
    """Convolutions of widths 3, 4 and 5 over word embeddings, max-pooled (Kim, 2014)."""
    return TextCNN(vocab_size, num_classes, width, filters, tuple(kernel_sizes), dropout)
