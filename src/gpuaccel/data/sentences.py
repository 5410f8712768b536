"""Labelled text for classification: ``.tsv``, ``.csv`` or ``.jsonl`` files with a label and a
text column, tokenised once into padded id arrays that live on the device.

A directory holds ``train.<ext>`` and an evaluation file (``dev``, ``validation``, ``valid``
or ``test``, the first that has labels); a single file is split, ``val_split`` of it held
out (seeded). Columns are named by ``--label-column``/``--text-column`` or found among the
usual names (label/labels/sentiment/class/target; sentence/text/content/review); with two
columns the one that is not the label is the text. Labels are integers (kept) or names
(sorted, numbered). Words come from the training split only: ``word`` keeps those seen at
least twice (most frequent first, up to ``vocab_size``), ``bpe`` learns a byte-level BPE.

Batches: training takes a seeded permutation, sorts each run of 32 batches by length and
cuts every batch to its longest sentence (rounded up to a multiple of 8), so a batch of
short phrases is not padded to the longest sentence of the data set; evaluation goes in
order of length the same way.
"""

from __future__ import annotations

import csv
import json
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..errors import GpuaccelError
from . import cache
from .loader import EpochPlan, ShardedOrder, indices_on
from .text import BpeTokenizer, Tokenizer, WordTokenizer, read_text, tokenizer_from_state

SENTENCE_SUFFIXES = (".tsv", ".csv", ".jsonl")
LABEL_NAMES = ("label", "labels", "sentiment", "class", "target", "y")
TEXT_NAMES = ("sentence", "text", "content", "review", "document", "sentence1")
EVAL_STEMS = ("dev", "validation", "valid", "val", "test")
_BUCKET_BATCHES = 32  # batches sorted by length together
_LENGTH_STEP = 8  # batch lengths are rounded up to a multiple of this: few distinct shapes


# ---------------------------------------------------------------------------------- reading

@dataclass
class Table:
    """A .tsv, .csv or .jsonl file's column names, rows (each a list of cells, '' where a value is
    missing or JSON null) and each row's line number in the file, for messages."""

    columns: list[str]
    rows: list[list[str]]
    lines: list[int]


def table_rows(path: Path) -> Table:
    text = read_text(path)
    if not text.strip():
        raise GpuaccelError(f"{path} is empty")
    lines = text.splitlines()
    if path.suffix.lower() == ".jsonl":
        records, numbers = [], []
        for number, line in enumerate(lines, 1):
            if line.strip():
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise GpuaccelError(f"{path}: line {number} is not JSON ({exc.msg})") from None
                if not isinstance(record, dict):
                    raise GpuaccelError(f"{path}: line {number} is not a JSON object")
                records.append(record)
                numbers.append(number)
        columns = list(dict.fromkeys(k for r in records for k in r))
        cell = lambda value: "" if value is None else str(value)  # noqa: E731  (JSON null: no value)
        return Table(columns, [[cell(r.get(c)) for c in columns] for r in records], numbers)
    # tab-separated text is read without quoting: a sentence may hold quotation marks
    reader = csv.reader(lines, delimiter="\t", quoting=csv.QUOTE_NONE) if path.suffix.lower() == ".tsv" \
        else csv.reader(lines)
    rows, numbers = [], []
    for row in reader:
        if any(cell.strip() for cell in row):
            rows.append(row)
            numbers.append(reader.line_num)
    if len(rows) < 2:
        raise GpuaccelError(f"{path} has a header and no rows" if rows else f"{path} is empty")
    return Table([c.strip() for c in rows[0]], rows[1:], numbers[1:])


def _column(columns: list[str], asked: str | None, usual: tuple[str, ...], what: str, path: Path,
            other: int | None = None) -> int:
    lowered = [c.lower() for c in columns]
    if asked is not None:
        if asked.lower() not in lowered:
            raise GpuaccelError(f"{path} has no {what} column {asked!r}; its columns: {', '.join(columns)}")
        return lowered.index(asked.lower())
    for name in usual:
        if name in lowered:
            return lowered.index(name)
    if other is not None and len(columns) == 2:
        return 1 - other
    raise GpuaccelError(f"{path}: cannot tell which column is the {what} (columns: {', '.join(columns)}); "
                        f"name it with --{what}-column")


def read_labelled(path: Path, text_column: str | None, label_column: str | None) -> tuple[list[str], list[str]]:
    """(texts, raw labels) of one file."""
    table = table_rows(path)
    columns = table.columns
    label = _column(columns, label_column, LABEL_NAMES, "label", path)
    text = _column(columns, text_column, TEXT_NAMES, "text", path, other=label)
    texts, labels = [], []
    for row, line in zip(table.rows, table.lines):
        if len(row) <= max(label, text):
            raise GpuaccelError(f"{path}: line {line} has {len(row)} column(s); the header has {len(columns)}")
        if not row[label].strip():
            raise GpuaccelError(f"{path}: line {line} has no label")
        texts.append(row[text])
        labels.append(row[label].strip())
    return texts, labels


def label_classes(*label_lists: list[str]) -> list[str]:
    """The class names: integers in numeric order (0..K-1 kept as they are), else names sorted."""
    values = sorted({v for labels in label_lists for v in labels})
    if all(re.fullmatch(r"-?\d+", v) for v in values):
        numbers = sorted(int(v) for v in values)
        if numbers[0] < 0:
            raise GpuaccelError(f"labels must be integers >= 0 or names; found {numbers[0]}")
        return [str(i) for i in range(numbers[-1] + 1)]
    bad = [v for v in values if re.fullmatch(r"[-+]?\d*\.\d+(e[-+]?\d+)?", v)]
    if bad:
        raise GpuaccelError(f"labels must be integers or names, not numbers like {bad[0]!r} (for real-valued "
                            f"targets use the regression task from Python)")
    return values


@dataclass
class LabelledText:
    """Tokenised sentences: (N, L) int32 ids padded with 0, their lengths, and labels."""

    name: str
    train_ids: np.ndarray
    train_lengths: np.ndarray
    train_labels: np.ndarray
    test_ids: np.ndarray
    test_lengths: np.ndarray
    test_labels: np.ndarray
    classes: list[str]
    tokenizer: Tokenizer
    source: str
    fingerprint: str = ""
    truncated: int = 0

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    def describe(self) -> str:
        return (f"{self.name}: {len(self.train_labels):,} train / {len(self.test_labels):,} test sentences, "
                f"{self.num_classes} classes, {self.tokenizer.kind} tokens (vocabulary {self.tokenizer.vocab_size:,}), "
                f"at most {self.train_ids.shape[1]} per sentence"
                + (f" ({self.truncated} longer sentences cut)" if self.truncated else ""))


def sentence_files(path: Path) -> tuple[Path, Path | None]:
    """(training file, evaluation file or None) of a directory or a single file."""
    if path.is_file():
        return path, None
    files = {p.stem.lower(): p for p in sorted(path.iterdir()) if p.suffix.lower() in SENTENCE_SUFFIXES}
    if "train" not in files:
        raise GpuaccelError(f"{path} has no train.tsv, train.csv or train.jsonl")
    return files["train"], next((files[s] for s in EVAL_STEMS if s in files and _has_labels(files[s])), None)


def _has_labels(path: Path) -> bool:
    try:
        columns = table_rows(path).columns
    except GpuaccelError:
        return False
    return any(c.lower() in LABEL_NAMES for c in columns)


def pad(sequences: list[np.ndarray], length: int) -> tuple[np.ndarray, np.ndarray]:
    """(N, length) ids padded with 0 (longer sequences cut) and the kept lengths."""
    ids = np.zeros((len(sequences), length), dtype=np.int32)
    lengths = np.zeros(len(sequences), dtype=np.int32)
    for i, seq in enumerate(sequences):
        n = min(len(seq), length)
        ids[i, :n] = seq[:n]
        lengths[i] = n
    return ids, lengths


def load_sentences(path: Path, *, tokenizer: str = "word", vocab_size: int | None = None, max_tokens: int = 256,
                   val_split: float | None = None, seed: int = 0, text_column: str | None = None,
                   label_column: str | None = None, cache_dir: Path | None = None) -> LabelledText:
    if tokenizer not in ("word", "bpe"):
        raise GpuaccelError(f"--tokenizer for labelled sentences is word or bpe, not {tokenizer!r}")
    train_file, eval_file = sentence_files(path)
    files = [f for f in (train_file, eval_file) if f is not None]
    options = {"tokenizer": tokenizer, "vocab_size": vocab_size, "max_tokens": max_tokens, "columns":
               [text_column, label_column], **({} if eval_file else {"val_split": val_split, "seed": seed})}
    key, digest = cache.file_identity("sentences", path, files, options)
    name = path.name if path.is_dir() else path.stem
    cached = cache.load(cache_dir, key)
    if cached is not None:
        meta = cached["meta"]
        tok = tokenizer_from_state(meta["tokenizer"])
        return LabelledText(name, *(cached[k] for k in ("train_ids", "train_lengths", "train_labels", "test_ids",
                                                         "test_lengths", "test_labels")),
                            meta["classes"], tok, str(path), digest, meta["truncated"])
    texts, labels = read_labelled(train_file, text_column, label_column)
    if eval_file is not None:
        test_texts, test_labels = read_labelled(eval_file, text_column, label_column)
    else:
        share = 0.1 if val_split is None else val_split
        if not 0 < share < 1:
            raise GpuaccelError(f"--val-split must be in (0, 1), got {share}")
        order = np.random.default_rng(seed).permutation(len(texts))
        held = set(order[:max(1, int(len(texts) * share))].tolist())
        test_texts = [t for i, t in enumerate(texts) if i in held]
        test_labels = [y for i, y in enumerate(labels) if i in held]
        texts = [t for i, t in enumerate(texts) if i not in held]
        labels = [y for i, y in enumerate(labels) if i not in held]
    classes = label_classes(labels, test_labels)
    index = {c: i for i, c in enumerate(classes)}
    tok: Tokenizer = WordTokenizer.train(texts, vocab_size) if tokenizer == "word" \
        else BpeTokenizer.train(texts, vocab_size or 2048)
    train_seqs = [tok.encode(t) for t in texts]
    test_seqs = [tok.encode(t) for t in test_texts]
    longest = max(len(s) for s in train_seqs + test_seqs)
    if longest == 0:
        raise GpuaccelError(f"{train_file}: every text is empty")
    length = min(max_tokens, longest)
    truncated = sum(len(s) > length for s in train_seqs + test_seqs)
    train_ids, train_lengths = pad(train_seqs, length)
    test_ids, test_lengths = pad(test_seqs, length)
    data = LabelledText(name, train_ids, train_lengths, np.array([index[y] for y in labels], dtype=np.int64),
                        test_ids, test_lengths, np.array([index[y] for y in test_labels], dtype=np.int64),
                        classes, tok, str(path), digest, truncated)
    cache.save(cache_dir, key, {"tokenizer": tok.state(), "classes": classes, "truncated": truncated},
               train_ids=train_ids, train_lengths=train_lengths, train_labels=data.train_labels, test_ids=test_ids,
               test_lengths=test_lengths, test_labels=data.test_labels)
    return data


# ---------------------------------------------------------------------------------- batches

class LengthRuns(ShardedOrder):
    """Labelled sentences' order for a resident loader over ``(ids, labels)``: training in a
    seeded order sorted by length within runs of 32 batches, the batches then shuffled;
    evaluation in order of length. Each batch is cut to its longest sentence (rounded up to a
    multiple of 8, at most the padded width). Sharded by rank like every order."""

    def __init__(self, lengths: np.ndarray, *, width: int, batch_size: int, train: bool, seed: int = 0, rank: int = 0,
                 world_size: int = 1):
        super().__init__(len(lengths), batch_size=batch_size, train=train, seed=seed, rank=rank, world_size=world_size,
                         drop_last=None)
        self.lengths = torch.from_numpy(lengths.astype(np.int64))  # (on the host: batch widths need no sync)
        self.width = width

    def epoch_batches(self, epoch: int) -> list[torch.Tensor]:
        """This rank's batches of sample indices for ``epoch``."""
        if not self.train:
            mine = self.epoch_indices(epoch)
            mine = mine[torch.argsort(self.lengths[mine], stable=True)]
            return list(mine.split(self.batch_size))
        generator = self.epoch_generator(epoch)  # (the order's, then the batches')
        order = self.epoch_indices(epoch, generator)[:len(self) * self.batch_size]
        chunk = self.batch_size * _BUCKET_BATCHES
        batches = []
        for part in order.split(chunk):
            part = part[torch.argsort(self.lengths[part], stable=True)]
            batches.extend(part.split(self.batch_size))
        shuffled = torch.randperm(len(batches), generator=generator)
        return [batches[i] for i in shuffled]

    def epoch_plan(self, epoch: int, device: torch.device) -> EpochPlan:
        batches = self.epoch_batches(epoch)
        if not batches:
            return EpochPlan(torch.empty(0, dtype=torch.int64, device=device), [], [])
        indices = torch.cat(batches)
        sizes = [len(b) for b in batches]
        starts = np.cumsum([0] + sizes[:-1])
        longest = np.maximum.reduceat(self.lengths[indices].numpy(), starts)
        widths = np.minimum(self.width, np.maximum(_LENGTH_STEP, -(-longest // _LENGTH_STEP) * _LENGTH_STEP))
        return EpochPlan(indices_on(indices, device), sizes, widths.tolist())
