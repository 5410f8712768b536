"""Labelled sentences for classification: .tsv/.csv/.jsonl files with a text and a label column
(data/sentences.py), padded and bucketed on the device."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..data.kinds import DataKind, register_kind
from ..data.loader import int64_fields
from ..data.sentences import SENTENCE_SUFFIXES, LengthRuns, load_sentences
from ..runtime.loaders import ResidentLoader
from ..settings import setting

if TYPE_CHECKING:
    from ..train.inputs import TrainingInputs


@dataclass
class SentencesOptions:
    """The settings only labelled sentences read: which columns hold the text and the label."""
    text_column: str | None = setting(None, "labelled sentences: the text's column (default: found by "
                                            "name: sentence, text, content, review, ...)", metavar="NAME")
    label_column: str | None = setting(None, "labelled sentences: the label's column (default: found by "
                                             "name: label, sentiment, class, ...)", metavar="NAME")


class Sentences(DataKind):
    name = "sentences"
    settings = ("tokenizer", "vocab_size", "context")
    options = SentencesOptions
    detect_order = 30
    description = "labelled sentences (.tsv/.csv/.jsonl, or a folder with train.tsv and dev.tsv)"
    default_model = "text_transformer"
    default_task = "classification"

    def detect(self, path: Path) -> str | None:
        if path.is_file() and path.suffix.lower() in SENTENCE_SUFFIXES or \
                path.is_dir() and any((path / f"train{suffix}").is_file() for suffix in SENTENCE_SUFFIXES):
            return self.name
        return None

    def open(self, config, path, fmt, *, dist=None) -> TrainingInputs:
        from ..train.inputs import TrainingInputs, cache_dir_of, shared_read  # (train/config.py imports the kinds)
        data = shared_read(dist, lambda: load_sentences(
            path, tokenizer=config.data.tokenizer or "word", vocab_size=config.data.vocab_size,
            max_tokens=config.data.context,
            val_split=config.data.val_split, seed=config.loop.seed, text_column=config.data.text_column,
            label_column=config.data.label_column, cache_dir=cache_dir_of(config)))
        identity = {"classes": data.classes, "tokenizer": data.tokenizer.kind, "vocab_size": data.tokenizer.vocab_size,
                    "train_samples": len(data.train_labels), "test_samples": len(data.test_labels),
                    "label_counts": np.bincount(data.train_labels, minlength=data.num_classes).tolist(),
                    "files": data.fingerprint}

        def build(config, *, device, dtype, channels_last, rank, world_size):
            common = dict(device=device, seed=config.loop.seed, rank=rank, world_size=world_size)
            return (sentence_loader(data.train_ids, data.train_lengths, data.train_labels,
                                    batch_size=config.loop.batch_size, train=True, **common),
                    sentence_loader(data.test_ids, data.test_lengths, data.test_labels,
                                    batch_size=config.loop.eval_batch_size, train=False, **common))

        return TrainingInputs(
            name=data.name, description=data.describe(), train_samples=len(data.train_labels),
            test_samples=len(data.test_labels),
            model_args={"vocab_size": data.tokenizer.vocab_size, "num_classes": data.num_classes,
                        "context_length": data.train_ids.shape[1]},
            identity=identity, classes=data.classes, task="classification", tokenizer=data.tokenizer.state(),
            unit="sentences", default_model="text_transformer", build=build, data_kind=self.name)

    def owned_before_kinds(self, state: dict) -> bool:
        return bool(state.get("tokenizer")) and (state.get("task") or {}).get("name") != "language_modelling"

    def export(self, run, fmt, out, *, data, verify_count, static_batch, opset):
        from ..deploy.text import export_text_classifier

        return export_text_classifier(run, fmt, out, data=data, verify_sentences=verify_count, opset=opset), \
            "sentences"

    def held_out(self, run, data, why):
        from ..deploy.heldout import HeldOut
        from ..deploy.infer import ids_for_model
        from ..deploy.text import held_out_sentences, text_classifier_state

        state, path = text_classifier_state(run)
        s = held_out_sentences(state, data, why)
        return HeldOut("sentences", s.train_ids, s.test_ids, s.test_labels, ids_for_model, path)


def sentence_loader(ids: np.ndarray, lengths: np.ndarray, labels: np.ndarray, *, batch_size: int,
                    device: torch.device, train: bool, seed: int = 0, rank: int = 0,
                    world_size: int = 1) -> ResidentLoader:
    """Batches of (ids, labels) on the device, each cut to its longest sentence: in length runs
    for training, in order of length for evaluation (``data.sentences.LengthRuns``)."""
    order = LengthRuns(lengths, width=ids.shape[1], batch_size=batch_size, train=train, seed=seed, rank=rank,
                       world_size=world_size)
    return ResidentLoader((torch.from_numpy(ids), torch.from_numpy(labels)), order=order, device=device,
                          transform=int64_fields)


register_kind(Sentences())
