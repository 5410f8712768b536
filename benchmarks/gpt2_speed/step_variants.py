"""GPT-2 small's training step (the ``gpt2-small`` recipe's model and optimizer) in variants that
change its kernels: the attention kernel (SDPA's flash backend, FlexAttention, FlexAttention with
a sliding window), the residual stream's dtype, Inductor's max-autotune. One process, one GPU,
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
from datetime import datetime, timezone
from pathlib import Path

import torch

import gpuaccel.models.gpt as gpt
from gpuaccel.models import create_model

VOCAB, CONTEXT, BATCH = 50257, 1024, 16
RECIPE_MODEL = dict(layers=12, heads=12, width=768, dropout=0.0, pad_vocab=64, activation="relu2",
                    norm_weights=False, head_fp8=True)
# name: (model arguments over the recipe's, FlexAttention's window (None: SDPA; 0: causal only), compile mode)
VARIANTS = {
    "recipe": ({}, None, None),  # SDPA's own choice: cuDNN's kernels on an H100/H200
    "flash": ({"attention": "flash"}, None, None),
    "flex": ({}, 0, None),
    "flex_window_512": ({}, 512, None),
    "residual_bf16": ({"residual_bf16": True}, None, None),
    "max_autotune": ({}, None, "max-autotune-no-cudagraphs"),
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


def time_variant(name: str, batches: list, warmup: int, steps: int, rounds: int) -> dict:
    model_args, window, mode = VARIANTS[name]
    torch._dynamo.reset()
    torch.manual_seed(0)
    gpt.attention = SDPA if window is None else flex_attention_function(window)  # (the name Attention calls)
    model = create_model("gpt", vocab_size=VOCAB, context_length=CONTEXT, **{**RECIPE_MODEL, **model_args}).cuda()
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(params, lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    compiled = torch.compile(model, mode=mode)

    def step(x, y):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = compiled(x, labels=y)["loss"]
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
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
