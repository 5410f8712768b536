"""GPT's rotary kernels (models/rotary_kernel.py) rotate queries and keys as ``gpt.rotate`` does
and give the projection the gradient autograd gives: on the CPU through Triton's interpreter, and
on a GPU inside GPT, compiled under bf16 autocast, against GPT's PyTorch rotation."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_ran_interpreted, interpreted

from gpuaccel.models import create_model

# (batch, time, heads, head_dim, first position): heads x head_dim below a power of two (masked lanes)
# and at one, and positions that do not start at 0 (a key/value cache's)
_INTERPRETED_ROTARY = interpreted("rotary", r"""
import torch
import gpuaccel.models.gpt as gpt
from gpuaccel.models import create_model, rotary_kernel
from gpuaccel.models.gpt import rotary_tables, rotate_halves
generator = torch.Generator().manual_seed(0)
for batch, times, heads, head, start in [(2, 5, 3, 8, 0), (1, 4, 2, 16, 3)]:
    cos, sin = (table[start:start + times] for table in rotary_tables(8, head))
    qkv = torch.randn(batch, times, 3, heads, head, generator=generator, requires_grad=True)
    got = rotary_kernel.rotary_qkv(qkv, cos, sin)
    expected = [rotate_halves(qkv[:, :, i], cos[:, None], sin[:, None]) for i in (0, 1)] + [qkv[:, :, 2]]
    for tensor, reference in zip(got, expected):
        assert tensor.shape == (batch, times, heads, head) and tensor.is_contiguous()
        torch.testing.assert_close(tensor, reference)
    grads = [torch.randn(got[0].shape, generator=generator) for _ in range(3)]
    torch.testing.assert_close(torch.autograd.grad(got, qkv, grads)[0], torch.autograd.grad(expected, qkv, grads)[0])
cos, sin = rotary_tables(5, 8)
qkv = torch.randn(2, 5, 3, 2, 8, generator=generator).bfloat16()
q = rotary_kernel.rotary_qkv(qkv, cos, sin)[0]  # (the interpreter rounds float32 to bf16 toward zero: not equal)
assert q.dtype == torch.bfloat16
torch.testing.assert_close(q, rotate_halves(qkv[:, :, 0], cos[:, None], sin[:, None]))
torch.library.opcheck(torch.ops.gpuaccel.rotary_qkv, (torch.randn(2, 5, 3, 2, 8, requires_grad=True), cos, sin))
# GPT rotates with the kernels where gradients are taken, in PyTorch elsewhere: the same logits
kernel, calls = gpt.rotary_qkv, []
gpt.rotary_qkv = lambda *args: calls.append(1) or kernel(*args)
model = create_model("gpt", vocab_size=50, context_length=16, layers=2, heads=2, width=16)
ids = torch.randint(50, (2, 12), generator=generator)
trained = model(ids)
with torch.no_grad():
    evaluated = model(ids)
torch.testing.assert_close(trained, evaluated)
assert calls == [1, 1], calls
gpt.rotary_qkv = kernel
print("rotary ok")
""")


def test_the_interpreted_kernels_rotate_as_gpt_does_and_give_autograds_gradient(interpreted_runs):
    assert_ran_interpreted(interpreted_runs, _INTERPRETED_ROTARY, "rotary ok")


@pytest.mark.gpu
def test_compiled_gpt_trains_with_the_kernels_as_with_pytorchs_rotation(monkeypatch):
    import gpuaccel.models.gpt as gpt

    torch.manual_seed(0)
    model = create_model("gpt", vocab_size=2048, context_length=128, layers=2, heads=4, width=256).cuda()
    ids = torch.randint(2048, (4, 128), device="cuda")
    results = []
    for kernels in (True, False):
        monkeypatch.setattr(gpt, "rotary_kernel_usable", lambda qkv, kernels=kernels: kernels)
        torch._dynamo.reset()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = torch.compile(model)(ids, labels=ids)["loss"]
        results.append((loss, torch.autograd.grad(loss, list(model.parameters()))))
    (loss, grads), (reference, reference_grads) = results
    torch.testing.assert_close(loss, reference, atol=1e-3, rtol=1e-3)
    for g, r in zip(grads, reference_grads):
        assert ((g - r).norm() / r.norm()) < 0.01
