"""Text generation with a trained language model: the run's tokeniser turns the prompt into
tokens, the model samples continuations with its key/value cache, and the speed is measured
(the device synchronised before the clock is read)."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..data.text import tokenizer_from_state
from ..device import resolve_device, resolve_precision, synchronize
from ..errors import GpuaccelError
from .artifact import load_run_state, rebuild_model


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
