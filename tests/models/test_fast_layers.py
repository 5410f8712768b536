"""The GPU forms of the vision models' layers give PyTorch's results (values and gradients): the
ImageNet stem's space-to-depth convolution, Triton max pooling and FastNet's whitening kernel, on
the CPU (the kernels through Triton's interpreter) and, where there is one, on a GPU; batch norms
folded into ResNet-50's widening 1x1 convolutions, their statistics from the convolution's input;
``Linear``'s float32 weight gradient under CUDA autocast."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import assert_ran_interpreted, interpreted

from gpuaccel.compiling import compile_arguments
from gpuaccel.errors import GpuaccelError
from gpuaccel.models import create_model
from gpuaccel.models.layers import ConvBatchNormAct, Linear, SpaceToDepthConv2d, TritonMaxPool2d, conv_bn_act, \
    space_to_depth_conv2d
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


# Runs max_pool_kernel and small_conv_kernel through Triton's interpreter in one child process (the
# variable must be set before Triton is imported) and checks them against PyTorch's max pooling
# (values and gradients) and activation(conv2d).
_INTERPRETED_KERNELS = interpreted("pooling and whitening", r"""
import torch, torch.nn.functional as F
from gpuaccel.models import max_pool_kernel, small_conv_kernel
from gpuaccel.models.fastnet import FastNet
generator = torch.Generator().manual_seed(0)
cases = [((2, 5, 9, 11), 3, 2, 1, True), ((2, 70, 8, 8), 3, 2, 1, True), ((1, 3, 7, 7), 2, 2, 0, False),
         ((2, 4, 10, 9), 3, 1, 1, True), ((1, 2, 6, 6), 5, 3, 2, False),
         ((2, 6, 8, 8), 2, 2, 0, True)]  # (the last: FastNet's pooling)
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
    with torch.no_grad():  # (inference calls the kernel without the operator)
        assert torch.equal(max_pool_kernel.pooled(x, k, s, p)[0].nan_to_num(9.0), ref.nan_to_num(9.0))
    torch.testing.assert_close(got_grad, ref_grad)
    layout = torch.channels_last if channels_last else torch.contiguous_format
    assert out.is_contiguous(memory_format=layout) and got_grad.is_contiguous(memory_format=layout)
torch.library.opcheck(torch.ops.gpuaccel.max_pool2d,
                      (torch.randn(2, 4, 8, 8).to(memory_format=torch.channels_last).requires_grad_(), 3, 2, 1))

# (input, weight, channels last, activation): FastNet's whitening, an odd size and kernel, fewer pixels than a block
activations = {"gelu": F.gelu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"), "silu": F.silu}
for shape, weight_shape, channels_last, activation in [((3, 3, 32, 32), (24, 3, 2, 2), True, "gelu"),
                                                       ((1, 2, 9, 7), (5, 2, 3, 3), False, "gelu_tanh"),
                                                       ((2, 3, 5, 6), (24, 3, 2, 2), False, "silu")]:
    x = torch.randn(shape, generator=generator)
    x = x.to(memory_format=torch.channels_last) if channels_last else x
    weight, bias = torch.randn(weight_shape, generator=generator), torch.randn(weight_shape[0], generator=generator)
    assert small_conv_kernel.usable(x, weight, activation)
    out = small_conv_kernel.small_conv_activation(x, weight, bias, activation, torch.float32)
    torch.testing.assert_close(out, activations[activation](F.conv2d(x, weight, bias)))
    assert out.is_contiguous(memory_format=torch.channels_last)
torch.library.opcheck(torch.ops.gpuaccel.small_conv_activation,
                      (torch.randn(2, 3, 6, 6), torch.randn(24, 3, 2, 2), torch.randn(24), "gelu", torch.bfloat16))
calls, kernel = [], small_conv_kernel.small_conv_activation
small_conv_kernel.small_conv_activation = lambda *args: calls.append(args) or kernel(*args)
model = FastNet(activation="silu").eval()  # (no gradient reaches its frozen whitening: the model takes the kernel)
x = torch.randn(2, 3, 32, 32, generator=generator)
with torch.no_grad():
    features = model.stages(F.silu(model.whiten(x)))
    expected = model.head(F.max_pool2d(features, features.shape[-2:]).flatten(1)) * model.head_scale
    torch.testing.assert_close(model(x), expected)
assert len(calls) == 1 and calls[0][3] == "silu"
small_conv_kernel.small_conv_activation = kernel
print("kernels ok")
""")


def test_triton_pooling_and_whitening_kernels_match_pytorch(interpreted_runs):
    """Pooling with ties, NaN and windows of -inf; the whitening convolution and its activation."""
    assert_ran_interpreted(interpreted_runs, _INTERPRETED_KERNELS, "kernels ok")


@pytest.mark.parametrize("activation, act", [("silu", F.silu), ("gelu_tanh", lambda t: F.gelu(t, approximate="tanh"))])
def test_fastnet_applies_the_activation_it_is_given_everywhere(activation, act):
    torch.manual_seed(0)
    model = create_model("fastnet", required=("activation",), activation=activation).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        h = act(model.whiten(x))
        for stage in model.stages:
            h = act(stage.norm2(stage.conv2(act(stage.norm1(F.max_pool2d(stage.conv1(h), 2))))))
        torch.testing.assert_close(model(x), model.head(F.max_pool2d(h, h.shape[-2:]).flatten(1)) * model.head_scale)
    with pytest.raises(GpuaccelError, match="activation"):
        create_model("fastnet", activation="tanh")


@pytest.mark.gpu
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
    with torch.no_grad():
        assert torch.equal(stem[1](y), ref)


@pytest.mark.gpu
def test_a_run_avoiding_runtime_compiles_pools_with_atens_kernels_until_it_compiles(monkeypatch):
    """(Triton compiles the pooling kernels at their first call: seconds of a first uncompiled run,
    ``compiling.avoid_runtime_compiles``.)"""
    from gpuaccel.compiling import allow_runtime_compiles, avoid_runtime_compiles
    from gpuaccel.models import max_pool_kernel

    pool = TritonMaxPool2d(2)
    x = torch.randn(4, 8, 16, 16, device="cuda").to(memory_format=torch.channels_last).requires_grad_()
    calls = []
    monkeypatch.setattr(max_pool_kernel, "max_pool2d", lambda *a: calls.append(a) or (F.max_pool2d(*a),))
    avoid_runtime_compiles()
    try:
        assert torch.equal(pool(x), F.max_pool2d(x, 2, 2, 0)) and not calls
    finally:
        allow_runtime_compiles()
    pool(x)
    assert len(calls) == 1  # (the Triton kernels again once the run may compile)


def test_the_tuned_compile_mode_is_inductors_default_with_tuned_kernels():
    assert compile_arguments("tuned") == {"options": {"coordinate_descent_tuning": True}}
    assert compile_arguments("reduce-overhead") == {"mode": "reduce-overhead"}
    # --tune-kernels keeps the mode's own options (torch.compile takes a mode or options, not both)
    assert compile_arguments("default", tune_kernels=True) == compile_arguments("tuned")
    assert compile_arguments("reduce-overhead", tune_kernels=True)["options"] == \
        {"triton.cudagraphs": True, "coordinate_descent_tuning": True}
    TrainConfig(data="digits", compile=True, compile_mode="tuned").validate()
    with pytest.raises(GpuaccelError, match="compile mode"):
        TrainConfig(data="digits", compile=True, compile_mode="fastest").validate()
    compiled = torch.compile(lambda t: t * 2 + 1, dynamic=False, **compile_arguments("tuned"))
    assert torch.equal(compiled(torch.arange(4.0)), torch.arange(4.0) * 2 + 1)


def _twins(make, dtype=torch.float64, device="cpu"):
    """Two copies of ``make()`` in training mode, their batch norms' scales and shifts away from
    1 and 0."""
    torch.manual_seed(0)
    first = make().to(device, dtype).train()
    with torch.no_grad():
        for module in first.modules():
            if isinstance(module, nn.BatchNorm2d):
                module.weight.uniform_(0.5, 1.5)
                module.bias.uniform_(-0.5, 0.5)
    second = make().to(device, dtype).train()
    second.load_state_dict(first.state_dict())
    if device == "cuda":
        first, second = first.to(memory_format=torch.channels_last), second.to(memory_format=torch.channels_last)
    return first, second


def _after_one_step(module, x, grad, forward):
    """Output, input gradient, parameter gradients and buffers after one forward and backward."""
    x = x.clone().requires_grad_()
    out = forward(module, x)
    out.to(grad.dtype).backward(grad)
    return out, x.grad, [p.grad for p in module.parameters()], list(module.buffers())


def _assert_same_step(got, expected, **tolerance):
    torch.testing.assert_close(got[0].to(expected[0].dtype), expected[0], **tolerance)
    torch.testing.assert_close(got[1], expected[1], **tolerance)
    for group in (2, 3):  # parameter gradients; running means, variances and batch counts
        for g, e in zip(got[group], expected[group]):
            torch.testing.assert_close(g, e, **tolerance)


def _step_both(plain, fused, x, plain_forward, fused_forward):
    grad = torch.randn(plain_forward(plain, x).shape, dtype=torch.float64 if x.dtype == torch.float64 else
                       torch.float32, device=x.device)
    plain.load_state_dict(fused.state_dict())  # undo that call's running-statistics update
    return _after_one_step(fused, x, grad, fused_forward), _after_one_step(plain, x, grad, plain_forward)


@pytest.mark.parametrize("act", [None, nn.ReLU])
def test_batch_norm_statistics_from_the_inputs_gram_matrix_give_the_modules_results(act, monkeypatch):
    """A widening 1x1 convolution (ResNet's expansion) whose batch norm takes its statistics
    from the convolution's input: the same outputs, gradients and running statistics, and the
    same under torch.compile."""
    from gpuaccel.models import layers
    monkeypatch.setattr(layers, "FOLD_BATCH_NORMS", True)
    plain, fused = _twins(lambda: conv_bn_act(8, 32, 1, act=act))
    assert fused.fusable() and fused.widening_1x1()
    x = torch.randn(4, 8, 10, 10, dtype=torch.float64).contiguous(memory_format=torch.channels_last)
    _assert_same_step(*_step_both(plain, fused, x, nn.Sequential.forward, ConvBatchNormAct.gram_forward))
    plain, fused = _twins(lambda: conv_bn_act(8, 32, 1, act=act), torch.float32)
    compiled = torch.compile(ConvBatchNormAct.gram_forward, backend="aot_eager", fullgraph=True)
    _assert_same_step(*_step_both(plain, fused, x.float(), nn.Sequential.forward, compiled), rtol=1e-4, atol=1e-4)
    # under autocast, as the Trainer runs ResNet's expansions (no activation): bf16 activations,
    # fp32 statistics. (With a ReLU, bf16 rounding flips some of its units in either path, and
    # both paths' gradients are a few percent from fp64's.)
    if act is None:
        _assert_same_step_in_norm(*_step_both(plain, fused, x.float(), _autocast(nn.Sequential.forward, "cpu"),
                                              _autocast(ConvBatchNormAct.gram_forward, "cpu")))
    assert fused[1].running_var.dtype == torch.float32
    # only where the input is the smaller tensor, at stride 1 (the other convolutions keep theirs)
    assert not conv_bn_act(32, 8, 1).widening_1x1() and not conv_bn_act(8, 32, 3).widening_1x1()
    assert not conv_bn_act(8, 32, 1, 2).widening_1x1()
    model = create_model("resnet50", num_classes=10, image_size=224)
    assert model.stages[0][0].conv3.widening_1x1() and not model.stages[0][0].conv1.widening_1x1()


def _assert_same_step_in_norm(got, expected, tolerance=1e-2):
    """As :func:`_assert_same_step`, each tensor within ``tolerance`` of the expected one's norm:
    in bf16 a few elements of a sum round differently, and gradients carry that on."""
    pairs = [(got[0], expected[0]), (got[1], expected[1]), *zip(got[2], expected[2]), *zip(got[3], expected[3])]
    for g, e in pairs:
        g, e = g.double(), e.double()
        assert (g - e).norm() <= tolerance * e.norm() + 1e-6, (g - e).norm() / e.norm()


def _autocast(forward, device):
    def run(module, x):
        with torch.autocast(device, dtype=torch.bfloat16):
            return forward(module, x)
    return run


@pytest.mark.gpu
def test_gram_statistics_on_a_gpu_match_the_module_in_bf16_under_compile(monkeypatch):
    from gpuaccel.models import layers
    monkeypatch.setattr(layers, "FOLD_BATCH_NORMS", True)
    plain, fused = _twins(lambda: conv_bn_act(64, 256, 1, act=None), torch.float32, "cuda")
    x = torch.relu(torch.randn(8, 64, 14, 14, device="cuda")).contiguous(memory_format=torch.channels_last)
    compiled = torch.compile(ConvBatchNormAct.gram_forward)
    _assert_same_step_in_norm(*_step_both(plain, fused, x, _autocast(nn.Sequential.forward, "cuda"),
                                          _autocast(compiled, "cuda")))


@pytest.mark.gpu
def test_batch_norms_fold_only_where_the_step_is_compiled(monkeypatch):
    """Eager, a widening 1x1 convolution runs as nn.Sequential does (the fold's small operations
    would each be launched from Python every step); traced by torch.compile, it folds."""
    from gpuaccel.models import layers
    monkeypatch.setattr(layers, "FOLD_BATCH_NORMS", True)
    block = conv_bn_act(64, 256, 1, act=None).cuda().train()
    x = torch.randn(8, 64, 14, 14, device="cuda").contiguous(memory_format=torch.channels_last)
    folded = []
    fold = ConvBatchNormAct.gram_forward
    monkeypatch.setattr(ConvBatchNormAct, "gram_forward", lambda self, x: folded.append(1) or fold(self, x))
    block(x)
    assert not folded
    torch.compile(block, backend="aot_eager")(x)
    assert folded


@pytest.mark.gpu
def test_fastnets_whitening_kernel_on_a_gpu_matches_pytorch_compiled_under_bf16(monkeypatch):
    from gpuaccel.models import small_conv_kernel
    from gpuaccel.models.fastnet import whiten_activation

    torch.manual_seed(0)
    conv = create_model("fastnet").cuda().whiten
    x = torch.randn(64, 3, 32, 32, device="cuda").to(memory_format=torch.channels_last)
    calls, kernel = [], small_conv_kernel.small_conv_activation
    with monkeypatch.context() as patch, torch.no_grad():
        patch.setattr(small_conv_kernel, "small_conv_activation", lambda *args: calls.append(args) or kernel(*args))
        whiten_activation(x, conv)
    assert len(calls) == 1  # (the kernel, not the convolution, where no gradient reaches the layer)
    with torch.autocast("cuda", dtype=torch.bfloat16), torch.no_grad():
        out = torch.compile(whiten_activation)(x, conv)
        expected = F.gelu(conv(x))
    assert out.dtype == torch.bfloat16 and out.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(out.float(), expected.float(), atol=0.05, rtol=0.02)


@pytest.mark.gpu
@pytest.mark.parametrize("compiled", [False, True])
def test_linear_under_autocast_gets_its_weight_gradient_in_float32_from_the_bf16_operands(compiled):
    """The output and the input's gradient are autocast's ``nn.Linear``'s; the weight's (and the
    bias's) are the same product without its rounding to bf16: nearer the exact product of the
    bf16 operands."""
    torch.manual_seed(0)
    linear = Linear(256, 384).cuda()
    plain = nn.Linear(256, 384).cuda()
    plain.load_state_dict(linear.state_dict())
    x = torch.randn(4, 512, 256, device="cuda", requires_grad=True)
    grad = torch.randn(4, 512, 384, device="cuda")
    results = []
    for layer in (linear, plain):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = (torch.compile(layer) if compiled else layer)(x)
        results.append((out, *torch.autograd.grad(out, (x, layer.weight, layer.bias), grad)))
    (out, grad_x, grad_w, grad_b), (out_ref, grad_x_ref, grad_w_ref, grad_b_ref) = results
    assert out.dtype == torch.bfloat16 and grad_x.dtype == grad_w.dtype == torch.float32
    torch.testing.assert_close(out, out_ref, **({} if compiled else {"atol": 0, "rtol": 0}))
    torch.testing.assert_close(grad_x, grad_x_ref)
    g16, x16 = grad.to(torch.bfloat16).double().flatten(0, 1), x.detach().to(torch.bfloat16).double().flatten(0, 1)
    exact_w, exact_b = (g16.t() @ x16).float(), g16.sum(0).float()
    error, error_ref = (grad_w - exact_w).norm(), (grad_w_ref - exact_w).norm()
    assert error < 0.5 * error_ref, (error, error_ref)
    torch.testing.assert_close(grad_b, exact_b, atol=1e-3, rtol=1e-4)
    with torch.autocast("cuda", dtype=torch.bfloat16), torch.no_grad():  # (evaluation: nn.Linear's own)
        assert torch.equal(linear(x), plain(x))
