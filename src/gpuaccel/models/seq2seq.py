"""``transformer_seq2seq``: an encoder-decoder transformer for translation, and its decoding.

Pre-norm blocks (LayerNorm before each sublayer, one more after the last), attention through
``F.scaled_dot_product_attention``, one embedding table shared by the source, the target and
the output layer (the vocabulary is joint), sinusoidal positions. ``forward(source,
target_in)`` returns logits (batch, time, vocabulary) under teacher forcing; the translation
task computes the loss. Token id 0 pads, 2 begins a target and 3 ends a sentence
(``data/parallel.py``).

Decoding (``beam_search``, greedy with a beam of 1) runs the encoder once and the decoder one
position at a time, with each layer's self-attention keys and values kept in buffers allocated
once and its cross-attention keys and values computed once per sentence, so a new token costs
one position's work. The search takes the model's pieces through a small interface
(``start``, ``step``, ``reorder``), so the same search runs over an exported encoder and
decoder step (deploy/translation.py).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from .registry import register_model

PAD, UNKNOWN, BOS, EOS = 0, 1, 2, 3


def sinusoid_table(length: int, width: int) -> torch.Tensor:
    """The transformer's fixed position encodings, (length, width)."""
    position = torch.arange(length, dtype=torch.float32)[:, None]
    frequency = torch.exp(torch.arange(0, width, 2, dtype=torch.float32) * (-math.log(10000.0) / width))
    table = torch.zeros(length, width)
    table[:, 0::2] = torch.sin(position * frequency)
    table[:, 1::2] = torch.cos(position * frequency[:width // 2])
    return table


class Attention(nn.Module):
    """Multi-head attention; ``kv_from`` (cross-attention) takes keys and values from the
    encoder's output instead of ``x``."""

    def __init__(self, width: int, heads: int, dropout: float, cross: bool = False):
        super().__init__()
        self.heads, self.dropout, self.cross = heads, dropout, cross
        if cross:
            self.q = nn.Linear(width, width)
            self.kv = nn.Linear(width, 2 * width)
        else:
            self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        return x.view(b, t, self.heads, c // self.heads).transpose(1, 2)

    def keys_values(self, memory: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Cross-attention's keys and values of the encoder's output, (batch, heads, source, head_dim)."""
        k, v = self.kv(memory).chunk(2, dim=-1)
        return self._heads(k), self._heads(v)

    def forward(self, x, mask=None, causal: bool = False, kv=None, cache=None, position: int = 0):
        """``mask``: (batch, 1, 1, keys) True where a key may be attended to. ``kv``: cross-attention's
        precomputed keys and values. ``cache``: self-attention's (keys, values) buffers (batch,
        heads, max length, head_dim) for decoding: this call's key and value are written at
        ``position`` and the positions up to it are attended to."""
        b, t, c = x.shape
        if self.cross:
            q = self._heads(self.q(x))
            k, v = kv
        else:
            q, k, v = (self._heads(part) for part in self.qkv(x).chunk(3, dim=-1))
            if cache is not None:
                keys, values = cache
                keys[:, :, position:position + t] = k
                values[:, :, position:position + t] = v
                k, v = keys[:, :, :position + t], values[:, :, :position + t]
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and mask is None,
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class FeedForward(nn.Sequential):
    def __init__(self, width: int, hidden: int, dropout: float):
        super().__init__(nn.Linear(width, hidden), nn.ReLU(), nn.Dropout(dropout), nn.Linear(hidden, width))


class EncoderLayer(nn.Module):
    def __init__(self, width: int, heads: int, hidden: int, dropout: float):
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(width), Attention(width, heads, dropout)
        self.norm2, self.ffn = nn.LayerNorm(width), FeedForward(width, hidden, dropout)
        self.drop = nn.Dropout(dropout)

    def forward(self, x, mask):
        x = x + self.drop(self.attn(self.norm1(x), mask=mask))
        return x + self.drop(self.ffn(self.norm2(x)))


class DecoderLayer(nn.Module):
    def __init__(self, width: int, heads: int, hidden: int, dropout: float):
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(width), Attention(width, heads, dropout)
        self.norm2, self.cross = nn.LayerNorm(width), Attention(width, heads, dropout, cross=True)
        self.norm3, self.ffn = nn.LayerNorm(width), FeedForward(width, hidden, dropout)
        self.drop = nn.Dropout(dropout)

    def forward(self, x, memory_kv, memory_mask, cache=None, position: int = 0):
        """Teacher forcing (``cache`` None: causal over the whole target), or one position of
        decoding (``cache``: this layer's key and value buffers)."""
        if cache is None:
            x = x + self.drop(self.attn(self.norm1(x), causal=True))
        else:
            x = x + self.drop(self.attn(self.norm1(x), cache=cache, position=position))
        x = x + self.drop(self.cross(self.norm2(x), mask=memory_mask, kv=memory_kv))
        return x + self.drop(self.ffn(self.norm3(x)))


class Seq2SeqTransformer(nn.Module):
    def __init__(self, vocab_size: int, context_length: int = 256, layers: int = 3, decoder_layers: int | None = None,
                 heads: int = 8, width: int = 512, hidden: int | None = None, dropout: float = 0.1):
        super().__init__()
        if width % heads:
            raise ValueError(f"width {width} is not a multiple of heads {heads}")
        hidden = hidden or 4 * width
        self.width, self.context_length, self.vocab_size = width, context_length, vocab_size
        self.embed = nn.Embedding(vocab_size, width, padding_idx=PAD)
        nn.init.normal_(self.embed.weight, std=width ** -0.5)
        with torch.no_grad():
            self.embed.weight[PAD].zero_()
        self.register_buffer("positions", sinusoid_table(context_length + 1, width), persistent=False)
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.ModuleList(EncoderLayer(width, heads, hidden, dropout) for _ in range(layers))
        self.decoder = nn.ModuleList(DecoderLayer(width, heads, hidden, dropout)
                                     for _ in range(decoder_layers or layers))
        self.encoder_norm, self.decoder_norm = nn.LayerNorm(width), nn.LayerNorm(width)

    def _embed(self, ids: torch.Tensor, start: int = 0) -> torch.Tensor:
        positions = self.positions[start:start + ids.shape[1]]
        return self.drop(self.embed(ids) * math.sqrt(self.width) + positions.to(self.embed.weight.dtype))

    def encode(self, source: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the encoder's output (batch, source, width), the mask of real source tokens (batch, 1, 1, source))."""
        mask = (source != PAD)[:, None, None, :]
        x = self._embed(source)
        for layer in self.encoder:
            x = layer(x, mask)
        return self.encoder_norm(x), mask

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self.decoder_norm(x), self.embed.weight)

    def forward(self, source: torch.Tensor, target_in: torch.Tensor) -> torch.Tensor:
        memory, mask = self.encode(source)
        x = self._embed(target_in)
        for layer in self.decoder:
            x = layer(x, layer.cross.keys_values(memory), mask)
        return self.logits(x)

    # ------------------------------------------------------------------ decoding

    def cross_keys_values(self, memory: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [layer.cross.keys_values(memory) for layer in self.decoder]

    def new_cache(self, rows: int, length: int, device, dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each decoder layer's self-attention key and value buffers for ``length`` positions,
        allocated once (a buffer that grew step by step would be reallocated at every step)."""
        heads = self.decoder[0].attn.heads
        shape = (rows, heads, length, self.width // heads)
        return [(torch.empty(shape, device=device, dtype=dtype), torch.empty(shape, device=device, dtype=dtype))
                for _ in self.decoder]

    def step(self, tokens: torch.Tensor, position: int, cross_kv, mask, cache) -> torch.Tensor:
        """One decoding position: ``tokens`` (rows,) at ``position``, their keys and values written
        into ``cache``; returns the log-probabilities of the next token (rows, vocabulary)."""
        x = self._embed(tokens[:, None], position)
        for layer, kv, buffers in zip(self.decoder, cross_kv, cache):
            x = layer(x, kv, mask, cache=buffers, position=position)
        return F.log_softmax(self.logits(x)[:, -1].float(), dim=-1)

    @torch.no_grad()
    def translate(self, source: torch.Tensor, beam: int = 5, length_penalty: float = 1.0,
                  max_length: int | None = None) -> torch.Tensor:
        """Token ids of each source sentence's translation (batch, length), padded with 0 after its
        end; ``beam`` 1 decodes greedily."""
        return beam_search(PyTorchDecoder(self), source, beam=beam, length_penalty=length_penalty,
                           max_length=max_length or self.max_length(source.shape[1]))

    def max_length(self, source_length: int) -> int:
        """The most target tokens decoded for a source of ``source_length`` tokens (padded)."""
        return min(self.context_length, int(1.5 * source_length) + 10)


class PyTorchDecoder:
    """The model's pieces as a search uses them: ``start(source, repeat, length)`` runs the encoder
    (each sentence's result repeated for its beams) and makes the decoding state;
    ``step(tokens, position)`` gives the next log-probabilities; ``reorder(rows)`` keeps the
    state of the given rows (the beams that survive), in that order."""

    def __init__(self, model: Seq2SeqTransformer):
        self.model = model

    def start(self, source: torch.Tensor, repeat: int, length: int) -> None:
        memory, mask = self.model.encode(source)
        memory, self.mask = memory.repeat_interleave(repeat, 0), mask.repeat_interleave(repeat, 0)
        self.cross_kv = self.model.cross_keys_values(memory)
        self.cache = self.model.new_cache(memory.shape[0], length, memory.device, memory.dtype)
        self.filled = 0

    def step(self, tokens: torch.Tensor, position: int) -> torch.Tensor:
        self.filled = position + 1
        return self.model.step(tokens, position, self.cross_kv, self.mask, self.cache)

    def reorder(self, rows: torch.Tensor) -> None:
        for keys, values in self.cache:  # (only the positions written so far)
            keys[:, :, :self.filled] = keys[rows, :, :self.filled]
            values[:, :, :self.filled] = values[rows, :, :self.filled]


def beam_search(decoder, source: torch.Tensor, *, beam: int = 5, length_penalty: float = 1.0,
                max_length: int = 128) -> torch.Tensor:
    """Batched beam search (``beam`` 1: greedy) over ``decoder`` (:class:`PyTorchDecoder`, or an
    exported model's). Hypotheses are ranked by their log-probability divided by length **
    ``length_penalty`` (the length counting the end token), both while searching and at the end;
    a finished hypothesis keeps its score and extends only with padding. Returns (batch, length)
    token ids without the begin token, each ended by EOS (unless cut at ``max_length``) and
    padded with 0."""
    batch, device = source.shape[0], source.device
    rows = batch * beam
    decoder.start(source, beam, max_length)
    tokens = torch.full((rows,), BOS, dtype=torch.long, device=device)
    out = torch.zeros(rows, max_length, dtype=torch.long, device=device)
    scores = torch.zeros(batch, beam, device=device)
    scores[:, 1:] = float("-inf")  # all beams start as one hypothesis
    finished = torch.zeros(rows, dtype=torch.bool, device=device)
    lengths = torch.zeros(rows, device=device)
    offsets = (torch.arange(batch, device=device) * beam)[:, None]
    steps = max_length
    for position in range(max_length):
        logp = decoder.step(tokens, position)
        vocab = logp.shape[-1]
        # a finished hypothesis extends only with padding, at no cost; nothing else emits padding or a start
        logp.masked_fill_(finished[:, None], float("-inf"))
        logp[:, PAD] = torch.where(finished, 0.0, float("-inf"))
        logp[:, BOS] = float("-inf")
        lengths = lengths + (~finished).float()
        total = logp.add_(scores.view(rows, 1))
        if beam == 1:
            tokens = total.argmax(-1)
            scores = total.gather(1, tokens[:, None]).view(batch, 1)
        else:
            norm = lengths.clamp(min=1) ** length_penalty
            _, flat = (total / norm[:, None]).view(batch, beam * vocab).topk(beam, dim=-1)
            scores = total.view(batch, beam * vocab).gather(1, flat)
            survivors = (flat // vocab + offsets).view(-1)
            tokens = (flat % vocab).view(-1)
            out[:, :position] = out[survivors, :position]
            finished, lengths = finished[survivors], lengths[survivors]
            decoder.reorder(survivors)
        out[:, position] = tokens
        finished = finished | (tokens == EOS)
        if position % 4 == 3 and bool(finished.all()):
            steps = position + 1
            break
    final = scores / lengths.view(batch, beam).clamp(min=1) ** length_penalty
    best = final.argmax(-1)
    return out.view(batch, beam, -1)[torch.arange(batch, device=device), best, :steps]


def strip_special(ids) -> list[int]:
    """A decoded sentence's ids up to (not including) its end token, without padding."""
    out = []
    for i in ids:
        i = int(i)
        if i == EOS:
            break
        if i not in (PAD, BOS):
            out.append(i)
    return out


@register_model("transformer_seq2seq")
def transformer_seq2seq(vocab_size: int, context_length: int = 256, layers: int = 3,
                        decoder_layers: int | None = None, heads: int = 8, width: int = 512,
                        hidden: int | None = None, dropout: float = 0.1) -> Seq2SeqTransformer:
    """Encoder-decoder transformer for translation (``layers`` encoder layers, ``decoder_layers``
    decoder layers, default as many; ``hidden``: the feed-forward width, default 4 x width)."""
    return Seq2SeqTransformer(vocab_size, context_length, layers, decoder_layers, heads, width, hidden, dropout)
