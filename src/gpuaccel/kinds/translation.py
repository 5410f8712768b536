"""Sentence pairs for translation: two files per split (``train.de`` + ``train.en``, plain or
.gz) or a .tsv/.jsonl with a column per side (data/parallel.py); a joint unigram vocabulary
learned from the training split; batches of about ``--batch-tokens`` tokens in a few shapes;
an encoder-decoder transformer (``transformer_seq2seq``) scored by sacreBLEU on decoded text.

Deployment: ``gpuaccel translate`` and ``gpuaccel infer`` read text (a sentence per line) and
write one translation per line, from a run or from its export (deploy/translation.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..data.kinds import DataKind, register_kind
from ..data.loader import int64_fields
from ..data.parallel import Encoded, TokenBuckets, is_parallel_source, load_parallel, pair_tensors
from ..errors import GpuaccelError
from ..runtime.loaders import ResidentLoader
from ..settings import check_whole, setting

if TYPE_CHECKING:
    from ..train.inputs import TrainingInputs


@dataclass
class TranslationOptions:
    """The settings only sentence pairs read (--source-lang, --target-lang, --batch-tokens)."""
    source_lang: str | None = setting(None, "translation: the language (or column) translated from, e.g. "
                                            "de (as fairseq names it)", metavar="LANG")
    target_lang: str | None = setting(None, "translation: the language (or column) translated into, e.g. en",
                                      metavar="LANG")
    batch_tokens: int = setting(8192, "translation: tokens per training batch (source or target, whichever "
                                      "is longer, padding included); batches of similar lengths", metavar="TOKENS")


class Translation(DataKind):
    name = "translation"
    settings = ("vocab_size", "context")
    options = TranslationOptions
    detect_order = 25  # (before labelled sentences: a .tsv of pairs is named translation:PATH)
    description = "sentence pairs (train.<source> + train.<target> files, or a .tsv/.jsonl with a column per side)"
    default_model = "transformer_seq2seq"
    default_task = "translation"
    export_format = "pt2"

    def validate_options(self, data) -> None:
        check_whole(data, "batch_tokens")

    def detect(self, path: Path) -> str | None:
        return self.name if is_parallel_source(path) else None

    def open(self, config, path, fmt, *, dist=None) -> TrainingInputs:
        from ..train.inputs import TrainingInputs, cache_dir_of, shared_read  # (train/config.py imports the kinds)
        if config.loop.tta:
            raise GpuaccelError("--tta flips and shifts images; translation takes 0")
        data = shared_read(dist, lambda: load_parallel(
            path, source=config.data.source_lang, target=config.data.target_lang, vocab_size=config.data.vocab_size,
            max_tokens=config.data.context, val_split=config.data.val_split, seed=config.loop.seed,
            cache_dir=cache_dir_of(config)))
        if data.truncated:
            import warnings

            warnings.warn(f"{data.truncated:,} sentences are longer than --context {config.data.context} tokens "
                          f"and were cut to it", stacklevel=2)
        identity = {"source": data.source_language, "target": data.target_language, "tokenizer": data.tokenizer.kind,
                    "vocab_size": data.vocab_size, "train_samples": len(data.train),
                    "test_samples": len(data.eval), "max_tokens": config.data.context, "files": data.fingerprint}

        def build(config, *, device, dtype, channels_last, rank, world_size):
            tokens = config.data.batch_tokens // world_size if config.loop.global_batch else config.data.batch_tokens
            common = dict(device=device, seed=config.loop.seed, rank=rank, world_size=world_size)
            return (pair_loader(data.train, batch_tokens=tokens, train=True, **common),
                    pair_loader(data.eval, batch_tokens=max(tokens, config.loop.eval_batch_size), train=False,
                                **common))

        return TrainingInputs(
            name=data.name, description=data.describe(), train_samples=len(data.train),
            test_samples=len(data.eval),
            model_args={"vocab_size": data.vocab_size, "context_length": config.data.context + 1}, identity=identity,
            task="translation", tokenizer=data.tokenizer.state(), unit="sentence pairs",
            default_model=self.default_model, build=build, data_kind=self.name, shapes_vary=True,
            task_args={"tokenizer": data.tokenizer.state(), "references": data.eval.references,
                       "beam_size": config.loop.beam_size, "length_penalty": config.loop.length_penalty},
            record={"translation": {"source": data.source_language, "target": data.target_language,
                                    "max_tokens": config.data.context, "beam_size": config.loop.beam_size,
                                    "length_penalty": config.loop.length_penalty}})

    def export(self, run, fmt, out, *, data, verify_count, static_batch, opset):
        from ..deploy.translation import export_translator

        return export_translator(run, fmt, out, data=data, verify_count=verify_count, opset=opset), "sentences"

    def held_out(self, run, data, why):
        raise GpuaccelError(f"{run} is a translation model: 'gpuaccel export', 'gpuaccel translate' and 'gpuaccel "
                            f"infer' take it; quantize, prune and bench-infer work on classifiers")


def pair_loader(split: Encoded, *, batch_tokens: int, device: torch.device, train: bool, seed: int = 0,
                rank: int = 0, world_size: int = 1) -> ResidentLoader:
    """Batches of sentence pairs on the device, ``(source, target_in, target_out)`` token ids in
    token buckets (``data.parallel.TokenBuckets``); for evaluation (``train=False``, in order of
    length) each pair's index in the split too."""
    order = TokenBuckets(split, batch_tokens=batch_tokens, train=train, seed=seed, rank=rank, world_size=world_size)
    return ResidentLoader(pair_tensors(split, device, positions=not train), order=order, device=device,
                          transform=int64_fields)


register_kind(Translation())
