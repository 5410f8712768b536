"""Rotary position embedding of a fused query/key/value projection, as one operator on GPUs.

Why: GPT's attention splits its projection's output, (batch, time, 3, heads, head_dim), into
queries, keys and values and rotates the first two. Compiled, Inductor rotates them in one pass,
but its backward pass takes two (the queries' and keys' gradients rotated back and written out,
then joined with the values' into the projection's gradient: on an H200, 0.92 ms of GPT-2 small's
29.3 ms step, in benchmarks/gpt2_speed/results/gpt2_kernels_code_head_fp8_h200.json). Here one
kernel reads the projection and writes the rotated queries and keys and the values, each (batch,
time, heads, head_dim), and one kernel writes the projection's gradient from the three gradients.
On an H200, GPT-2 small's recipe trained at 1.017x the tokens/s with them, at the same validation
loss within the spread of repeated runs
(benchmarks/gpt2_speed/results/gpt2_speed_code_rotary_kernel_h200.json).

The rotation is :func:`gpt.rotate`'s: each pair (x1, x2) of a head's two halves becomes
(x1 cos - x2 sin, x2 cos + x1 sin), computed in float32 and rounded once to the projection's dtype.
Needs Triton; with ``TRITON_INTERPRET=1`` set before import, the kernels run on CPU tensors through
Triton's interpreter (how the tests check them).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..triton_support import runs_on, tl, triton

if triton is not None:
    @triton.jit
    def _rotate_row(source, target, j, partner, cos, sin, live, SIGN: tl.constexpr):
        """Stores the rotation of one token's heads (``SIGN`` -1: the inverse rotation, for gradients)."""
        x = tl.load(source + j, mask=live, other=0.0).to(tl.float32)
        swapped = tl.load(source + partner, mask=live, other=0.0).to(tl.float32)
        tl.store(target + j, (x * cos + SIGN * swapped * sin).to(target.dtype.element_ty), mask=live)

    @triton.jit
    def _token_tables(cos_ptr, sin_ptr, time, WIDTH: tl.constexpr, HEAD: tl.constexpr, BLOCK: tl.constexpr):
        """(offsets into a token's heads, the offsets of their partners in the other half of each head,
        which offsets exist, the token's cosines and signed sines at those offsets)."""
        j = tl.arange(0, BLOCK)
        live = j < WIDTH
        d = j % HEAD
        partner = j + tl.where(d < HEAD // 2, HEAD // 2, -(HEAD // 2))
        cos = tl.load(cos_ptr + time * HEAD + d, mask=live, other=0.0)
        sin = tl.load(sin_ptr + time * HEAD + d, mask=live, other=0.0)
        return j, partner, live, cos, sin

    @triton.jit
    def _rotary_kernel(qkv_ptr, q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, times, WIDTH: tl.constexpr,
                       HEAD: tl.constexpr, BLOCK: tl.constexpr):
        """One token: its queries and keys rotated, its values copied."""
        token = tl.program_id(0).to(tl.int64)
        j, partner, live, cos, sin = _token_tables(cos_ptr, sin_ptr, token % times, WIDTH, HEAD, BLOCK)
        row = qkv_ptr + token * 3 * WIDTH
        _rotate_row(row, q_ptr + token * WIDTH, j, partner, cos, sin, live, 1.0)
        _rotate_row(row + WIDTH, k_ptr + token * WIDTH, j, partner, cos, sin, live, 1.0)
        tl.store(v_ptr + token * WIDTH + j, tl.load(row + 2 * WIDTH + j, mask=live), mask=live)

    @triton.jit
    def _rotary_gradient_kernel(dq_ptr, dk_ptr, dv_ptr, grad_ptr, cos_ptr, sin_ptr, times, WIDTH: tl.constexpr,
                                HEAD: tl.constexpr, BLOCK: tl.constexpr):
        """One token: the projection's gradient, the queries' and keys' gradients rotated back."""
        token = tl.program_id(0).to(tl.int64)
        j, partner, live, cos, sin = _token_tables(cos_ptr, sin_ptr, token % times, WIDTH, HEAD, BLOCK)
        row = grad_ptr + token * 3 * WIDTH
        _rotate_row(dq_ptr + token * WIDTH, row, j, partner, cos, sin, live, -1.0)
        _rotate_row(dk_ptr + token * WIDTH, row + WIDTH, j, partner, cos, sin, live, -1.0)
        tl.store(row + 2 * WIDTH + j, tl.load(dv_ptr + token * WIDTH + j, mask=live), mask=live)


def usable(qkv: Tensor) -> bool:
    """Whether the kernels can run on ``qkv`` here (compiled on a GPU, or interpreted)."""
    return runs_on(qkv)


def _launch(kernel, tensors: tuple[Tensor, ...], tables: tuple[Tensor, Tensor], shape: torch.Size) -> None:
    batch, times, _, heads, head = shape
    width = heads * head
    block = triton.next_power_of_2(width)
    if batch * times:
        kernel[(batch * times,)](*tensors, *tables, times, WIDTH=width, HEAD=head, BLOCK=block,
                                 num_warps=max(4, min(16, block // 256)))


@torch.library.custom_op("gpuaccel::rotary_qkv", mutates_args=())
def rotary_qkv(qkv: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(queries, keys, values), each (batch, time, heads, head_dim), from the projection ``qkv``
    (batch, time, 3, heads, head_dim): queries and keys rotated by the (time, head_dim) float32
    tables ``cos`` and ``sin`` (:func:`gpt.rotary_tables`, the rows of these positions)."""
    batch, times, _, heads, head = qkv.shape
    qkv = qkv.contiguous()
    q, k, v = (qkv.new_empty((batch, times, heads, head)) for _ in range(3))
    _launch(_rotary_kernel, (qkv, q, k, v), (cos.contiguous(), sin.contiguous()), qkv.shape)
    return q, k, v


@rotary_qkv.register_fake
def _(qkv, cos, sin):
    batch, times, _, heads, head = qkv.shape
    return tuple(qkv.new_empty((batch, times, heads, head)) for _ in range(3))


@torch.library.custom_op("gpuaccel::rotary_qkv_backward", mutates_args=())
def _rotary_qkv_backward(dq: Tensor, dk: Tensor, dv: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    batch, times, heads, head = dq.shape
    grad = dq.new_empty((batch, times, 3, heads, head))
    _launch(_rotary_gradient_kernel, (dq.contiguous(), dk.contiguous(), dv.contiguous(), grad),
            (cos.contiguous(), sin.contiguous()), grad.shape)
    return grad


@_rotary_qkv_backward.register_fake
def _(dq, dk, dv, cos, sin):
    batch, times, heads, head = dq.shape
    return dq.new_empty((batch, times, 3, heads, head))


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(inputs[1], inputs[2])


def _backward(ctx, dq, dk, dv):
    cos, sin = ctx.saved_tensors
    return _rotary_qkv_backward(dq, dk, dv, cos, sin), None, None


rotary_qkv.register_autograd(_backward, setup_context=_setup_context)
