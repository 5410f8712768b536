"""Translation at inference: a run's (or its export's) model turns text into text.

``Translator`` reads sentences (a file or standard input, a sentence per line), encodes them
with the run's tokeniser, decodes batches of similar lengths with the beam search of
``models/seq2seq.py`` and gives one translation per input line, in input order; an empty line
gives an empty line. Lines are read and written in chunks, so memory does not grow with the
input. The same search runs over the model in PyTorch or over its exported encoder and decoder
step (``export_translator``: torch.export programs, with the tokeniser in the artefact's .json),
and ``score`` gives sacreBLEU's BLEU and chrF with their signatures.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn as nn

from ..data.text import tokenizer_from_state
from ..device import resolve_device, resolve_precision, synchronize
from ..errors import GpuaccelError
from ..train.config import saved_settings
from ..files import atomic_write
from ..models.seq2seq import BOS, EOS, PAD, PyTorchDecoder, Seq2SeqTransformer, beam_search, strip_special
from .artifact import load_run_state, rebuild_model
from .runners import exported_on

CHUNK_LINES = 4096  # lines read, translated and written at a time
EXPORT_SUFFIX = ".pt2"


@dataclass
class Translated:
    lines: int = 0
    tokens: int = 0  # target tokens decoded
    seconds: float = 0.0  # decoding, the device synchronised
    notes: list[str] = field(default_factory=list)


class Translator:
    """Text in, text out, with a run's model (``from_run``) or its export (``from_export``)."""

    def __init__(self, decoder, tokenizer, *, max_tokens: int, device: torch.device, beam_size: int = 5,
                 length_penalty: float = 1.0, max_length):
        self.decoder, self.tokenizer, self.max_tokens, self.device = decoder, tokenizer, max_tokens, device
        self.beam_size, self.length_penalty, self.max_length = beam_size, length_penalty, max_length
        self.truncated = 0

    @classmethod
    def from_run(cls, run, device: str = "auto", **options) -> "Translator":
        state, path = translation_state(run)
        model = rebuild_model(state, path).eval()
        if not isinstance(model, Seq2SeqTransformer):
            raise GpuaccelError(f"{path}: model {state['model_name']} does not decode (translation needs "
                                f"transformer_seq2seq)")
        target = resolve_device(device)
        precision = resolve_precision("auto", target)
        # weights in the compute precision itself: autocast would cast every weight at every step
        model.to(target, dtype=precision.autocast_dtype or torch.float32)
        return cls(PyTorchDecoder(model), tokenizer_from_state(state["tokenizer"]), device=target,
                   max_tokens=state["translation"]["max_tokens"], max_length=model.max_length,
                   **_decoding(state["translation"], options))

    @classmethod
    def from_export(cls, artifact, device: str = "auto", **options) -> "Translator":
        meta, encoder, step = load_export(artifact)
        target = resolve_device(device)
        decoder = ExportedDecoder(exported_on(encoder, target), exported_on(step, target), meta["cache"])
        context = meta["translation"]["max_tokens"] + 1
        return cls(decoder, tokenizer_from_state(meta["tokenizer"]), device=target,
                   max_tokens=meta["translation"]["max_tokens"],
                   max_length=lambda source_length: min(context, int(1.5 * source_length) + 10),
                   **_decoding(meta["translation"], options))

    def _batches(self, ids: list[list[int]], batch_tokens: int) -> Iterator[list[int]]:
        """Indices of ``ids`` in batches of similar lengths, about ``batch_tokens`` each."""
        order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
        batch: list[int] = []
        for i in order:
            length = len(ids[i]) + 1
            if batch and (len(batch) + 1) * length * max(1, self.beam_size) > batch_tokens:
                yield batch
                batch = []
            batch.append(i)
        if batch:
            yield batch

    def translate(self, lines: list[str], batch_tokens: int = 16384, stats: Translated | None = None) -> list[str]:
        """One translation per line, in order ('' for an empty line)."""
        out = [""] * len(lines)
        keep = [i for i, line in enumerate(lines) if line.strip()]
        encoded = []
        for i in keep:
            ids = list(self.tokenizer.encode(lines[i]))
            if len(ids) > self.max_tokens - 1:
                ids, self.truncated = ids[:self.max_tokens - 1], self.truncated + 1
            encoded.append(ids + [EOS])
        start = time.perf_counter()
        decoded = 0
        with torch.no_grad():
            for batch in self._batches(encoded, batch_tokens):
                width = max(len(encoded[b]) for b in batch)
                source = torch.full((len(batch), width), PAD, dtype=torch.long)
                for row, b in enumerate(batch):
                    source[row, :len(encoded[b])] = torch.tensor(encoded[b])
                result = beam_search(self.decoder, source.to(self.device), beam=self.beam_size,
                                     length_penalty=self.length_penalty, max_length=self.max_length(width)).cpu()
                for row, b in enumerate(batch):
                    ids = strip_special(result[row].tolist())
                    decoded += len(ids) + 1
                    out[keep[b]] = self.tokenizer.decode(ids)
        synchronize(self.device)
        if stats is not None:
            stats.lines += len(lines)
            stats.tokens += decoded
            stats.seconds += time.perf_counter() - start
        return out

    def translate_stream(self, lines: Iterable[str], write, batch_tokens: int = 16384) -> Translated:
        """Translates ``lines`` chunk by chunk, calling ``write(translation)`` for each in order."""
        stats = Translated()
        chunk: list[str] = []
        for line in lines:
            chunk.append(line.rstrip("\n").rstrip("\r"))
            if len(chunk) == CHUNK_LINES:
                for text in self.translate(chunk, batch_tokens, stats):
                    write(text)
                chunk = []
        if chunk:
            for text in self.translate(chunk, batch_tokens, stats):
                write(text)
        if self.truncated:
            stats.notes.append(f"{self.truncated} line(s) longer than the model's {self.max_tokens} tokens were cut "
                               f"to them")
        return stats


def read_lines(inputs: list[str]) -> Iterator[str]:
    """The lines of each input in order (``-``: standard input), read as they are needed; a line
    that is not UTF-8 is an error naming the input and the line."""
    import sys

    for name in inputs:
        if name == "-":
            yield from _decoded(sys.stdin.buffer, "standard input")
            continue
        path = Path(name)
        if not path.is_file():
            raise GpuaccelError(f"{name} is not a file" + ("" if path.exists() else " (it does not exist)"))
        with open(path, "rb") as stream:
            yield from _decoded(stream, name)


def _decoded(stream, label: str) -> Iterator[str]:
    for number, raw in enumerate(stream, 1):
        try:
            yield raw.decode("utf-8-sig" if number == 1 else "utf-8")
        except UnicodeDecodeError as exc:
            raise GpuaccelError(f"{label}: line {number} is not UTF-8 text (byte 0x{raw[exc.start]:02x}); convert "
                                f"it to UTF-8 (e.g. iconv -f latin1 -t utf-8)") from None


def _decoding(recorded: dict, options: dict) -> dict:
    """The beam search's settings: those given, else the run's."""
    beam = options.get("beam_size") or recorded.get("beam_size", 5)
    penalty = options.get("length_penalty")
    if beam < 1:
        raise GpuaccelError(f"--beam must be at least 1, got {beam}")
    return {"beam_size": beam, "length_penalty": recorded.get("length_penalty", 1.0) if penalty is None else penalty}


def translation_state(run) -> tuple[dict, Path]:
    """The state of a run that trained a translation model (else a one-line error)."""
    state, path = load_run_state(run)
    if state.get("data_kind") != "translation" or not state.get("translation"):
        raise GpuaccelError(f"{path} is not a translation model (task {(state.get('task') or {}).get('name')!r}); "
                            f"translate works on runs trained on sentence pairs")
    return state, path


def read_metadata(artifact: Path) -> dict:
    meta_file = artifact.with_name(artifact.name + ".json")
    if not meta_file.exists():
        raise GpuaccelError(f"{artifact} has no {meta_file.name} beside it (the tokeniser); export models with "
                            f"'gpuaccel export'")
    try:
        meta = json.loads(meta_file.read_text())
        meta["tokenizer"], meta["translation"]  # noqa: B018  (they must be there)
    except (ValueError, KeyError, TypeError):
        raise GpuaccelError(f"{meta_file} is damaged (not the JSON 'gpuaccel export' writes); export the model "
                            f"again") from None
    return meta


def score(hypotheses: list[str], references: list[str]) -> dict:
    """sacreBLEU's corpus BLEU and chrF (cased, detokenized, 13a) with their signatures."""
    from ..tasks.translation import require_sacrebleu

    sacrebleu = require_sacrebleu()
    if len(hypotheses) != len(references):
        raise GpuaccelError(f"{len(hypotheses)} translations against {len(references)} references; they must pair up")
    bleu, chrf = sacrebleu.metrics.BLEU(), sacrebleu.metrics.CHRF()
    return {"bleu": bleu.corpus_score(hypotheses, [references]).score,
            "chrf": chrf.corpus_score(hypotheses, [references]).score,
            "bleu_signature": str(bleu.get_signature()), "chrf_signature": str(chrf.get_signature()),
            "sentences": len(hypotheses)}


# ---------------------------------------------------------------------------------- export

class _Encoder(nn.Module):
    """What the exported encoder computes: source ids (batch, source) -> every decoder layer's
    cross-attention keys and values, stacked (layers, batch, heads, source, head_dim), and the
    mask of real source tokens (batch, source)."""

    def __init__(self, model: Seq2SeqTransformer):
        super().__init__()
        self.model = model

    def forward(self, source):
        memory, mask = self.model.encode(source)
        kv = self.model.cross_keys_values(memory)
        return torch.stack([k for k, _ in kv]), torch.stack([v for _, v in kv]), mask[:, 0, 0, :]


class _DecoderStep(nn.Module):
    """What the exported decoder computes for one position: the tokens (rows,) at ``position`` (a
    one-element tensor), with the encoder's outputs and the self-attention caches (layers, rows,
    heads, length, head_dim) -> the next token's log-probabilities (rows, vocabulary) and the
    caches with this position written. Shapes stay the same from step to step (the caches are
    as long as the longest translation; later positions are masked), so one program serves every
    step."""

    def __init__(self, model: Seq2SeqTransformer):
        super().__init__()
        self.model = model
        self.register_buffer("slots", torch.arange(model.context_length + 1), persistent=False)

    def forward(self, tokens, position, cross_k, cross_v, source_mask, cache_k, cache_v):
        model, length = self.model, cache_k.shape[3]
        x = model.drop(model.embed(tokens[:, None]) * (model.width ** 0.5)
                       + model.positions.index_select(0, position).to(model.embed.weight.dtype))
        visible = (self.slots[:length] <= position)[None, None, None, :]
        memory_mask = source_mask[:, None, None, :]
        keys, values = [], []
        for i, layer in enumerate(model.decoder):
            attn = layer.attn
            h = layer.norm1(x)
            q, k, v = (attn._heads(part) for part in attn.qkv(h).chunk(3, dim=-1))
            layer_k = cache_k[i].index_copy(2, position, k)
            layer_v = cache_v[i].index_copy(2, position, v)
            keys.append(layer_k)
            values.append(layer_v)
            y = torch.nn.functional.scaled_dot_product_attention(q, layer_k, layer_v, attn_mask=visible)
            x = x + attn.proj(y.transpose(1, 2).reshape(x.shape))
            x = x + layer.cross(layer.norm2(x), mask=memory_mask, kv=(cross_k[i], cross_v[i]))
            x = x + layer.ffn(layer.norm3(x))
        logp = torch.log_softmax(model.logits(x)[:, -1].float(), dim=-1)
        return logp, torch.stack(keys), torch.stack(values)


class ExportedDecoder:
    """The beam search's interface (``models.seq2seq.PyTorchDecoder``'s) over the exported encoder
    and decoder step."""

    def __init__(self, encoder, step, cache: dict):
        self.encoder, self.step_program = encoder, step
        self.layers, self.heads, self.head_dim = cache["layers"], cache["heads"], cache["head_dim"]

    def start(self, source: torch.Tensor, repeat: int, length: int) -> None:
        cross_k, cross_v, mask = self.encoder(source)
        self.cross_k = cross_k.repeat_interleave(repeat, 1)
        self.cross_v = cross_v.repeat_interleave(repeat, 1)
        self.mask = mask.repeat_interleave(repeat, 0)
        shape = (self.layers, self.mask.shape[0], self.heads, max(length, 2), self.head_dim)
        self.cache_k = torch.zeros(shape, dtype=self.cross_k.dtype, device=source.device)
        self.cache_v = torch.zeros_like(self.cache_k)

    def step(self, tokens: torch.Tensor, position: int) -> torch.Tensor:
        where = torch.tensor([position], device=tokens.device)
        logp, self.cache_k, self.cache_v = self.step_program(tokens, where, self.cross_k, self.cross_v, self.mask,
                                                             self.cache_k, self.cache_v)
        return logp

    def reorder(self, rows: torch.Tensor) -> None:
        self.cache_k, self.cache_v = self.cache_k[:, rows], self.cache_v[:, rows]


def _export_programs(model: Seq2SeqTransformer):
    """(encoder, decoder step) as torch.export programs with symbolic batch, source and target lengths."""
    from torch.export import Dim

    model = model.eval().float()
    heads = model.decoder[0].attn.heads
    head_dim, layers = model.width // heads, len(model.decoder)
    rows, source_len, length = 6, 7, 9  # (example sizes, none of them 0 or 1, which export would fix)
    source = torch.full((rows, source_len), 4, dtype=torch.long)
    batch, src = Dim("batch", min=1), Dim("source", min=2, max=model.context_length)
    encoder = torch.export.export(_Encoder(model), (source,), dynamic_shapes={"source": {0: batch, 1: src}})
    cross = torch.zeros(layers, rows, heads, source_len, head_dim)
    cache = torch.zeros(layers, rows, heads, length, head_dim)
    beams, steps = Dim("rows", min=1), Dim("length", min=2, max=model.context_length)
    step = torch.export.export(
        _DecoderStep(model),
        (torch.full((rows,), BOS, dtype=torch.long), torch.tensor([1]), cross, cross.clone(),
         torch.ones(rows, source_len, dtype=torch.bool), cache, cache.clone()),
        dynamic_shapes={"tokens": {0: beams}, "position": None, "cross_k": {1: beams, 3: src},
                        "cross_v": {1: beams, 3: src}, "source_mask": {0: beams, 1: src},
                        "cache_k": {1: beams, 3: steps}, "cache_v": {1: beams, 3: steps}})
    return encoder, step, {"layers": layers, "heads": heads, "head_dim": head_dim}


def export_translator(run, fmt: str | None = None, out=None, *, data: str | None = None, verify_count: int = 1000,
                      opset: int | None = None) -> dict:
    """Exports a run's translation model as one archive (``translator.zip`` beside the run's
    model: the encoder and the decoder step as torch.export programs, the tokeniser and the
    decoding settings) and verifies it: the archive's translations of ``verify_count``
    held-out sentences (the run's evaluation split, or ``data``'s) against the model's in
    PyTorch, both on the CPU in float32 with the run's beam. It passes when at least 99% of the
    translations are the same and BLEU differs by at most 0.1."""
    import io
    import zipfile

    if fmt not in (None, "pt2"):
        raise GpuaccelError(f"a translation model exports as pt2 (torch.export programs of its encoder and decoder "
                            f"step, with its tokeniser, in one archive); --format {fmt} is for classifiers")
    state, path = translation_state(run)
    model = rebuild_model(state, path).eval().float()
    out = Path(out) if out else path.with_name("translator.zip")
    if out.suffix != ".zip":
        raise GpuaccelError(f"--out {out}: a translation export is a .zip archive (e.g. translator.zip)")
    try:
        encoder, step, cache = _export_programs(model)
    except Exception as exc:  # torch.export raises many types; its first line says what it could not trace
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
        raise GpuaccelError(f"torch.export could not trace {state['model_name']}: {first}") from None
    meta = {"format": "pt2", "model": state["model_name"], "task": state["task"], "tokenizer": state["tokenizer"],
            "translation": state["translation"], "cache": cache, "source": str(path)}

    def write(f):
        with zipfile.ZipFile(f, "w") as archive:
            for name, program in (("encoder.pt2", encoder), ("decoder_step.pt2", step)):
                buffer = io.BytesIO()
                torch.export.save(program, buffer)
                archive.writestr(name, buffer.getvalue())
            archive.writestr("translator.json", json.dumps(meta, indent=1))

    atomic_write(out, write)
    try:
        report = verify_translator(path, out, data, verify_count)
    except BaseException:
        out.unlink(missing_ok=True)  # (an unverified artefact is not left where infer would use it)
        raise
    report.update(artifact=str(out), format="pt2", size_bytes=out.stat().st_size)
    return report


def load_export(artifact) -> tuple[dict, "torch.export.ExportedProgram", "torch.export.ExportedProgram"]:
    """(metadata, encoder, decoder step) of an archive ``export_translator`` wrote."""
    import io
    import zipfile

    artifact = Path(artifact)
    if not artifact.is_file():
        raise GpuaccelError(f"{artifact} does not exist; export a translation run with 'gpuaccel export RUN'")
    try:
        with zipfile.ZipFile(artifact) as archive:
            meta = json.loads(archive.read("translator.json"))
            encoder = torch.export.load(io.BytesIO(archive.read("encoder.pt2")))
            step = torch.export.load(io.BytesIO(archive.read("decoder_step.pt2")))
        meta["tokenizer"], meta["translation"], meta["cache"]  # noqa: B018  (they must be there)
    except (zipfile.BadZipFile, KeyError, ValueError, RuntimeError, OSError) as exc:
        raise GpuaccelError(f"{artifact} is not a translation archive 'gpuaccel export' wrote "
                            f"({type(exc).__name__}); export the run again") from None
    return meta, encoder, step


def is_translation_export(path) -> bool:
    path = Path(path)
    if path.suffix != ".zip" or not path.is_file():
        return False
    import zipfile

    try:
        with zipfile.ZipFile(path) as archive:
            return "translator.json" in archive.namelist()
    except (zipfile.BadZipFile, OSError):
        return False


def held_out_pairs(state: dict, data: str | None, count: int) -> tuple[list[str], list[str]]:
    """Up to ``count`` (source, reference) sentences of the run's evaluation split (or of ``data``'s)."""
    from ..data import parse_spec
    from ..data.parallel import read_splits

    _, folder = parse_spec(data or saved_settings(state["config"])["data"])
    raw, _, _ = read_splits(folder, state["translation"]["source"], state["translation"]["target"])
    # (a run that held its evaluation pairs out of the training split: a test split, else training pairs)
    split = raw.eval_split or next((s for s in raw.pairs if s != "train"), "train")
    src, tgt = raw.pairs[split]
    kept = [(s, t) for s, t in zip(src, tgt) if s.strip() and t.strip()][:count]
    return [s for s, _ in kept], [t for _, t in kept]


def verify_translator(run, artifact: Path, data: str | None, count: int) -> dict:
    state, _ = translation_state(run)
    try:
        sources, references = held_out_pairs(state, data, count)
    except GpuaccelError as exc:
        raise GpuaccelError(f"cannot load held-out sentences to verify the export ({exc}); pass --data SPEC") \
            from None
    original = Translator.from_run(run, device="cpu")
    original.decoder.model.float()
    exported = Translator.from_export(artifact, device="cpu")
    before, after = original.translate(sources), exported.translate(sources)
    same = sum(a == b for a, b in zip(before, after)) / max(1, len(sources))
    scores = {"original": score(before, references), "export": score(after, references)}
    delta = abs(scores["original"]["bleu"] - scores["export"]["bleu"])
    return {"sentences": len(sources), "same_translations": same, "bleu_original": scores["original"]["bleu"],
            "bleu_export": scores["export"]["bleu"], "bleu_difference": delta,
            "bleu_signature": scores["export"]["bleu_signature"], "passed": same >= 0.99 and delta <= 0.1}
