"""gpuaccel's ``gpt`` against nanoGPT's own model (cpu_baseline.py's ``NanoGPT``) of the same size,
their training steps alone (forward, loss, backward, AdamW) on a CPU, alternated in one process:
gpuaccel's as it is now (dropout's masks drawn from uniform numbers, ``models.layers.dropout``;
RMSNorm's gradient written out, ``models.layers.RMSNorm``; the rotary embedding one fused
multiply-add with the halves swapped), with PyTorch's dropout (``F.dropout``, and SDPA's own on
the attention weights: gpt before 2026-11-30), with PyTorch's ``nn.RMSNorm``; and, to say what
the rest of the gap is made of (not alternatives: they change the model), with LayerNorm in place
of RMSNorm, without the rotary embedding, and with neither.

    python benchmarks/cpu_baseline/rotary_swap.py --rounds 4 --steps 30 --out results/rotary_swap_cpu.json
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

import gpuaccel.models.gpt as gpt_module
import gpuaccel.models.layers as layers_module
from gpuaccel.models import create_model

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_baseline import NanoGPT  # noqa: E402

SIZE = dict(vocab_size=65, context_length=64, layers=4, heads=4, width=128, dropout=0.1)


def tokens_per_second(model, steps: int, batch: int = 64) -> float:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, 65, (batch, 64))
    y = torch.randint(0, 65, (batch, 64))

    def step():
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    for _ in range(3):
        step()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return steps * batch * 64 / (time.perf_counter() - start)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--out")
    args = ap.parse_args()
    torch.manual_seed(0)
    nano, ours = NanoGPT(**SIZE), create_model("gpt", **SIZE)
    q = torch.randn(2, 4, 64, 32)
    cos, sin = gpt_module.rotary_tables(64, 32)
    torch.testing.assert_close(gpt_module.rotate(q, cos, sin), gpt_module.rotate_halves(q, cos, sin))  # (one function)
    torch_norms = copy.deepcopy(ours)
    for module in torch_norms.modules():
        if isinstance(module, nn.RMSNorm):
            module.__class__ = nn.RMSNorm  # (the same parameters, PyTorch's forward and backward)
    layer_norms = copy.deepcopy(ours)
    for block in layer_norms.blocks:
        block.norm1, block.norm2 = nn.LayerNorm(SIZE["width"]), nn.LayerNorm(SIZE["width"])
    layer_norms.norm = nn.LayerNorm(SIZE["width"])
    now_rotate = gpt_module.rotate

    def unrotated(x, cos, sin):
        return x

    def torch_dropouts(on: bool) -> None:
        """PyTorch's dropout everywhere in gpt (on), or gpuaccel's (off)."""
        if on:
            layers_module.dropout = F.dropout
            gpt_module.dropout_add = lambda x, residual, p, training: residual + F.dropout(x, p, training)
            gpt_module.attention = lambda q, k, v, p, training, causal: F.scaled_dot_product_attention(
                q, k, v, is_causal=causal, dropout_p=p if training else 0.0)
        else:
            layers_module.dropout, gpt_module.dropout_add, gpt_module.attention = ours_dropouts

    ours_dropouts = layers_module.dropout, gpt_module.dropout_add, gpt_module.attention
    runs = {"nanogpt": [], "gpt": [], "gpt_torch_dropout": [], "gpt_nn_rmsnorm": [], "gpt_layernorm": [],
            "gpt_no_rotary": [], "gpt_layernorm_no_rotary": []}
    for _ in range(args.rounds):
        runs["nanogpt"].append(tokens_per_second(nano, args.steps))
        runs["gpt"].append(tokens_per_second(ours, args.steps))
        torch_dropouts(True)
        runs["gpt_torch_dropout"].append(tokens_per_second(ours, args.steps))
        torch_dropouts(False)
        runs["gpt_nn_rmsnorm"].append(tokens_per_second(torch_norms, args.steps))
        runs["gpt_layernorm"].append(tokens_per_second(layer_norms, args.steps))
        gpt_module.rotate = unrotated
        runs["gpt_no_rotary"].append(tokens_per_second(ours, args.steps))
        runs["gpt_layernorm_no_rotary"].append(tokens_per_second(layer_norms, args.steps))
        gpt_module.rotate = now_rotate
    ratios = {k: [round(a / b, 3) for a, b in zip(v, runs["nanogpt"])] for k, v in runs.items() if k != "nanogpt"}
    result = {"torch": torch.__version__, "threads": torch.get_num_threads(),
              "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "command": " ".join(sys.argv),
              "tokens_per_second": runs, "against_nanogpt_per_round": ratios,
              "against_nanogpt_median": {k: statistics.median(v) for k, v in ratios.items()}}
    print(json.dumps(result["against_nanogpt_median"]))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
