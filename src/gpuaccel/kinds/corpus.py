"""Text for language modelling: a .txt file or a folder of text files (data/text.py), served as
windows cut on the device."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..data.kinds import DataKind, register_kind
from ..data.text import (TEXT_SUFFIXES, RandomWindows, load_corpus, shifted_windows, token_windows,
                         validation_windows)
from ..runtime.loaders import ResidentLoader
from ..settings import setting

if TYPE_CHECKING:
    from ..train.inputs import TrainingInputs


def _only_text(path: Path) -> bool:
    """A folder of text files only (stops at the first other file: an image tree is not walked)."""
    seen_text = False
    for p in path.rglob("*"):
        if p.is_file() and not p.name.startswith("."):
            if p.suffix.lower() not in TEXT_SUFFIXES:
                return False
            seen_text = True
    return seen_text


@dataclass
class CorpusOptions:
    """The settings only a text corpus reads: a tokenizer of one's own."""
    tokenizer_file: str | None = setting(None, "text corpus: a HuggingFace tokenizer.json to tokenise with instead "
                                               "of learning a vocabulary (e.g. GPT-2's 50,257 tokens)", metavar="FILE")


class Corpus(DataKind):
    name = "text"
    settings = ("tokenizer", "vocab_size", "context")
    options = CorpusOptions
    detect_order = 10
    description = "a text corpus for language modelling (a .txt file, or a folder of text files)"
    default_model = "gpt"
    default_task = "language_modelling"

    def detect(self, path: Path) -> str | None:
        if path.is_file():
            return self.name if path.suffix.lower() in TEXT_SUFFIXES else None
        return self.name if path.is_dir() and _only_text(path) else None

    def open(self, config, path, fmt, *, dist=None) -> TrainingInputs:
        from ..train.inputs import TrainingInputs, cache_dir_of, shared_read  # (train/config.py imports the kinds)
        corpus = shared_read(dist, lambda: load_corpus(
            path, tokenizer=config.data.tokenizer or ("bpe" if config.data.tokenizer_file else "char"),
            vocab_size=config.data.vocab_size or 2048, val_split=config.data.val_split, cache_dir=cache_dir_of(config),
            tokenizer_file=Path(config.data.tokenizer_file) if config.data.tokenizer_file else None))
        corpus.check_context(config.data.context)
        identity = {"tokenizer": corpus.tokenizer.kind, "vocab_size": corpus.vocab_size, "context": config.data.context,
                    "train_tokens": len(corpus.train), "val_tokens": len(corpus.val), "files": corpus.fingerprint}

        def build(config, *, device, dtype, channels_last, rank, world_size):
            train = window_loader(torch.from_numpy(corpus.train), context=config.data.context,
                                  batch_size=config.loop.batch_size, device=device, seed=config.loop.seed, rank=rank,
                                  world_size=world_size)
            val = ResidentLoader(validation_windows(corpus.val, config.data.context),
                                 batch_size=config.loop.eval_batch_size,
                                 device=device, train=False, rank=rank, world_size=world_size)
            return train, val

        return TrainingInputs(
            name=corpus.name, description=corpus.describe(),
            train_samples=(len(corpus.train) - 1) // config.data.context,
            test_samples=(len(corpus.val) - 1) // config.data.context,
            model_args={"vocab_size": corpus.vocab_size, "context_length": config.data.context}, identity=identity,
            task="language_modelling", tokenizer=corpus.tokenizer.state(), unit="windows", default_model="gpt",
            tokens_per_sample=config.data.context, build=build, data_kind=self.name)

    def owned_before_kinds(self, state: dict) -> bool:
        return bool(state.get("tokenizer")) and (state.get("task") or {}).get("name") == "language_modelling"


def window_loader(tokens: torch.Tensor, *, context: int, batch_size: int, device: torch.device, seed: int = 0,
                  rank: int = 0, world_size: int = 1) -> ResidentLoader:
    """Training batches of a text: ``batch_size`` windows at random offsets of the token ids on
    the device, as ``(inputs, targets)`` (a window and the window shifted by one token)."""
    order = RandomWindows(len(tokens), context=context, batch_size=batch_size, seed=seed, rank=rank,
                          world_size=world_size)
    return ResidentLoader(token_windows(tokens, context, device), order=order, device=device,
                          transform=shifted_windows)


register_kind(Corpus())
