"""Learning a byte-level BPE vocabulary from a corpus's training split and encoding it, as
``load_corpus(..., tokenizer="bpe")`` does on a run's first read: gpuaccel's way (the text in the
pieces of ``byte_level_pieces``, where the pre-tokenizer cuts it anyway) against the way before it
(the vocabulary learned from the text as one string, the text encoded line by line), alternated,
each ``--repeats`` times, in one process. Also how many tokens each gives for the split: the
line-by-line encoding cut every newline from the indentation or blank lines after it, which
the vocabulary, learned from the whole text, had merged.

    python benchmarks/gpt2_speed/code_corpus.py --megabytes 26 --site-packages --out code.txt
    PYTHONPATH=src python benchmarks/gpt2_speed/bpe_reading.py --data code.txt --out bpe_reading.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import tokenizers

from gpuaccel.data.text import BpeTokenizer


def line_by_line(text: str, vocab_size: int) -> tuple[float, float, int]:
    """(seconds learning, seconds encoding, tokens) the way before: one string to learn from, lines to encode."""
    start = time.perf_counter()
    model = tokenizers.Tokenizer(tokenizers.models.BPE())
    model.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    model.train_from_iterator([text], trainer=tokenizers.trainers.BpeTrainer(
        vocab_size=vocab_size, show_progress=False, initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet()))
    learned = time.perf_counter()
    encoded = model.encode_batch(text.splitlines(keepends=True))
    ids = np.fromiter((i for e in encoded for i in e.ids), dtype=np.int32)
    return learned - start, time.perf_counter() - learned, len(ids)


def in_pieces(text: str, vocab_size: int) -> tuple[float, float, int]:
    """(seconds learning, seconds encoding, tokens) by gpuaccel's tokenizer."""
    start = time.perf_counter()
    tokenizer = BpeTokenizer.train([text], vocab_size)
    learned = time.perf_counter()
    ids = tokenizer.encode(text)
    return learned - start, time.perf_counter() - learned, len(ids)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True, help="a text file")
    p.add_argument("--vocab-size", type=int, default=50257)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    text = Path(args.data).read_text(encoding="utf-8")
    train = text[:int(len(text) * 0.9)]  # (load_corpus's training split)
    runs = {"line_by_line": [], "in_pieces": []}
    for _ in range(args.repeats):
        for name, way in (("line_by_line", line_by_line), ("in_pieces", in_pieces)):
            learn, encode, tokens = way(train, args.vocab_size)
            runs[name].append({"learn_s": round(learn, 2), "encode_s": round(encode, 2), "tokens": tokens})
            print(name, runs[name][-1], flush=True)
    result = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "command": " ".join(sys.argv),
              "machine": f"{os.cpu_count()} cores, {platform.processor() or platform.machine()}",
              "python": platform.python_version(), "tokenizers": tokenizers.__version__,
              "characters": len(train), "vocab_size": args.vocab_size, "runs": runs,
              "median_total_s": {k: round(statistics.median(r["learn_s"] + r["encode_s"] for r in v), 2)
                                 for k, v in runs.items()}}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
