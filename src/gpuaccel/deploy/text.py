"""Text models at inference: generation with a trained language model (the run's tokeniser
turns the prompt into tokens, the model samples continuations with its key/value cache) and
labels for sentences with a trained text classifier. Speeds are measured with the device
synchronised before the clock is read."""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..data import parse_spec
from ..data.sentences import read_labelled, sentence_files
from ..data.text import not_utf8, tokenizer_from_state
from ..train.config import saved_settings
from ..device import resolve_device, resolve_precision, synchronize
from ..errors import GpuaccelError
from ..files import make_directory, write_json
from .artifact import load_run_state, max_tokens, rebuild_model


@dataclass
class Generation:
    texts: list[str]  # the prompt and its continuation, per sample
    new_tokens: int
    seconds: float
    device: str

    @property
    def tokens_per_second(self) -> float:
        return len(self.texts) * self.new_tokens / max(self.seconds, 1e-9)


def generate(run, prompt: str, tokens: int, *, temperature: float = 0.8, top_k: int | None = 200,
             samples: int = 1, device: str = "auto", seed: int = 0, use_cache: bool = True) -> Generation:
    """``samples`` continuations of ``prompt``, ``tokens`` tokens each, from the run's model."""
    if tokens < 1 or samples < 1:
        raise GpuaccelError("--tokens and --samples must be at least 1")
    if temperature < 0:
        raise GpuaccelError(f"--temperature must be >= 0 (0: always the most likely token), got {temperature}")
    state, path = load_run_state(run)
    if not state.get("tokenizer"):
        raise GpuaccelError(f"{path} is not a language model (task {state.get('task', {}).get('name')!r}); "
                            f"generate works on runs trained on text")
    tokenizer = tokenizer_from_state(state["tokenizer"])
    model = rebuild_model(state, path).eval()
    if not hasattr(model, "generate"):
        raise GpuaccelError(f"model {state['model_name']} has no generate(); generation needs gpuaccel's gpt")
    target = resolve_device(device)
    precision = resolve_precision("auto", target)
    # weights in the compute precision itself: autocast would cast every weight at every token
    model.to(target, dtype=precision.autocast_dtype or torch.float32)
    ids = tokenizer.encode(prompt or "\n")
    if len(ids) == 0:
        raise GpuaccelError("the prompt makes no tokens; give a non-empty --prompt")
    idx = torch.as_tensor(ids, dtype=torch.long, device=target).unsqueeze(0).repeat(samples, 1)
    generator = torch.Generator(target).manual_seed(seed)
    with torch.no_grad():
        model.generate(idx, min(tokens, 8), temperature=temperature, top_k=top_k, generator=generator,
                       use_cache=use_cache)  # warm-up: kernels chosen and loaded before the clock
        generator.manual_seed(seed)
        synchronize(target)
        start = time.perf_counter()
        out = model.generate(idx, tokens, temperature=temperature, top_k=top_k, generator=generator,
                             use_cache=use_cache)
        synchronize(target)
    seconds = time.perf_counter() - start
    return Generation([tokenizer.decode(row.tolist()) for row in out.cpu()], tokens, seconds, str(target))


def text_classifier_state(run) -> tuple[dict, Path]:
    """The state of a run that trained a text classifier (else a one-line error)."""
    state, path = load_run_state(run)
    if not state.get("tokenizer") or not state.get("classes"):
        raise GpuaccelError(f"{path} is not a text classifier" + (
            "; it is a language model: sample from it with 'gpuaccel generate'" if state.get("tokenizer") else ""))
    return state, path


def sentence_chunks(inputs: list[str], classes: list[str],
                    size: int) -> Callable[[], Iterator[tuple[list[str], np.ndarray | None]]]:
    """A function giving (sentences, labels or None) ``size`` at a time, on each call from the
    start: a labelled file or folder (its evaluation split, or the whole file) is scored against
    its labels; any other file gives one sentence per line, read as the chunks are used (memory
    does not grow with the files). Every input is checked here, before any chunk."""
    if len(inputs) == 1 and Path(inputs[0]).exists() and parse_spec(inputs[0])[0] == "sentences":
        train_file, eval_file = sentence_files(Path(inputs[0]))
        texts, raw = read_labelled(eval_file or train_file, None, None)
        unknown = sorted(set(raw) - set(classes))
        if unknown:
            raise GpuaccelError(f"{eval_file or train_file} has labels the model does not know: {unknown[:5]}; "
                                f"its classes: {', '.join(classes)}")
        labels = np.array([classes.index(v) for v in raw])
        return lambda: ((texts[i:i + size], labels[i:i + size]) for i in range(0, len(texts), size))
    paths = [Path(name).expanduser() for name in inputs]
    for name, path in zip(inputs, paths):
        if not path.is_file():
            raise GpuaccelError(f"{name} is not a file; give text files (one sentence per line) or a labelled "
                                f".tsv/.csv/.jsonl")

    def chunks():
        chunk = []
        for path in paths:
            for sentence in sentences_in(path):
                chunk.append(sentence)
                if len(chunk) == size:
                    yield chunk, None
                    chunk = []
        if chunk:
            yield chunk, None
    return chunks


def sentences_in(path: Path) -> Iterator[str]:
    """A UTF-8 file's non-blank lines, stripped, read a line at a time; a line that is not UTF-8
    is an error naming the file and the line."""
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            try:
                text = line.decode("utf-8-sig" if number == 1 else "utf-8").strip()
            except UnicodeDecodeError as exc:
                raise not_utf8(path, number, line[exc.start]) from None
            if text:
                yield text


TEXT_FORMATS = ("onnx", "pt2")


def export_text_classifier(run, fmt: str, out: Path | None = None, *, data: str | None = None,
                           verify_sentences: int = 1000, opset: int | None = None) -> dict:
    """Exports a run's text classifier (any batch size, any sentence length up to the trained
    one; token ids in, logits out) with its tokeniser in ``<artefact>.json`` beside it, and checks
    the export against the original on held-out sentences (top-1 agreement >= 99.9%)."""
    from .export import BATCH, artifact_caller, compare_outputs, write_artifact
    from .runners import FORMAT_SUFFIX, metadata_path

    if fmt not in TEXT_FORMATS:
        raise GpuaccelError(f"a text classifier exports as {' or '.join(TEXT_FORMATS)}, not {fmt}")
    state, path = text_classifier_state(run)
    model = rebuild_model(state, path).eval()
    longest = max_tokens(state)
    out = Path(out) if out else path.with_name(f"model{FORMAT_SUFFIX[fmt]}")
    make_directory(out.parent)
    argument = next(iter(inspect.signature(model.forward).parameters))
    length = torch.export.Dim("length", min=2, max=max(3, longest))
    example = torch.randint(2, state["model_args"]["vocab_size"], (2, min(16, max(3, longest))))
    write_artifact(fmt, model, example, out, {argument: {0: BATCH, 1: length}}, opset, formats=TEXT_FORMATS)
    write_json(metadata_path(out), {
        "classes": state["classes"], "model": state["model_name"], "task": state["task"], "format": fmt,
        "input": f"int64 (N, T) token ids, T <= {longest}, 0 pads; made by the tokenizer below",
        "tokenizer": state["tokenizer"], "max_tokens": longest, "source": str(path)})
    held = held_out_sentences(state, data, "cannot load held-out sentences to verify the export")
    ids = held.test_ids[:verify_sentences].astype(np.int64)
    # each batch cut to its longest sentence: the export is checked at several lengths
    batches = (chunk[:, :max(2, int((chunk != 0).sum(1).max()))] for chunk in np.split(ids, range(256, len(ids), 256)))
    report = compare_outputs(model, artifact_caller(out, fmt), batches, "sentences")
    return {**report, "artifact": str(out), "format": fmt, "size_bytes": out.stat().st_size}


def held_out_sentences(state: dict, data: str | None, why: str):
    """A text classifier's data set (``data``, default the run's) tokenised as in training:
    ``train_ids``, ``test_ids`` (0-padded rows), ``test_labels``. ``why`` opens the error."""
    from ..data.cache import default_cache_dir
    from ..data.sentences import load_sentences

    config = saved_settings(state["config"])
    try:
        _, data_path = parse_spec(data or config["data"])
        return load_sentences(data_path, tokenizer=state["tokenizer"]["kind"], vocab_size=config.get("vocab_size"),
                              max_tokens=config.get("context", 256), val_split=config.get("val_split"),
                              seed=config.get("seed", 0), text_column=config.get("text_column"),
                              label_column=config.get("label_column"), cache_dir=default_cache_dir())
    except GpuaccelError as exc:
        raise GpuaccelError(f"{why} ({exc}); pass --data SPEC") from None
