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
    def _rotate_row(source, target, j, partner, cos, sin, live):
        """Stores one token's heads rotated: each lane ``j`` with its ``partner`` in the other half of its head."""
        x = tl.load(source + j, mask=live, other=0.0).to(tl.float32)
        swapped = tl.load(source + partner, mask=live, other=0.0).to(tl.float32)
        tl.store(target + j, (x * cos + swapped * sin).to(target.dtype.element_ty), mask=live)

    @triton.jit
    def _move(q_from, q_to, k_from, k_to, v_from, v_to, j, partner, cos, sin, live):
        """One token's queries and keys rotated, its values copied, from one place to another."""
        _rotate_row(q_from, q_to, j, partner, cos, sin, live)
        _rotate_row(k_from, k_to, j, partner, cos, sin, live)
        tl.store(v_to + j, tl.load(v_from + j, mask=live), mask=live)

    @triton.jit
    def _rotary_kernel(fused_ptr, q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, times, WIDTH: tl.constexpr,
                       HEAD: tl.constexpr, BLOCK: tl.constexpr, GRADIENT: tl.constexpr):
        """One token: its queries, keys and values out of the fused projection, the first two rotated;
        with ``GRADIENT``, the other way: their gradients into the projection's, rotated back."""
        token = tl.program_id(0).to(tl.int64)
        j = tl.arange(0, BLOCK)
        live = j < WIDTH
        d = j % HEAD
        partner = j + tl.where(d < HEAD // 2, HEAD // 2, -(HEAD // 2))
        cos = tl.load(cos_ptr + (token % times) * HEAD + d, mask=live, other=0.0)
        sin = tl.load(sin_ptr + (token % times) * HEAD + d, mask=live, other=0.0)  # (signed: -sin on first halves)
        fused = fused_ptr + token * 3 * WIDTH
        q = q_ptr + token * WIDTH
        k = k_ptr + token * WIDTH
        v = v_ptr + token * WIDTH
        if GRADIENT:  # (the inverse rotation: the sines negated)
            _move(q, fused, k, fused + WIDTH, v, fused + 2 * WIDTH, j, partner, cos, -sin, live)
        else:
            _move(fused, q, fused + WIDTH, k, fused + 2 * WIDTH, v, j, partner, cos, sin, live)


def usable(qkv: Tensor) -> bool:
    """Whether the kernels can run on ``qkv`` here (compiled on a GPU, or interpreted)."""
    return runs_on(qkv)


def _launch(fused: Tensor, q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, gradient: bool) -> None:
    batch, times, _, heads, head = fused.shape
    width = heads * head
    block = triton.next_power_of_2(width)
    if batch * times:
        _rotary_kernel[(batch * times,)](fused, q, k, v, cos.contiguous(), sin.contiguous(), times, WIDTH=width,
                                         HEAD=head, BLOCK=block, GRADIENT=gradient,
                                         num_warps=max(4, min(16, block // 256)))


@torch.library.custom_op("gpuaccel::rotary_qkv", mutates_args=())
def rotary_qkv(qkv: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(queries, keys, values), each (batch, time, heads, head_dim), from the projection ``qkv``
    (batch, time, 3, heads, head_dim): queries and keys rotated by the (time, head_dim) float32
    tables ``cos`` and ``sin`` (:func:`gpt.rotary_tables`, the rows of these positions)."""
    batch, times, _, heads, head = qkv.shape
    qkv = qkv.contiguous()
    q, k, v = (qkv.new_empty((batch, times, heads, head)) for _ in range(3))
    _launch(qkv, q, k, v, cos, sin, gradient=False)
    return q, k, v


@rotary_qkv.register_fake
def _(qkv, cos, sin):
    batch, times, _, heads, head = qkv.shape
    return tuple(qkv.new_empty((batch, times, heads, head)) for _ in range(3))


@torch.library.custom_op("gpuaccel::rotary_qkv_backward", mutates_args=())
def _rotary_qkv_backward(dq: Tensor, dk: Tensor, dv: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    batch, times, heads, head = dq.shape
    grad = dq.new_empty((batch, times, 3, heads, head))
    _launch(grad, dq.contiguous(), dk.contiguous(), dv.contiguous(), cos, sin, gradient=True)
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
