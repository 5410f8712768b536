"""The GPU forms of ResNet's ImageNet stem: the space-to-depth convolution and the Triton max
pooling give PyTorch's results (values and gradients), on the CPU (the kernels through Triton's
interpreter) and, where there is one, on a GPU."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from gpuaccel.compiling import compile_arguments
from gpuaccel.errors import GpuaccelError
from gpuaccel.models import create_model
from gpuaccel.models.layers import SpaceToDepthConv2d, TritonMaxPool2d, space_to_depth_conv2d
from gpuaccel.train import TrainConfig

# (height, width, kernel, stride, padding, in channels): ResNet's stem, odd sizes, a 3x3 stem,
# a stride that does not divide the kernel, no padding
GEOMETRIES = [(224, 224, 7, 2, 3, 3), (225, 223, 7, 2, 3, 3), (65, 66, 3, 2, 1, 3), (32, 31, 5, 3, 2, 1),
              (20, 21, 4, 2, 0, 2)]


@pytest.mark.parametrize("geometry", GEOMETRIES)
def test_space_to_depth_convolution_matches_the_strided_convolution(geometry):
    h, w, k, s, p, c = geometry
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, c, h, w, dtype=torch.float64, generator=generator, requires_grad=True)
    weight = torch.randn(5, c, k, k, dtype=torch.float64, generator=generator, requires_grad=True)
    bias = torch.randn(5, dtype=torch.float64, generator=generator)
    ref = F.conv2d(x, weight, bias, s, p)
    out = space_to_depth_conv2d(x, weight, bias, s, (p, p))
    assert out.shape == ref.shape
    torch.testing.assert_close(out, ref)
    grad = torch.randn_like(ref)
    expected = torch.autograd.grad(ref, (x, weight), grad)
    got = torch.autograd.grad(out, (x, weight), grad)
    for e, g in zip(expected, got):
        torch.testing.assert_close(g, e)


def test_the_resnet_stem_keeps_its_parameters_and_outputs():
    model = create_model("resnet50", num_classes=10, image_size=224)
    conv, pool = model.stem[0][0], model.stem[1]
    assert isinstance(conv, SpaceToDepthConv2d) and isinstance(pool, TritonMaxPool2d)
    assert "stem.0.0.weight" in model.state_dict()  # checkpoints of the plain stem still load
    x = torch.randn(2, 3, 64, 64)
    torch.testing.assert_close(conv(x), nn.Conv2d.forward(conv, x))  # the CPU path is PyTorch's own
    torch.testing.assert_close(pool(x), F.max_pool2d(x, 3, 2, 1))


# Runs max_pool_kernel through Triton's interpreter in a child process (the variable must be set
# before Triton is imported) and checks values and gradients against PyTorch's max pooling.
_INTERPRETED_POOLING = r"""
import torch, torch.nn.functional as F
from gpuaccel.models import max_pool_kernel
generator = torch.Generator().manual_seed(0)
cases = [((2, 5, 9, 11), 3, 2, 1, True), ((2, 70, 8, 8), 3, 2, 1, True), ((1, 3, 7, 7), 2, 2, 0, False),
         ((2, 4, 10, 9), 3, 1, 1, True), ((1, 2, 6, 6), 5, 3, 2, False)]
for shape, k, s, p, channels_last in cases:
    x = torch.randint(-3, 4, shape, generator=generator).float()  # small integers: many ties
    x[0, 0, 1, 1] = float("nan")
    x[0, 1, :3, :3] = float("-inf")
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    x.requires_grad_()
    ref = F.max_pool2d(x, k, s, p)
    grad = torch.randn(ref.shape, generator=generator)
    ref_grad, = torch.autograd.grad(ref, x, grad)
    out = max_pool_kernel.max_pool2d(x, k, s, p)[0]
    got_grad, = torch.autograd.grad(out, x, grad)
    assert torch.equal(torch.nan_to_num(out, 9.0), torch.nan_to_num(ref, 9.0)), (shape, k, s, p)
    torch.testing.assert_close(got_grad, ref_grad)
    layout = torch.channels_last if channels_last else torch.contiguous_format
    assert out.is_contiguous(memory_format=layout) and got_grad.is_contiguous(memory_format=layout)
torch.library.opcheck(torch.ops.gpuaccel.max_pool2d,
                      (torch.randn(2, 4, 8, 8).to(memory_format=torch.channels_last).requires_grad_(), 3, 2, 1))
print("pooling ok")
"""


def test_triton_max_pooling_matches_pytorch_with_ties_nan_and_empty_windows():
    pytest.importorskip("triton", reason="the test extra installs Triton; this environment lacks it")
    done = subprocess.run([sys.executable, "-c", _INTERPRETED_POOLING], capture_output=True, text=True,
                          env={**os.environ, "TRITON_INTERPRET": "1"})
    assert done.returncode == 0 and "pooling ok" in done.stdout, done.stderr[-3000:]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiles the kernels for a GPU")
def test_the_stem_on_a_gpu_matches_pytorch_in_bf16_and_under_compile():
    torch.manual_seed(0)
    model = create_model("resnet18", num_classes=10, image_size=224).cuda().to(memory_format=torch.channels_last)
    stem = model.stem
    x = torch.randn(8, 3, 224, 224, device="cuda").to(memory_format=torch.channels_last)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        fast = torch.compile(stem)(x)
        plain = F.max_pool2d(stem[0][2](stem[0][1](nn.Conv2d.forward(stem[0][0], x))), 3, 2, 1)
    torch.testing.assert_close(fast.float(), plain.float(), atol=0.05, rtol=0.02)
    y = torch.relu(torch.randn(16, 64, 112, 112, device="cuda", dtype=torch.bfloat16)).to(
        memory_format=torch.channels_last).requires_grad_()
    grad = torch.randn(16, 64, 56, 56, device="cuda", dtype=torch.bfloat16)
    ref = F.max_pool2d(y, 3, 2, 1)
    ref_grad, = torch.autograd.grad(ref, y, grad)
    out = stem[1](y)
    out_grad, = torch.autograd.grad(out, y, grad)
    assert torch.equal(out, ref) and torch.equal(out_grad, ref_grad)


def test_the_tuned_compile_mode_is_inductors_default_with_tuned_kernels():
    assert compile_arguments("tuned") == {"options": {"coordinate_descent_tuning": True}}
    assert compile_arguments("reduce-overhead") == {"mode": "reduce-overhead"}
    TrainConfig(data="digits", compile=True, compile_mode="tuned").validate()
    with pytest.raises(GpuaccelError, match="compile mode"):
        TrainConfig(data="digits", compile=True, compile_mode="fastest").validate()
    compiled = torch.compile(lambda t: t * 2 + 1, dynamic=False, **compile_arguments("tuned"))
    assert torch.equal(compiled(torch.arange(4.0)), torch.arange(4.0) * 2 + 1)
