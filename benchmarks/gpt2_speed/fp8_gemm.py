"""How much FP8 matrix multiplies could give GPT-2 small's step: each linear layer's three products
(forward, input gradient, weight gradient) at the shape of the recipe's step (16 x 1024 tokens),
in bf16 against FP8 through ``torch._scaled_mm`` with per-tensor scales computed on the fly
(the casts, transposes and scaling compiled with the product, as a float8 training library
would run them), and the FP8 product alone on operands cast before (what perfectly fused casts
would leave). Times are medians of CUDA-event timings.

    PYTHONPATH=src python benchmarks/gpt2_speed/fp8_gemm.py --out fp8_gemm.json

It bounds what FP8 could add to tokens/s: the step's share in these products (from a profile of
the step, not taken here) times their speed-up, the rest unchanged.
"""

from __future__ import annotations

import argparse
import json
import statistics
from datetime import datetime, timezone
from pathlib import Path

import torch

from gpuaccel.bench.timing import cuda_times_ms

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def to_fp8(t: torch.Tensor, dtype: torch.dtype):
    """``t`` scaled into ``dtype``'s range by its absolute maximum; returns (fp8 tensor, inverse scale)."""
    amax = t.abs().amax().float().clamp(min=1e-12)
    scale = torch.finfo(dtype).max / amax
    return (t.float() * scale).to(dtype), scale.reciprocal()


def fp8_product(a: torch.Tensor, b_t: torch.Tensor, a_dtype=E4M3, b_dtype=E4M3) -> torch.Tensor:
    """``a @ b_t.T`` (a: M x K, b_t: N x K, both bf16) in FP8, bf16 out."""
    qa, sa = to_fp8(a, a_dtype)
    qb, sb = to_fp8(b_t, b_dtype)
    return torch._scaled_mm(qa, qb.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)


def timed(fn) -> float:
    return statistics.median(cuda_times_ms(fn, repeats=50, warmup=5))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=16 * 1024)
    p.add_argument("--width", type=int, default=768)
    p.add_argument("--vocab", type=int, default=20352, help="the head's rows (BPE 20,319 padded to 64)")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    dev = torch.device("cuda")
    torch._dynamo.config.recompile_limit = 256  # (one compiled cast per shape: 15 of them, none left eager)
    m, w = args.tokens, args.width
    # (name, in, out, copies per step)
    linears = [("qkv", w, 3 * w, args.layers), ("attention out", w, w, args.layers),
               ("mlp in", w, 4 * w, args.layers), ("mlp out", 4 * w, w, args.layers), ("head", w, args.vocab, 1)]
    fp8 = torch.compile(fp8_product, dynamic=False)
    grad_fp8 = torch.compile(lambda a, b_t: fp8_product(a, b_t, E5M2, E4M3), dynamic=False)
    rows, bf16_total, fp8_total, gemm_total = [], 0.0, 0.0, 0.0
    for name, k, n, copies in linears:
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        weight = torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k ** 0.5
        grad = torch.randn(m, n, device=dev, dtype=torch.bfloat16)
        weight_t, grad_t, x_t = weight.t().contiguous(), grad.t().contiguous(), x.t().contiguous()
        products = {  # (bf16, fp8 with its casts, the operands): forward x W^T; input gradient g W; weight gradient g^T x
            "forward": (lambda: x @ weight.t(), lambda: fp8(x, weight), (x, weight, E4M3)),
            "input gradient": (lambda: grad @ weight, lambda: grad_fp8(grad, weight_t), (grad, weight_t, E5M2)),
            "weight gradient": (lambda: grad.t() @ x, lambda: grad_fp8(grad_t, x_t), (grad_t, x_t, E5M2)),
        }
        for product, (plain, quantised, (a, b_t, a_dtype)) in products.items():
            qa, sa = to_fp8(a, a_dtype)
            qb, sb = to_fp8(b_t, E4M3)
            gemm_only = lambda: torch._scaled_mm(qa, qb.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)  # noqa: E731
            bf16_ms, fp8_ms, gemm_ms = timed(plain), timed(quantised), timed(gemm_only)
            flops = 2 * m * k * n
            rows.append({"layer": name, "product": product, "copies": copies, "bf16_ms": round(bf16_ms, 4),
                         "fp8_ms": round(fp8_ms, 4), "fp8_product_alone_ms": round(gemm_ms, 4),
                         "bf16_tflops": round(flops / bf16_ms / 1e9, 1), "fp8_tflops": round(flops / fp8_ms / 1e9, 1),
                         "speedup": round(bf16_ms / fp8_ms, 3), "speedup_product_alone": round(bf16_ms / gemm_ms, 3)})
            gemm_total += copies * gemm_ms
            bf16_total += copies * bf16_ms
            fp8_total += copies * fp8_ms
            print(rows[-1], flush=True)
    result = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "device": torch.cuda.get_device_name(),
              "torch": torch.__version__, "tokens": m, "width": w, "vocab": args.vocab, "layers": args.layers,
              "rows": rows, "step_products_bf16_ms": round(bf16_total, 3), "step_products_fp8_ms": round(fp8_total, 3),
              "step_products_speedup": round(bf16_total / fp8_total, 3),
              "step_products_fp8_alone_ms": round(gemm_total, 3), "step_products_speedup_alone": round(bf16_total / gemm_total, 3)}
    print({k: v for k, v in result.items() if k != "rows"})
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
