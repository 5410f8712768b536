"""Parallel text for translation: sentence pairs read once, tokenised with a joint subword
vocabulary learned from the training split, cached as padded id arrays, and served in batches
of about a given number of tokens whose shapes repeat.

Layouts (``--source-lang``/``--target-lang`` name the two sides):

- a folder with two files per split, ``<split>.<language>`` (optionally ``.gz``), line *i* of
  one translating line *i* of the other: ``train.de`` + ``train.en``, ``val.de`` + ``val.en``,
  ``test_2016_flickr.de`` + ``...en`` (Multi30k, WMT's and OPUS's plain-text form);
- a ``.tsv`` or ``.jsonl`` file with a column per side (a header naming them), or a folder of
  ``train``/``val``/``test`` such files.

The evaluation split is ``val`` (or ``valid``, ``dev``); without one, ``val_split`` of the
training pairs is held out (seeded). Every other split is a test split, kept for scoring after
training (``splits``). A pair with an empty side is skipped (and counted); a sentence longer
than ``max_tokens`` is cut (counted, and said once).

Batches: each sentence pair falls in the bucket of the next multiple of 8 at or above its
longer side (with its begin or end token); a bucket's batches hold ``batch_tokens // length``
pairs, every batch of a bucket the same shape, so a compiled or captured step sees a few
shapes only. A bucket too small for one batch joins the next longer one. Each epoch shuffles
every bucket (seeded by the seed and the epoch), tops its last batch up with pairs drawn again
from the bucket, and shuffles the order of the batches.
"""

from __future__ import annotations

import gzip
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..errors import GpuaccelError
from . import cache
from .loader import EpochPlan, ShardedOrder, indices_on
from .text import UnigramTokenizer, decode_utf8, tokenizer_from_state

PAD, UNKNOWN, BOS, EOS = 0, 1, 2, 3
EVAL_SPLITS = ("val", "valid", "validation", "dev")
TABLE_SUFFIXES = (".tsv", ".jsonl")
LENGTH_STEP = 8
_EPOCH_SALT = 1_000_003


# ---------------------------------------------------------------------------------- finding the files

def _language_files(path: Path, pattern: str = "*") -> dict[str, dict[str, Path]]:
    """{split: {language: file}} of a folder of ``<split>.<language>[.gz]`` files (those whose names
    match ``pattern``)."""
    found: dict[str, dict[str, Path]] = {}
    for f in sorted(path.glob(pattern)):
        if not f.is_file() or f.name.startswith("."):
            continue
        name = f.name[:-3] if f.name.endswith(".gz") else f.name
        split, dot, language = name.rpartition(".")
        if dot and split and language.isalpha() and 2 <= len(language) <= 3:
            found.setdefault(split, {})[language.lower()] = f
    return found


def is_parallel_source(path: Path) -> bool:
    """A folder holding ``train.<xx>`` and ``train.<yy>`` (plain or .gz) and nothing that looks
    like images: the two-files-per-split layout. (A .tsv/.jsonl of pairs is named with
    ``translation:PATH``: such files are labelled sentences otherwise.)"""
    if not path.is_dir():
        return False
    # (only the train files: a folder of 50,000 frames to infer on is asked too, and each entry's
    # stat and sort took seconds)
    return len(_language_files(path, "train.*").get("train", {})) == 2


def _table_files(path: Path) -> dict[str, Path]:
    if path.is_file():
        return {"train": path}
    files = {}
    for f in sorted(path.iterdir()):
        if f.is_file() and f.suffix.lower() in TABLE_SUFFIXES:
            files.setdefault(f.stem.lower(), f)
    return files


# ---------------------------------------------------------------------------------- reading

def _lines(path: Path) -> list[str]:
    """A file's lines (gzip-compressed or not), which must be UTF-8: the file and line name
    what is not."""
    try:
        data = gzip.decompress(path.read_bytes()) if path.name.endswith(".gz") else path.read_bytes()
    except (OSError, EOFError) as exc:
        raise GpuaccelError(f"{path} cannot be read ({exc})") from None
    lines = decode_utf8(data, path).split("\n")
    if lines and lines[-1] == "":
        lines.pop()  # (the final newline)
    return [line.rstrip("\r") for line in lines]


def _pairs_from_files(source: Path, target: Path) -> tuple[list[str], list[str]]:
    src, tgt = _lines(source), _lines(target)
    if len(src) != len(tgt):
        raise GpuaccelError(f"{source} has {len(src):,} lines but {target} has {len(tgt):,}; line i of one must "
                            f"translate line i of the other")
    return src, tgt


def _pairs_from_table(path: Path, source: str, target: str) -> tuple[list[str], list[str]]:
    from .sentences import table_rows

    table = table_rows(path)
    columns, rows = table.columns, table.rows
    lowered = [c.lower() for c in columns]
    picked = []
    for side, name in (("source", source), ("target", target)):
        if name.lower() not in lowered:
            raise GpuaccelError(f"{path} has no {side} column {name!r}; its columns: {', '.join(columns)} (name "
                                f"them with --source-lang and --target-lang)")
        picked.append(lowered.index(name.lower()))
    s, t = picked
    return [row[s] if s < len(row) else "" for row in rows], [row[t] if t < len(row) else "" for row in rows]


@dataclass
class RawSplits:
    """Each split's (source sentences, target sentences) as written, and where they came from."""

    pairs: dict[str, tuple[list[str], list[str]]]
    files: list[Path]
    eval_split: str | None  # None: held out of the training split


def read_splits(path: Path, source: str | None, target: str | None) -> tuple[RawSplits, str, str]:
    """The splits at ``path`` and the two sides' names (``source``/``target`` given, or the folder's
    two languages when the user named neither and there is no doubt)."""
    if path.is_dir() and _language_files(path):
        by_split = _language_files(path)
        languages = sorted(by_split.get("train", {}))
        if len(languages) != 2:
            raise GpuaccelError(f"{path} has no training pair train.<source> + train.<target> (found: "
                                f"{', '.join(f.name for files in by_split.values() for f in files.values())})")
        if source is None or target is None:
            raise GpuaccelError(f"{path} holds {' and '.join(languages)}; say which way to translate, e.g. --source-lang "
                                f"{languages[0]} --target-lang {languages[1]}")
        for side, name in (("--source-lang", source), ("--target-lang", target)):
            if name not in languages:
                raise GpuaccelError(f"{side} {name}: {path} holds train.{languages[0]} and train.{languages[1]}")
        if source == target:
            raise GpuaccelError(f"--source-lang and --target-lang are both {source}")
        pairs, files = {}, []
        for split, langs in by_split.items():
            if source in langs and target in langs:
                pairs[split] = _pairs_from_files(langs[source], langs[target])
                files += [langs[source], langs[target]]
            elif split == "train" or split in EVAL_SPLITS:
                missing = target if source in langs else source
                raise GpuaccelError(f"{path}: split {split} has no {split}.{missing} beside "
                                    f"{next(iter(langs.values())).name}")
    else:
        tables = _table_files(path)
        if "train" not in tables:
            raise GpuaccelError(f"{path} has no training pairs: give a folder of train.<source> + train.<target> "
                                f"files, or a .tsv/.jsonl with a column per side (or a folder with train.tsv)")
        source, target = source or "source", target or "target"
        pairs = {split: _pairs_from_table(f, source, target) for split, f in tables.items()}
        files = list(tables.values())
    eval_split = next((s for s in EVAL_SPLITS if s in pairs), None)
    return RawSplits(pairs, files, eval_split), source, target


# ---------------------------------------------------------------------------------- tokenised

@dataclass
class Encoded:
    """One split as padded id arrays: sources with their end token, targets as the decoder reads
    them (begin token first) and as it predicts them (end token last), all padded with 0 to
    one length; and the target sentences as written (the references)."""

    source: np.ndarray  # (n, L) int32
    target_in: np.ndarray
    target_out: np.ndarray
    references: list[str]

    def __len__(self) -> int:
        return len(self.references)

    def lengths(self) -> np.ndarray:
        """The longer side of each pair, in positions (with its begin or end token)."""
        return np.maximum((self.source != PAD).sum(1), (self.target_out != PAD).sum(1))


def _encode(tokenizer: UnigramTokenizer, src: list[str], tgt: list[str], max_tokens: int) -> tuple[Encoded, int]:
    """(the split encoded, how many sentences were cut to ``max_tokens``)."""
    src_ids, tgt_ids = tokenizer.encode_lines(src), tokenizer.encode_lines(tgt)
    keep = max_tokens - 1  # (room for the begin or end token)
    cut = sum(len(ids) > keep for ids in src_ids) + sum(len(ids) > keep for ids in tgt_ids)
    src_ids, tgt_ids = [ids[:keep] for ids in src_ids], [ids[:keep] for ids in tgt_ids]
    width = max(max(map(len, src_ids), default=0), max(map(len, tgt_ids), default=0)) + 1
    n = len(src_ids)
    source, target_in, target_out = (np.zeros((n, width), np.int32) for _ in range(3))
    for i, (s, t) in enumerate(zip(src_ids, tgt_ids)):
        source[i, :len(s)], source[i, len(s)] = s, EOS
        target_in[i, 0], target_in[i, 1:len(t) + 1] = BOS, t
        target_out[i, :len(t)], target_out[i, len(t)] = t, EOS
    return Encoded(source, target_in, target_out, list(tgt)), cut


@dataclass
class ParallelText:
    """Tokenised sentence pairs: the training split, the evaluation split, further test splits
    (kept for scoring after training), and the joint tokeniser."""

    name: str
    source_language: str
    target_language: str
    train: Encoded
    eval: Encoded
    tokenizer: UnigramTokenizer
    tests: dict[str, Encoded] = field(default_factory=dict)
    eval_split: str = "val"
    skipped_empty: int = 0
    truncated: int = 0
    fingerprint: str = ""

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    def describe(self) -> str:
        notes = []
        if self.skipped_empty:
            notes.append(f"{self.skipped_empty:,} pairs with an empty side skipped")
        if self.truncated:
            notes.append(f"{self.truncated:,} sentences cut to the longest the model takes")
        tests = "".join(f" / {len(t):,} {name}" for name, t in self.tests.items())
        return (f"{self.name}: {self.source_language} -> {self.target_language}, {self.tokenizer.kind} tokens "
                f"(joint vocabulary {self.vocab_size:,}): {len(self.train):,} train / {len(self.eval):,} "
                f"{self.eval_split}{tests} sentence pairs" + (f" ({'; '.join(notes)})" if notes else ""))


def _drop_empty(src: list[str], tgt: list[str]) -> tuple[list[str], list[str], int]:
    kept = [(s, t) for s, t in zip(src, tgt) if s.strip() and t.strip()]
    return [s for s, _ in kept], [t for _, t in kept], len(src) - len(kept)


def load_parallel(path: Path, *, source: str | None, target: str | None, vocab_size: int | None = None,
                  max_tokens: int = 256, val_split: float | None = None, seed: int = 0,
                  cache_dir: Path | None = None) -> ParallelText:
    """Reads, tokenises and caches the sentence pairs at ``path`` (the tokeniser learned from the
    training split only)."""
    vocab_size = vocab_size or 8000
    if max_tokens < 4:
        raise GpuaccelError(f"--context for translation is the most tokens of a sentence; at least 4, got {max_tokens}")
    raw, source, target = read_splits(path, source, target)
    options = {"source": source, "target": target, "vocab_size": vocab_size, "max_tokens": max_tokens,
               "val_split": val_split if raw.eval_split is None else None, "seed": seed}
    key, digest = cache.file_identity("translation", path, raw.files, options)
    name = path.stem if path.is_file() else path.name
    cached = cache.load(cache_dir, key)
    if cached is not None:
        meta = cached["meta"]
        splits = {s: Encoded(cached[f"{s}.source"], cached[f"{s}.target_in"], cached[f"{s}.target_out"],
                             meta["references"][s]) for s in meta["splits"]}
        return ParallelText(name, source, target, splits.pop("train"), splits.pop(meta["eval_split"]),
                            tokenizer_from_state(meta["tokenizer"]), splits, meta["eval_split"],
                            meta["skipped_empty"], meta["truncated"], digest)
    pairs = dict(raw.pairs)
    skipped = 0
    train_src, train_tgt, skipped = _drop_empty(*pairs.pop("train"))
    if not train_src:
        raise GpuaccelError(f"{path}: the training split has no sentence pair with both sides")
    if raw.eval_split is None:
        held = 0.1 if val_split is None else val_split
        if not 0 < held < 1:
            raise GpuaccelError(f"--val-split must be in (0, 1), got {held}")
        order = np.random.default_rng(seed).permutation(len(train_src))
        cut = max(1, int(round(len(order) * held)))
        held_out, kept = sorted(order[:cut]), sorted(order[cut:])
        pairs["val"] = ([train_src[i] for i in held_out], [train_tgt[i] for i in held_out])
        train_src, train_tgt = [train_src[i] for i in kept], [train_tgt[i] for i in kept]
        eval_split = "val"
    else:
        eval_split = raw.eval_split
    if vocab_size < 16:
        raise GpuaccelError(f"--vocab-size must be at least 16, got {vocab_size}")
    tokenizer = UnigramTokenizer.train(train_src + train_tgt, vocab_size)
    train, truncated = _encode(tokenizer, train_src, train_tgt, max_tokens)
    splits = {}
    for split, (src, tgt) in pairs.items():
        src, tgt, empty = _drop_empty(src, tgt)
        if split == eval_split:
            skipped += empty
            if not src:
                raise GpuaccelError(f"{path}: the {split} split has no sentence pair with both sides")
        splits[split], cut = _encode(tokenizer, src, tgt, max_tokens)
        truncated += cut
    data = ParallelText(name, source, target, train, splits.pop(eval_split), tokenizer, splits, eval_split,
                        skipped, truncated, digest)
    every = {"train": data.train, eval_split: data.eval, **data.tests}
    arrays = {f"{s}.{part}": getattr(e, part) for s, e in every.items() for part in ("source", "target_in", "target_out")}
    cache.save(cache_dir, key, {"tokenizer": tokenizer.state(), "splits": list(every), "eval_split": eval_split,
                                "references": {s: e.references for s, e in every.items()},
                                "skipped_empty": skipped, "truncated": truncated}, **arrays)
    return data


# ---------------------------------------------------------------------------------- batches

def bucket_lengths(lengths: np.ndarray, batch_tokens: int) -> tuple[np.ndarray, dict[int, int]]:
    """Each pair's bucket (a padded length, a multiple of 8) and each bucket's batch size
    (``batch_tokens // length``); a bucket with fewer pairs than one batch joins the next longer
    one (the longest keeps what it has, as one smaller batch)."""
    padded = np.maximum(LENGTH_STEP, -(-lengths // LENGTH_STEP) * LENGTH_STEP)
    buckets = sorted(set(padded.tolist()))
    assigned = padded.copy()
    sizes = {}
    for i, length in enumerate(buckets):
        members = assigned == length
        size = max(1, batch_tokens // length)
        if members.sum() < size and i + 1 < len(buckets):
            assigned[members] = buckets[i + 1]
            continue
        if members.any():
            sizes[length] = min(size, int(members.sum()))
    return assigned, sizes


class TokenBuckets(ShardedOrder):
    """Sentence pairs' order for a resident loader over :func:`pair_tensors`, in batches of about
    ``batch_tokens`` tokens each cut to its bucket's length. Training: each epoch shuffles every
    length bucket (:func:`bucket_lengths`), tops its last batch up with pairs drawn again from it
    and shuffles the order of the batches; every rank draws the same order and takes every
    ``world_size``-th batch. Evaluation: the pairs in order of length, as many per batch as fit
    in ``batch_tokens`` at the batch's padded length."""

    def __init__(self, data: Encoded, *, batch_tokens: int, train: bool, seed: int = 0, rank: int = 0,
                 world_size: int = 1):
        lengths = data.lengths()
        if train:
            self.bucket_of, self.sizes = bucket_lengths(lengths, batch_tokens)
            self.members = {length: np.flatnonzero(self.bucket_of == length) for length in self.sizes}
            batches = sum(math.ceil(len(m) / self.sizes[length]) for length, m in self.members.items())
            largest = max(self.sizes.values(), default=1)
        else:
            order = np.argsort(lengths, kind="stable")  # (similar lengths together: little padding)
            padded = np.maximum(LENGTH_STEP, -(-lengths // LENGTH_STEP) * LENGTH_STEP)
            self.eval_batches, chunk = [], []
            for i in order:  # as many pairs as fit in batch_tokens at the batch's padded length
                if chunk and (len(chunk) + 1) * padded[i] > batch_tokens:
                    self.eval_batches.append((np.array(chunk), int(padded[chunk[-1]])))
                    chunk = []
                chunk.append(i)
            self.eval_batches.append((np.array(chunk), int(padded[chunk[-1]])))
            batches = len(self.eval_batches)
            largest = max(len(chunk) for chunk, _ in self.eval_batches)
        # (batch_size: the largest batch; the pairs of a batch vary with its length)
        super().__init__(len(data), batch_size=largest, train=train, seed=seed, rank=rank, world_size=world_size,
                         drop_last=False)
        self.steps = batches // world_size if train else math.ceil(batches / world_size)
        if self.steps == 0:
            raise GpuaccelError(f"{len(data)} sentence pairs make no batch for each of {world_size} processes")

    def __len__(self) -> int:
        return self.steps

    def shapes_plan(self, device: torch.device) -> EpochPlan | None:
        """One training batch of each shape (the warm-up compiles and records each before the clock)."""
        if not self.train:
            return None
        chosen = [(self.members[length][:size], length) for length, size in self.sizes.items()]
        return _plan_of(chosen, device)

    def epoch_batches(self, epoch: int) -> list[tuple[np.ndarray, int]]:
        """This rank's batches of ``epoch``: (indices, padded length) each."""
        if not self.train:
            return self.eval_batches[self.rank::self.world_size]
        rng = np.random.default_rng((self.seed * _EPOCH_SALT + epoch) * 1009)
        batches = []
        for length, members in self.members.items():
            size = self.sizes[length]
            order = rng.permutation(members)
            short = -len(order) % size
            if short:  # the last batch topped up with pairs drawn again from the bucket
                order = np.concatenate([order, rng.choice(members, short, replace=len(members) < short)])
            batches += [(chunk, length) for chunk in order.reshape(-1, size)]
        picked = rng.permutation(len(batches))[:self.steps * self.world_size]
        return [batches[i] for i in picked[self.rank::self.world_size]]

    def epoch_plan(self, epoch: int, device: torch.device) -> EpochPlan:
        return _plan_of(self.epoch_batches(epoch), device)


def _plan_of(batches: list[tuple[np.ndarray, int]], device: torch.device) -> EpochPlan:
    if not batches:
        return EpochPlan(torch.empty(0, dtype=torch.int64, device=device), [], [])
    indices = torch.from_numpy(np.concatenate([chunk for chunk, _ in batches]).astype(np.int64))
    return EpochPlan(indices_on(indices, device), [len(chunk) for chunk, _ in batches],
                     [length for _, length in batches])


def pair_tensors(data: Encoded, device: torch.device, *, positions: bool = False) -> tuple[torch.Tensor, ...]:
    """A split's ``(source, target_in, target_out)`` token ids on ``device``, padded to a multiple
    of 8 wide (room for the longest bucket's batches); with ``positions``, each pair's index in
    the split too (what evaluation's translations are matched to their references by)."""
    width = -(-data.source.shape[1] // LENGTH_STEP) * LENGTH_STEP
    fields = tuple(torch.nn.functional.pad(torch.from_numpy(a), (0, width - a.shape[1])).to(device)
                   for a in (data.source, data.target_in, data.target_out))
    return (*fields, torch.arange(len(data), device=device)) if positions else fields
