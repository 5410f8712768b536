"""Text for language modelling: a corpus (a .txt file or a folder of them) read once,
tokenised, cached on disk as token ids, and served as windows cut on the device.

Tokenisers: ``char`` (each distinct character of the corpus is a token, as nanoGPT's
shakespeare_char does), ``byte`` (UTF-8 bytes, 256 tokens, nothing unknown), ``bpe`` (a
byte-level BPE vocabulary trained on the training split with HuggingFace ``tokenizers``) and
``word`` (lower-cased words of the training split, for classifying sentences).
The validation split is the corpus's last ``val_split`` share (10% by default), so it is
text the model never saw, not windows interleaved with the training text.

A training batch is ``batch_size`` windows of ``context + 1`` tokens starting at random
offsets, drawn per epoch from a seeded generator (so a resumed run continues the same
draw); the ids live on the device and a batch is one gather there. An epoch is as many
windows as the training text holds end to end. Evaluation reads the validation text as
consecutive non-overlapping windows, every one of them, in order.
"""

from __future__ import annotations

import hashlib
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..errors import GpuaccelError, choice_error
from . import cache
from .loader import EpochPlan, ShardedOrder, indices_on

TOKENIZERS = ("char", "byte", "bpe", "word", "unigram")
PAD, UNKNOWN = 0, 1  # word ids: padding, a word not in the vocabulary
_WORDS = re.compile(r"\w+|[^\w\s]")
TEXT_SUFFIXES = (".txt", ".text", ".md")
_EPOCH_SALT = 1_000_003


# ---------------------------------------------------------------------------------- tokenisers

class Tokenizer:
    """Text <-> token ids. ``state()`` is what a checkpoint records to rebuild it."""

    kind = ""
    vocab_size = 0

    def encode(self, text: str) -> np.ndarray:
        raise NotImplementedError

    def decode(self, ids) -> str:
        raise NotImplementedError

    def state(self) -> dict:
        raise NotImplementedError


class CharTokenizer(Tokenizer):
    kind = "char"

    def __init__(self, chars: str):
        self.chars = "".join(sorted(set(chars)))
        self.vocab_size = len(self.chars)
        self._codes = np.frombuffer(self.chars.encode("utf-32-le"), dtype=np.uint32)

    def encode(self, text: str) -> np.ndarray:
        codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
        ids = np.searchsorted(self._codes, codes)
        known = ids < self.vocab_size
        known[known] = self._codes[ids[known]] == codes[known]
        if not known.all():
            unknown = "".join(sorted({chr(c) for c in codes[~known]}))
            raise GpuaccelError(f"the text holds characters the vocabulary lacks: {unknown[:20]!r}; a char model "
                                f"knows only the {self.vocab_size} characters of its training text")
        return ids.astype(np.int32)

    def decode(self, ids) -> str:
        return "".join(self.chars[int(i)] for i in ids)

    def state(self) -> dict:
        return {"kind": self.kind, "chars": self.chars}


class ByteTokenizer(Tokenizer):
    kind = "byte"
    vocab_size = 256

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

    def state(self) -> dict:
        return {"kind": self.kind}


class HuggingFaceTokenizer(Tokenizer):
    """A vocabulary learned with HuggingFace ``tokenizers`` (``train``), saved as its JSON."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.vocab_size = tokenizer.get_vocab_size()

    def decode(self, ids) -> str:
        return self.tokenizer.decode([int(i) for i in ids])

    def state(self) -> dict:
        return {"kind": self.kind, "json": self.tokenizer.to_str()}


# Where byte-level BPE's pre-tokenizer (GPT-2's pattern) always ends a word: at a newline between a
# line's last non-space character and the next line's first. (Not inside a run of whitespace: the
# pattern keeps a newline with the blank lines or the indentation after it, as in "\n    def".)
_PIECE_BOUNDARY = re.compile(r"(?<=\S\n)(?=\S)")


def byte_level_pieces(text: str) -> list[str]:
    """``text`` cut where byte-level BPE cuts it anyway: the pieces encode, and count for training,
    exactly as the whole text does, and ``tokenizers`` spreads a list of them over its threads
    (one string is one sequential job). On a 2-core CPU, 23 MB of Python sources: a 50,257-token
    vocabulary learned in 8.7-10.5 s instead of 16.2-18.1
    (benchmarks/gpt2_speed/results/bpe_reading_code_cpu.json). A ``--tokenizer-file`` with another
    pre-tokenizer (not byte-level) is cut at the same places: there a piece's ids may differ
    from the whole text's where a merge would span a line's end."""
    return _PIECE_BOUNDARY.split(text)


class BpeTokenizer(HuggingFaceTokenizer):
    """HuggingFace ``tokenizers``' byte-level BPE: no unknown tokens, a vocabulary learned from
    the training text."""

    kind = "bpe"

    @classmethod
    def train(cls, texts: list[str], vocab_size: int) -> "BpeTokenizer":
        tokenizers = _require_tokenizers()
        model = tokenizers.Tokenizer(tokenizers.models.BPE())
        model.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
        model.decoder = tokenizers.decoders.ByteLevel()
        trainer = tokenizers.trainers.BpeTrainer(
            vocab_size=vocab_size, show_progress=False,
            initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
        model.train_from_iterator([piece for text in texts for piece in byte_level_pieces(text)], trainer=trainer)
        return cls(model)

    def encode(self, text: str) -> np.ndarray:
        encoded = self.tokenizer.encode_batch(byte_level_pieces(text))
        return np.concatenate([np.asarray(e.ids, dtype=np.int32) for e in encoded])


class UnigramTokenizer(HuggingFaceTokenizer):
    """HuggingFace ``tokenizers``' unigram language model over words marked by a leading "▁"
    (sentencepiece's scheme): a joint subword vocabulary learned from the training split, with
    NFKC normalisation, that decodes back to the text as written. Ids 0-3 are padding,
    unknown, begin and end (a sentence's ``<s>`` and ``</s>``)."""

    kind = "unigram"
    SPECIALS = ("<pad>", "<unk>", "<s>", "</s>")

    @classmethod
    def train(cls, texts: list[str], vocab_size: int) -> "UnigramTokenizer":
        tokenizers = _require_tokenizers()
        model = tokenizers.Tokenizer(tokenizers.models.Unigram())
        model.normalizer = tokenizers.normalizers.NFKC()
        model.pre_tokenizer = tokenizers.pre_tokenizers.Metaspace()
        model.decoder = tokenizers.decoders.Metaspace()
        trainer = tokenizers.trainers.UnigramTrainer(vocab_size=vocab_size, special_tokens=list(cls.SPECIALS),
                                                     unk_token="<unk>", show_progress=False)
        model.train_from_iterator(texts, trainer=trainer)
        return cls(model)

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self.tokenizer.encode(text, add_special_tokens=False).ids, dtype=np.int32)

    def encode_lines(self, lines: list[str]) -> list[list[int]]:
        """Each line's ids (encoded in parallel)."""
        return [e.ids for e in self.tokenizer.encode_batch(lines, add_special_tokens=False)]


class WordTokenizer(Tokenizer):
    """Lower-cased words and punctuation marks; id 0 pads, 1 is any word not in the vocabulary."""

    kind = "word"

    def __init__(self, words: list[str]):
        self.words = list(words)
        self.index = {w: i + 2 for i, w in enumerate(self.words)}
        self.vocab_size = len(self.words) + 2

    @classmethod
    def train(cls, texts: list[str], vocab_size: int | None, min_count: int = 2) -> "WordTokenizer":
        counts = Counter(w for t in texts for w in _WORDS.findall(t.lower()))
        words = [w for w, c in counts.most_common() if c >= min_count]
        return cls(words[:vocab_size - 2] if vocab_size else words)

    def encode(self, text: str) -> np.ndarray:
        return np.array([self.index.get(w, UNKNOWN) for w in _WORDS.findall(text.lower())], dtype=np.int32)

    def decode(self, ids) -> str:
        return " ".join("<unk>" if i == UNKNOWN else self.words[i - 2] for i in map(int, ids) if i != PAD)

    def state(self) -> dict:
        return {"kind": self.kind, "words": self.words}


def _require_tokenizers():
    try:
        import tokenizers
    except ImportError:
        raise GpuaccelError("--tokenizer bpe and unigram (translation) need HuggingFace tokenizers: pip install "
                            "tokenizers (or gpuaccel[text])") from None
    return tokenizers


def tokenizer_from_state(state: dict) -> Tokenizer:
    """The tokeniser a checkpoint recorded."""
    kind = state.get("kind")
    if kind == "char":
        return CharTokenizer(state["chars"])
    if kind == "byte":
        return ByteTokenizer()
    if kind == "word":
        return WordTokenizer(state["words"])
    if kind == "bpe":
        return BpeTokenizer(_require_tokenizers().Tokenizer.from_str(state["json"]))
    if kind == "unigram":
        return UnigramTokenizer(_require_tokenizers().Tokenizer.from_str(state["json"]))
    raise GpuaccelError(f"unknown tokenizer {kind!r} in the checkpoint")


def read_tokenizer_file(path: Path, tokenizer: str) -> BpeTokenizer:
    """A HuggingFace ``tokenizer.json`` (GPT-2's, or one saved by ``tokenizers``), for ``--tokenizer bpe``."""
    if tokenizer != "bpe":
        raise GpuaccelError(f"--tokenizer-file is a BPE vocabulary: it goes with --tokenizer bpe, not {tokenizer}")
    if not Path(path).is_file():
        raise GpuaccelError(f"--tokenizer-file {path}: no such file")
    tokenizers = _require_tokenizers()
    try:
        return BpeTokenizer(tokenizers.Tokenizer.from_file(str(path)))
    except Exception as exc:  # (tokenizers raises its own Exception for a file it cannot parse)
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise GpuaccelError(f"--tokenizer-file {path} is not a HuggingFace tokenizer.json: {first}") from None


# ---------------------------------------------------------------------------------- reading

def text_files(path: Path) -> list[Path]:
    """The corpus's files: ``path`` itself, or the text files under a folder, in name order."""
    if path.is_file():
        return [path]
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES)
    if not files:
        raise GpuaccelError(f"{path} holds no text files ({', '.join(TEXT_SUFFIXES)})")
    return files


def read_text(path: Path) -> str:
    """A file's text, which must be UTF-8; a byte order mark is dropped."""
    return decode_utf8(path.read_bytes(), path)


def decode_utf8(data: bytes, path: Path) -> str:
    """``data`` (read from ``path``) as text; bytes that are not UTF-8 are an error naming the
    file and the line."""
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise not_utf8(path, data[:exc.start].count(b"\n") + 1, data[exc.start]) from None


def not_utf8(path: Path, line: int, byte: int) -> GpuaccelError:
    """The error for a file whose ``line`` holds ``byte``, which is not UTF-8."""
    return GpuaccelError(f"{path}: line {line} is not UTF-8 text (byte 0x{byte:02x}); convert the "
                         f"file to UTF-8 (e.g. iconv -f latin1 -t utf-8)")


@dataclass
class TextCorpus:
    """A tokenised corpus: ``train`` and ``val`` token ids (int32) and the tokeniser."""

    name: str
    train: np.ndarray
    val: np.ndarray
    tokenizer: Tokenizer
    source: str
    files: int = 1
    fingerprint: str = ""
    characters: int = 0

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    def describe(self) -> str:
        return (f"{self.name}: {self.characters:,} characters in {self.files} file(s), {self.tokenizer.kind} "
                f"tokens (vocabulary {self.vocab_size:,}): {len(self.train):,} train / {len(self.val):,} validation")

    def check_context(self, context: int) -> None:
        """Both splits must hold one window (``context`` tokens and the one after)."""
        for split, ids in (("training", self.train), ("validation", self.val)):
            if len(ids) < context + 1:
                raise GpuaccelError(f"{self.name}: the {split} split has {len(ids)} tokens, fewer than one window of "
                                    f"--context {context} needs ({context + 1}); use a smaller --context or more text")


def load_corpus(path: Path, *, tokenizer: str = "char", vocab_size: int = 2048, val_split: float | None = None,
                cache_dir: Path | None = None, tokenizer_file: Path | None = None) -> TextCorpus:
    """Reads and tokenises a corpus (from the cache when its files have not changed).
    ``tokenizer_file``: a HuggingFace ``tokenizer.json`` (with ``tokenizer`` bpe) used as it
    is, instead of a vocabulary learned from the training split."""
    if tokenizer not in ("char", "byte", "bpe"):
        raise choice_error("tokenizer for language modelling", tokenizer, ("char", "byte", "bpe"))
    val_split = 0.1 if val_split is None else val_split
    if not 0 < val_split < 1:
        raise GpuaccelError(f"--val-split must be in (0, 1) for text, got {val_split}")
    given = read_tokenizer_file(tokenizer_file, tokenizer) if tokenizer_file is not None else None
    files = text_files(path)
    options = {"tokenizer": tokenizer, "val_split": val_split,
               **({"vocab_size": vocab_size} if tokenizer == "bpe" and given is None else {}),
               **({"tokenizer_json": hashlib.sha256(given.tokenizer.to_str().encode()).hexdigest()} if given else {})}
    key, digest = cache.file_identity("text", path, files, options)
    name = path.stem if path.is_file() else path.name
    cached = cache.load(cache_dir, key)
    if cached is not None:
        meta = cached["meta"]
        return TextCorpus(name, cached["train"], cached["val"], tokenizer_from_state(meta["tokenizer"]), str(path),
                          len(files), digest, meta["characters"])
    texts = []
    for f in files:
        text = read_text(f)
        if not text.strip():
            raise GpuaccelError(f"{f} is empty" + (" (or only whitespace)" if text else ""))
        texts.append(text)
    text = "".join(texts)
    cut = int(len(text) * (1 - val_split))
    train_text, val_text = text[:cut], text[cut:]
    if given is not None:
        tok: Tokenizer = given
    elif tokenizer == "char":
        tok = CharTokenizer(text)  # every character of the corpus, as nanoGPT's char level does
    elif tokenizer == "byte":
        tok = ByteTokenizer()
    else:
        if vocab_size < 257:
            raise GpuaccelError(f"--vocab-size for bpe must exceed the 256 byte tokens, got {vocab_size}")
        tok = BpeTokenizer.train([train_text], vocab_size)
    corpus = TextCorpus(name, tok.encode(train_text), tok.encode(val_text), tok, str(path), len(files), digest,
                        len(text))
    cache.save(cache_dir, key, {"tokenizer": tok.state(), "characters": len(text)}, train=corpus.train,
               val=corpus.val)
    return corpus


# ---------------------------------------------------------------------------------- batches

class RandomWindows(ShardedOrder):
    """Training windows' order for a resident loader over :func:`token_windows`: each step
    ``batch_size`` windows at random offsets of the text (drawn with replacement, from a
    generator seeded by the seed, the epoch and the rank), as many per epoch as the text holds
    end to end."""

    def __init__(self, num_tokens: int, *, context: int, batch_size: int, seed: int = 0, rank: int = 0,
                 world_size: int = 1):
        super().__init__((num_tokens - 1) // context, batch_size=batch_size, train=True, seed=seed, rank=rank,
                         world_size=world_size, drop_last=True)
        self.window_starts = num_tokens - context  # (the offsets a window of context + 1 tokens may start at)
        self.steps = max(1, self.num_images // (batch_size * world_size))

    def __len__(self) -> int:
        return self.steps

    def epoch_plan(self, epoch: int, device: torch.device) -> EpochPlan:
        generator = torch.Generator().manual_seed((self.seed * _EPOCH_SALT + epoch) * 1009 + self.rank)
        starts = torch.randint(self.window_starts, (self.steps * self.batch_size,), generator=generator)
        return EpochPlan(indices_on(starts, device), [self.batch_size] * self.steps)


def token_windows(tokens: torch.Tensor, context: int, device: torch.device) -> tuple[torch.Tensor]:
    """Every window of ``context + 1`` tokens of the text, one per start, as rows of one view of
    the token ids on ``device`` (int32): a batch of windows is one gather of its rows."""
    return (tokens.to(device=device, dtype=torch.int32).unfold(0, context + 1, 1),)


def shifted_windows(batch: tuple[torch.Tensor], seed=None) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of windows as ``(inputs, targets)``: each window and the window shifted by one token."""
    windows = batch[0].long()
    return windows[:, :-1], windows[:, 1:]


def validation_windows(tokens: np.ndarray, context: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The validation text as consecutive windows: (inputs, targets), each (n, context)."""
    n = (len(tokens) - 1) // context
    ids = torch.from_numpy(np.ascontiguousarray(tokens[:n * context + 1])).long()
    return ids[:-1].view(n, context), ids[1:].view(n, context)
