"""GPT-2 small's training step (the ``gpt2-small`` recipe's model and optimizer) in variants that
change its kernels: the attention kernel (SDPA's flash backend, FlexAttention, FlexAttention with
a sliding window), the residual stream's dtype, Inductor's max-autotune, the gradient clipping
(none; its scale applied by fused AdamW's ``grad_scale`` instead of a pass of its own), the
linear layers' weight gradients as autocast gives them (a bf16 product cast to float32: before
``layers.Linear``). One process, one GPU,
the same random token ids for every variant; each step (forward, backward, gradient clipping,
fused AdamW) compiled by ``torch.compile`` without CUDA graphs (the recipe also captures its
step as one graph: left out here, so that the kernels are what differs); CUDA events over
``--rounds`` rounds of ``--steps`` steps after ``--warmup`` steps (compiling), the median round.

    PYTHONPATH=src python benchmarks/gpt2_speed/step_variants.py --out step_variants.json \\
        [--variants recipe flex ...]

Losses are not compared here (random tokens): a variant worth keeping is then trained beside
nanoGPT by gpt2_speed.py. ``flex_window_512`` is another model (each position sees the 512 before
it): it bounds what a sliding window would save with FlexAttention's kernels.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from functools import partial
from pathlib import Path

import torch
import torch.nn as nn

import gpuaccel.models.gpt as gpt
from gpuaccel.models import create_model
from gpuaccel.models.layers import Linear

VOCAB, CONTEXT, BATCH = 50257, 1024, 16
MAX_NORM = 1.0  # the recipe's gradient clipping
RECIPE_MODEL = dict(layers=12, heads=12, width=768, dropout=0.0, pad_vocab=64, activation="relu2",
                    norm_weights=False, head_fp8=True)


@dataclass(frozen=True)
class Variant:
    model_args: dict = field(default_factory=dict)  # over the recipe's
    window: int | None = None  # FlexAttention's window (None: SDPA, 0: causal only)
    mode: str | None = None  # torch.compile's
    clip: str = "pass"  # "pass": clip_grad_norm_; "adamw": its scale divides the gradients inside fused AdamW; "none"
    autocast_weight_grad: bool = False  # the blocks' linear layers as nn.Linear under autocast


VARIANTS = {
    "recipe": Variant(),  # SDPA's own choice: cuDNN's kernels on an H100/H200
    "flash": Variant(model_args={"attention": "flash"}),
    "flex": Variant(window=0),
    "flex_window_512": Variant(window=512),
    "residual_bf16": Variant(model_args={"residual_bf16": True}),
    "max_autotune": Variant(mode="max-autotune-no-cudagraphs"),
    "no_clip": Variant(clip="none"),
    "clip_in_adamw": Variant(clip="adamw"),
    "autocast_weight_grad": Variant(autocast_weight_grad=True),
}
SDPA = gpt.attention


def flex_attention_function(window: int):
    """An attention function with :func:`gpuaccel.models.layers.attention`'s signature through
    FlexAttention: causal, and with ``window``, each position sees only the ``window`` before it."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    def visible(batch, head, query, key):
        return (query >= key) & (query - key < window) if window else query >= key
    masks = {}

    def attend(q, k, v, dropout, training, causal=True):
        length = q.shape[2]
        if length not in masks:
            masks[length] = create_block_mask(visible, None, None, length, length, device=q.device)
        return flex_attention(q, k, v, block_mask=masks[length])
    return attend


def use_autocast_weight_grad(model: nn.Module) -> None:
    """The blocks' ``layers.Linear`` run as ``nn.Linear`` does (autocast's bf16 weight gradient)."""
    for module in model.blocks.modules():
        if isinstance(module, Linear):
            module.forward = partial(nn.Linear.forward, module)


def time_variant(name: str, batches: list, warmup: int, steps: int, rounds: int) -> dict:
    variant = VARIANTS[name]
    torch._dynamo.reset()
    torch.manual_seed(0)
    gpt.attention = SDPA if variant.window is None else flex_attention_function(variant.window)  # (Attention calls it)
    model = create_model("gpt", vocab_size=VOCAB, context_length=CONTEXT, **{**RECIPE_MODEL, **variant.model_args})
    model = model.cuda()
    if variant.autocast_weight_grad:
        use_autocast_weight_grad(model)
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(params, lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    compiled = torch.compile(model, mode=variant.mode)

    def step(x, y):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = compiled(x, labels=y)["loss"]
        loss.backward()
        if variant.clip == "pass":
            torch.nn.utils.clip_grad_norm_(params, MAX_NORM, foreach=True)
        elif variant.clip == "adamw":  # fused AdamW divides each gradient by grad_scale (and writes it back)
            norm = torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True)
            optimizer.grad_scale = torch.clamp((norm + 1e-6) / MAX_NORM, min=1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    start = time.perf_counter()
    for x, y in batches[:warmup]:
        step(x, y)
    torch.cuda.synchronize()
    compile_seconds = time.perf_counter() - start
    per_step = []
    for r in range(rounds):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for x, y in batches[warmup + r * steps: warmup + (r + 1) * steps]:
            step(x, y)
        end.record()
        end.synchronize()
        per_step.append(begin.elapsed_time(end) / steps)
    gpt.attention = SDPA
    return {"variant": name, "ms_per_step": round(statistics.median(per_step), 3),
            "ms_per_step_rounds": [round(t, 3) for t in per_step], "warmup_seconds": round(compile_seconds, 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    p.add_argument("--warmup", type=int, default=12)
    p.add_argument("--steps", type=int, default=25)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    generator = torch.Generator("cuda").manual_seed(1)
    tokens = torch.randint(VOCAB, (BATCH, CONTEXT + 1), device="cuda", generator=generator)
    batches = [(t[:, :-1].contiguous(), t[:, 1:].contiguous())
               for t in (tokens.roll(37 * i, 1) for i in range(args.warmup + args.steps * args.rounds))]
    result = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "command": " ".join(sys.argv),
              "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
              "shape": {"batch": BATCH, "context": CONTEXT, "vocab": VOCAB, **RECIPE_MODEL}, "runs": []}
    for name in args.variants:
        result["runs"].append(time_variant(name, batches, args.warmup, args.steps, args.rounds))
        print(json.dumps(result["runs"][-1]), flush=True)
        Path(args.out).write_text(json.dumps(result, indent=1))  # (after each: a later one may run out of time)


if __name__ == "__main__":
    main()
