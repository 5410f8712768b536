"""FP8 linear layers written for this measurement (not part of gpuaccel), and ``gpuaccel train``
with a GPT whose linear layers use them.

A converted ``nn.Linear`` computes its output (and, with ``fp8_input_gradient``, its input's
gradient) with ``torch._scaled_mm`` on float8 e4m3 operands scaled row by row: each row of the
input (a token) and of the weight (an output feature) gets its own scale, its largest magnitude
mapped to 448, e4m3's largest value. The scales and casts are plain PyTorch operations that
torch.compile fuses into the kernels producing the operands (unlike torchao's float8 training,
whose separate cast kernels made the step slower: ``fp8_training.py``). The weight's gradient, a
sum over every token, stays a bf16 product. The weights themselves stay fp32 (cast anew each
step), so the optimizer, checkpoints and the tied output layer are unchanged. The model's last
linear layer (a GPT's output layer) is never converted.

As a model for ``gpuaccel train`` (registered as ``gpt_fp8``: gpuaccel's ``gpt`` with
``fp8=all`` (every linear layer but the output one) or ``fp8=mlp`` (the MLPs' only), and
``fp8_input_gradient=true|false``), run through this file::

    PYTHONPATH=src python benchmarks/gpt2_speed/fp8_linear.py train --recipe gpt2-small --data tinyshakespeare.txt \\
        --model gpt_fp8 --model-args layers=12,heads=12,width=768,dropout=0.0,pad_vocab=64,fp8=all

``gpt2_speed.py`` runs it as a variant whose options start with ``@benchmarks/gpt2_speed/fp8_linear.py``.
"""

from __future__ import annotations

import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

from gpuaccel.models.gpt import gpt
from gpuaccel.models.registry import register_model

E4M3 = torch.float8_e4m3fn
E4M3_MAX = torch.finfo(E4M3).max


def scaled_rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``t`` (rows, columns) as e4m3 values and a float32 scale per row (rows, 1), ``values *
    scale ~= t``; an all-zero row gets the smallest scale rather than zero."""
    amax = t.detach().abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12)
    scale = amax / E4M3_MAX
    return (t.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3), scale


def fp8_product(a: torch.Tensor, b_rows: torch.Tensor, out_dtype=torch.bfloat16) -> torch.Tensor:
    """``a @ b_rows.T`` in FP8 (an ``out_dtype`` result): ``a`` (m, k) and ``b_rows`` (n, k) scaled by rows."""
    a8, a_scale = scaled_rows(a)
    b8, b_scale = scaled_rows(b_rows)
    # (_scaled_mm takes its second operand column-major: b8 (n, k) row-major, transposed)
    return torch._scaled_mm(a8, b8.t(), scale_a=a_scale, scale_b=b_scale.t(), out_dtype=out_dtype)


class _Float8Product(torch.autograd.Function):
    """y = x W^T (``x`` 2-D) in FP8; the input's gradient in FP8 or in ``dtype``; the weight's in
    ``dtype`` (bf16 under autocast).

    ``forward`` returns the product itself and saves its inputs as they came: written with
    ``.to()`` calls that hand back their argument, the function gave every block of the compiled
    model a zero gradient on PyTorch 2.11 while eager mode was right (cf. pytorch/pytorch#180642,
    aliases in compiled autograd functions); :func:`check_gradients` guards against it."""

    @staticmethod
    def forward(ctx, x, weight, dtype, fp8_input_gradient):
        ctx.dtype, ctx.x_dtype, ctx.fp8_input_gradient = dtype, x.dtype, fp8_input_gradient
        ctx.save_for_backward(x, weight)
        return fp8_product(x, weight, out_dtype=dtype)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad = grad.to(ctx.dtype)
        if ctx.fp8_input_gradient:
            grad_x = fp8_product(grad, weight.t().contiguous(), out_dtype=ctx.x_dtype)
        else:
            grad_x = torch.mm(grad, weight.to(grad.dtype))
        grad_weight = torch.mm(grad.t(), x.to(grad.dtype))
        return grad_x.to(ctx.x_dtype), grad_weight.to(weight.dtype), None, None


class Float8Linear(nn.Linear):
    """``nn.Linear`` whose products run in FP8 on the GPU (CUDA tensors, sizes multiples of 16);
    elsewhere what ``nn.Linear`` computes."""

    fp8_input_gradient = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if not (x.is_cuda and self.in_features % 16 == 0 and self.out_features % 16 == 0 and rows % 16 == 0):
            return F.linear(x, self.weight, self.bias)
        dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else x.dtype
        y = _Float8Product.apply(x.reshape(rows, x.shape[-1]), self.weight, dtype, self.fp8_input_gradient)
        y = y.view(*x.shape[:-1], y.shape[-1])
        return y if self.bias is None else y + self.bias.to(y.dtype)


def convert_to_fp8(model: nn.Module, which: str = "all", input_gradient: bool = True) -> list[str]:
    """Makes ``model``'s linear layers but the last one (``which="all"``), or those whose name
    contains ``which`` (e.g. ``"mlp"``), :class:`Float8Linear` ones in place. Returns their names."""
    linears = [(name, m) for name, m in model.named_modules() if type(m) is nn.Linear][:-1]
    converted = []
    for name, module in linears:
        if which == "all" or which in name:
            module.__class__ = Float8Linear
            module.fp8_input_gradient = input_gradient
            converted.append(name)
    return converted


@register_model("gpt_fp8")
def gpt_fp8(vocab_size: int, context_length: int = 256, layers: int = 6, heads: int = 6, width: int = 384,
            dropout: float = 0.0, pad_vocab: int = 1, fp8: str = "all", fp8_input_gradient: bool = True) -> nn.Module:
    """gpuaccel's ``gpt`` with FP8 linear layers (:func:`convert_to_fp8`)."""
    model = gpt(vocab_size, context_length, layers=layers, heads=heads, width=width, dropout=dropout,
                pad_vocab=pad_vocab)
    convert_to_fp8(model, fp8, fp8_input_gradient)
    return model


def check_gradients(device: str = "cuda") -> float:
    """The largest relative difference between the gradients of a small ``gpt_fp8``'s weights in
    eager mode and compiled; raises where the compiled ones are zero or far off (what a PyTorch
    bug did to every block before: ``_Float8Product``'s note)."""
    torch.manual_seed(0)
    model = gpt_fp8(512, 256, layers=2, heads=4, width=256).to(device)
    tokens = torch.randint(0, 512, (16, 256), device=device)
    grads = []
    for net in (model, torch.compile(model)):
        model.zero_grad(set_to_none=True)
        with torch.autocast(device, torch.bfloat16):
            loss = F.cross_entropy(net(tokens).float().flatten(0, 1), tokens.flatten())
        loss.backward()
        grads.append({name: p.grad.float().clone() for name, p in model.named_parameters() if "blocks" in name})
    worst = max(float((grads[1][n] - g).norm() / g.norm().clamp(min=1e-12)) for n, g in grads[0].items())
    if worst > 0.1:
        raise SystemExit(f"fp8_linear: compiled gradients differ from eager ones by {worst:.3g} (relative)")
    return worst


if __name__ == "__main__":
    from gpuaccel.cli import main

    if torch.cuda.is_available():
        print(f"fp8_linear: compiled gradients within {check_gradients():.3g} of eager ones", file=sys.stderr)
    sys.exit(main(sys.argv[1:]))
