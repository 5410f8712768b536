"""Translation: label-smoothed cross-entropy over the target's tokens under teacher forcing;
at evaluation the held-out loss, next-token accuracy, and the decoded translations scored by
sacreBLEU (BLEU and chrF against the references as written, detokenized, cased).

A training batch is ``(source, target_in, target_out)`` token ids (batch, length), padded with
0; an evaluation batch adds each sentence's index into the evaluation split, so that its
translation is scored against that sentence's reference text.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..errors import GpuaccelError
from .base import Metric, Task, _on_device

PAD = 0


def require_sacrebleu():
    try:
        import sacrebleu
    except ImportError:
        raise GpuaccelError("translation scores need sacrebleu: pip install sacrebleu (or gpuaccel[translation])") \
            from None
    return sacrebleu


def _tokens(targets) -> torch.Tensor:
    return targets[0] if isinstance(targets, (tuple, list)) else targets


class TokenAccuracy(Metric):
    """The share of target tokens (padding aside) whose arg-max prediction is right."""

    def sums(self, logits, targets):
        tokens = _tokens(targets)
        real = tokens != PAD
        correct = ((logits.argmax(-1) == tokens) & real).sum()
        return torch.stack([correct.float(), real.sum().float()])


class Translations:
    """The translations decoded in one evaluation, with their sentences' indices, shared by the
    BLEU and chrF metrics, which score them once at the end (gathered over processes)."""

    def __init__(self, task: "Translation"):
        self.task = task
        self.reset()

    def reset(self) -> None:
        self.ids: list[torch.Tensor] = []
        self.index: list[torch.Tensor] = []
        self.target_ids: list[torch.Tensor] = []
        self._last = None
        self._scores = None

    def add(self, generated: torch.Tensor, targets) -> None:
        if generated is self._last:  # (both metrics are handed the same batch)
            return
        self._last, self._scores = generated, None
        if not isinstance(targets, (tuple, list)) or len(targets) < 2:
            raise GpuaccelError("translation evaluation batches carry each sentence's index (source, target_in, "
                                "target_out, index)")
        self.ids.append(generated.cpu())
        self.target_ids.append(targets[0].cpu())
        self.index.append(targets[1].cpu())

    def texts(self) -> tuple[list[str], list[str]]:
        """(hypotheses, references), in the evaluation split's order, over every process."""
        from ..models.seq2seq import strip_special

        rows = [(int(i), h, t) for ids, targets, index in zip(self.ids, self.target_ids, self.index)
                for i, h, t in zip(index, ids, targets)]
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            gathered = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(gathered, rows)
            rows = [r for part in gathered for r in part]
        seen, hypotheses, references = set(), [], []
        decode = self.task.decoder().decode
        for i, hypothesis, target in sorted(rows, key=lambda r: r[0]):
            if i in seen:  # (a shard padded with repeats)
                continue
            seen.add(i)
            hypotheses.append(decode(strip_special(hypothesis)))
            refs = self.task.references
            references.append(refs[i] if refs is not None else decode(strip_special(target)))
        return hypotheses, references

    def scores(self) -> dict[str, float]:
        if self._scores is None:
            sacrebleu = require_sacrebleu()
            hypotheses, references = self.texts()
            if not hypotheses:
                return {"bleu": float("nan"), "chrf": float("nan")}
            bleu, chrf = sacrebleu.metrics.BLEU(), sacrebleu.metrics.CHRF()
            self._scores = {"bleu": bleu.corpus_score(hypotheses, [references]).score,
                            "chrf": chrf.corpus_score(hypotheses, [references]).score}
            self.task.signatures = {"bleu": str(bleu.get_signature()), "chrf": str(chrf.get_signature())}
        return self._scores


class CorpusScore(Metric):
    """sacreBLEU's BLEU or chrF (0-100) of the evaluation's translations."""

    width = 0
    uses_generated = True  # (scored on the decoded translations, not the teacher-forced logits)

    def __init__(self, translations: Translations, which: str):
        self.translations, self.which = translations, which

    def sums(self, generated, targets):
        self.translations.add(generated, targets)

    def finish(self, totals):
        return self.translations.scores()[self.which]

    def reset(self) -> None:
        self.translations.reset()


class Translation(Task):
    """Inputs are (source, target_in) token ids; outputs the decoder's logits (batch, length,
    vocabulary); targets the next target token at each position (and, at evaluation, each
    sentence's index). ``tokenizer`` (its recorded state) turns decoded ids back into text;
    ``references`` are the evaluation split's target sentences as written."""

    name = "translation"
    default_target = "bleu"

    def __init__(self, label_smoothing: float = 0.1, beam_size: int = 5, length_penalty: float = 1.0,
                 tokenizer: dict | None = None, references: list[str] | None = None):
        self.label_smoothing, self.beam_size, self.length_penalty = label_smoothing, beam_size, length_penalty
        self.tokenizer, self.references = tokenizer, references
        self.signatures: dict[str, str] = {}
        self._translations = Translations(self)
        self._decoder = None

    def decoder(self):
        """The tokeniser that turns ids back into text."""
        if self._decoder is None:
            if self.tokenizer is None:
                raise GpuaccelError("task translation needs the data's tokenizer to score translations")
            from ..data.text import tokenizer_from_state

            self._decoder = tokenizer_from_state(self.tokenizer)
        return self._decoder

    def split(self, batch):
        if isinstance(batch, (tuple, list)) and len(batch) in (3, 4):
            return (batch[0], batch[1]), (batch[2] if len(batch) == 3 else (batch[2], batch[3]))
        raise GpuaccelError("a translation batch is (source, target_in, target_out) token ids (and, to evaluate, "
                            "each sentence's index)")

    def loss(self, logits, targets):
        return F.cross_entropy(logits.flatten(0, -2).float(), _tokens(targets).flatten(), ignore_index=PAD,
                               label_smoothing=self.label_smoothing)

    def eval_loss_sum(self, logits, targets):
        tokens = _tokens(targets)
        nll = F.cross_entropy(logits.flatten(0, -2).float(), tokens.flatten(), ignore_index=PAD)
        return nll * _on_device(tokens.shape[0], nll)

    def metrics(self):
        return {"accuracy": TokenAccuracy(), "bleu": CorpusScore(self._translations, "bleu"),
                "chrf": CorpusScore(self._translations, "chrf")}

    def generate(self, model, inputs):
        """The translations evaluation scores: the model's beam search over the batch's sources."""
        translate = getattr(model, "translate", None)
        if translate is None:
            raise GpuaccelError(f"task translation decodes with the model's translate(source, beam, "
                                f"length_penalty); {type(model).__name__} has none (use transformer_seq2seq)")
        return translate(inputs[0], beam=self.beam_size, length_penalty=self.length_penalty)

    def check_batch(self, outputs, targets) -> None:
        tokens = _tokens(targets)
        if not isinstance(outputs, torch.Tensor) or outputs.dim() != 3 or outputs.shape[1] != tokens.shape[1]:
            shape = tuple(outputs.shape) if isinstance(outputs, torch.Tensor) else type(outputs).__name__
            raise GpuaccelError(f"task translation takes logits (batch, target length {tokens.shape[1]}, vocabulary); "
                                f"the model returned {shape}")

    def example_input(self, batch, sample_shape):
        return torch.full((batch, *sample_shape), 4, dtype=torch.long)

    def describe(self):
        return {"name": self.name, "label_smoothing": self.label_smoothing, "beam_size": self.beam_size,
                "length_penalty": self.length_penalty}
