"""The output layer and its cross-entropy, forward and backward, at a language model's step shape:
compiled PyTorch (``F.linear``, the vocabulary's slice of the padded logits, float32
``F.cross_entropy``: what the GPT's step ran before, and runs for small vocabularies:
``pytorch_linear_cross_entropy``) against gpuaccel's operator
(models/cross_entropy_kernel.py); and the operator's kernel alone on bf16 logits, with its default
settings and others (columns per block, warps per row). Each call is replayed from a CUDA graph (as
the trainer's step is: launching the kernels one by one from Python would be timed instead where
they are short); CUDA events, bf16 autocast; the median and range of ``--repeats`` timings of
``--iters`` replays each.

    PYTHONPATH=src python benchmarks/gpt2_speed/loss_kernel.py --out loss_kernel.json

Shapes (rows = batch x context): GPT-2 small on tiny Shakespeare's 20,319 BPE tokens (padded to
20,352), on GPT-2's own 50,257 (50,304), on smaller vocabularies (where the operator starts to
pay), and shakespeare-char's 65 characters at width 384. From 2,048 tokens up also the operator
with its products in FP8 (``fp8=True``: GPT's ``head_fp8``), its two kernels alone with other
settings, and how far its loss and gradients are from float32's (relative to their norms).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.nn.functional as F

from gpuaccel.bench.timing import cuda_times_ms, graph_replay
from gpuaccel.models import cross_entropy_kernel

SHAPES = {"gpt2_small_tiny_shakespeare_bpe": (16384, 768, 20319, 20352),
          "gpt2_small_gpt2_vocabulary": (16384, 768, 50257, 50304),
          "vocabulary_8192": (16384, 768, 8192, 8192), "vocabulary_4096": (16384, 768, 4096, 4096),
          "vocabulary_2048": (16384, 768, 2048, 2048),
          "vocabulary_512": (16384, 384, 512, 512), "shakespeare_char": (16384, 384, 65, 65)}
SETTINGS = [(2048, 4), (4096, 8), (8192, 8), (32768, 32)]
# The FP8 path's two kernels: the row kernel's (columns per block, warps), the transpose's (rows, columns, warps)
FP8_SETTINGS = [((1024, 4), (64, 128, 4)), ((2048, 4), (64, 128, 4)), ((2048, 8), (64, 128, 4)),
                ((1024, 4), (128, 128, 8)), ((1024, 4), (64, 64, 4))]


def timed(call, iters: int, repeats: int) -> dict:
    """Milliseconds per replay of ``call``'s CUDA graph: the median and range of ``repeats`` timings
    of ``iters`` replays each."""
    replay = graph_replay(call, warmup=3)

    def replays():
        for _ in range(iters):
            replay()
    times = [t / iters for t in cuda_times_ms(replays, repeats, warmup=1)]
    return {"ms_median": round(statistics.median(times), 4), "ms_range": [round(min(times), 4), round(max(times), 4)]}


def forward_backward(loss_fn, hidden, weight, targets, vocab, **options):
    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = loss_fn(hidden, weight, targets, vocab, **options)
        return loss, *torch.autograd.grad(loss, (hidden, weight))
    return step


def relative_errors(got, expected) -> list[float]:
    """|got - expected| / |expected| for each pair (norms over all elements)."""
    return [round(((g.float() - e.float()).norm() / e.float().norm()).item(), 5) for g, e in zip(got, expected)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    p.add_argument("--out", required=True)
    args = p.parse_args()
    result = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "command": " ".join(sys.argv),
              "device": torch.cuda.get_device_name(0), "torch": torch.__version__, "shapes": {}}
    compiled_op = torch.compile(cross_entropy_kernel.fused_linear_cross_entropy)
    for name in args.shapes:
        rows, width, vocab, padded = SHAPES[name]
        torch.manual_seed(0)
        hidden = torch.randn(rows, width, device="cuda", requires_grad=True)
        weight = (0.02 * torch.randn(padded, width, device="cuda")).requires_grad_()
        targets = torch.randint(vocab, (rows,), device="cuda")
        row = {"rows": rows, "width": width, "vocab": vocab, "padded": padded,
               "default_settings": cross_entropy_kernel.kernel_settings(padded)}
        runs = {"compiled_pytorch": torch.compile(cross_entropy_kernel.pytorch_linear_cross_entropy),
                "operator": compiled_op}  # (PyTorch's compiled for each shape; the operator is opaque to it)
        for label, fn in runs.items():
            row[label] = timed(forward_backward(fn, hidden, weight, targets, vocab), args.iters, args.repeats)
        row["speedup"] = round(row["compiled_pytorch"]["ms_median"] / row["operator"]["ms_median"], 3)
        if vocab >= 2048:
            fp8 = forward_backward(compiled_op, hidden, weight, targets, vocab, fp8=True)
            row["operator_fp8"] = timed(fp8, args.iters, args.repeats)
            row["fp8_speedup"] = round(row["operator"]["ms_median"] / row["operator_fp8"]["ms_median"], 3)
            exact = F.cross_entropy((hidden @ weight.T)[:, :vocab], targets)
            exact = (exact, *torch.autograd.grad(exact, (hidden, weight)))
            row["relative_error_loss_grad_hidden_grad_weight"] = {
                "bf16": relative_errors(forward_backward(compiled_op, hidden, weight, targets, vocab)(), exact),
                "fp8": relative_errors(fp8(), exact)}
            logits = (hidden.detach() @ weight.detach().T).bfloat16()
            for (block, warps), tile in FP8_SETTINGS:
                row[f"fp8_kernels_block{block}_warps{warps}_transpose{tile[0]}x{tile[1]}_warps{tile[2]}"] = timed(
                    lambda s=(block, warps), t=tile: cross_entropy_kernel.loss_and_fp8_gradient(logits, targets,
                                                                                               vocab, s, t),
                    args.iters, args.repeats)
        logits = (hidden.detach() @ weight.detach().T).bfloat16()
        for block, warps in SETTINGS:
            if block // 2 < padded:  # (a block twice the row reads nothing more)
                row[f"kernel_block{block}_warps{warps}"] = timed(
                    lambda s=(block, warps): cross_entropy_kernel.loss_and_gradient(logits, targets, vocab, s),
                    args.iters, args.repeats)
        result["shapes"][name] = row
        print(name, json.dumps(row), flush=True)
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
