"""The registry builds every model for any image size and channel count."""

from __future__ import annotations

import math
import sys

import pytest
import torch

from gpuaccel import GpuaccelError, create_model, list_models


@pytest.mark.parametrize("name", ["mlp", "lenet5", "resnet18", "resnet34", "resnet50", "mobilenet_v2"])
@pytest.mark.parametrize("size,channels", [(8, 1), (32, 3), (64, 3)])
def test_every_model_maps_images_to_class_logits(name, size, channels):
    if name in ("resnet34", "resnet50", "mobilenet_v2") and size == 64:
        pytest.skip("the ImageNet stem is covered by resnet18; keeps the suite fast")
    model = create_model(name, num_classes=7, in_channels=channels, image_size=size).eval()
    with torch.no_grad():
        out = model(torch.randn(2, channels, size, size))
    assert out.shape == (2, 7) and torch.isfinite(out).all()


def test_resnet_stem_follows_image_size():
    small = create_model("resnet18", image_size=32)
    large = create_model("resnet18", image_size=224)
    assert small.stem[0].stride == (1, 1) and large.stem[0][0].stride == (2, 2)


def test_registry_lists_builtins():
    assert {"mlp", "lenet5", "resnet18", "resnet34", "resnet50", "mobilenet_v2"} <= set(list_models())


def test_only_models_that_ask_for_it_are_built_on_their_gpu():
    from gpuaccel.models.registry import builds_on_device
    from gpuaccel.runtime import holds_whole_model
    from gpuaccel.train import TrainConfig

    assert builds_on_device("gpt") and not builds_on_device("resnet50") and not builds_on_device("dlrm")
    assert holds_whole_model(TrainConfig(data="digits")) and holds_whole_model(TrainConfig(data="digits", shard=True))
    # (a pipeline stage, or shards offloaded to the host: only part of the model on each GPU)
    assert not holds_whole_model(TrainConfig(data="digits", pipeline_stages=2))
    assert not holds_whole_model(TrainConfig(data="digits", shard=True, offload="cpu"))


def test_unknown_model_lists_valid_names():
    with pytest.raises(GpuaccelError, match="unknown model 'resnet9000'.*lenet5.*resnet18"):
        create_model("resnet9000")


def test_user_model_from_module(tmp_path, monkeypatch):
    (tmp_path / "my_models.py").write_text(
        "import torch.nn as nn\n"
        "def tiny(num_classes, in_channels):\n"
        "    return nn.Sequential(nn.Flatten(), nn.LazyLinear(num_classes))\n"
        "def not_a_module(**kw):\n"
        "    return 42\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    model = create_model("my_models:tiny", num_classes=4, in_channels=1, image_size=8)
    assert model(torch.randn(3, 1, 8, 8)).shape == (3, 4)
    with pytest.raises(GpuaccelError, match="not a torch.nn.Module"):
        create_model("my_models:not_a_module")
    with pytest.raises(GpuaccelError, match="no callable 'missing'"):
        create_model("my_models:missing")
    with pytest.raises(GpuaccelError, match="cannot import"):
        create_model("no_such_module_xyz:f")


def test_timm_models_pass_through_or_explain(monkeypatch):
    if "timm" not in sys.modules:
        monkeypatch.setitem(sys.modules, "timm", None)  # make 'import timm' fail for sure
        with pytest.raises(GpuaccelError, match="pip install timm"):
            create_model("timm:resnet18")


def test_gpts_residual_stream_is_bf16_under_bf16_autocast_only_when_asked():
    """``residual_bf16``: the embedding's output and so each block's sum in bf16 under bf16
    autocast; float32 otherwise, and without autocast either way."""
    torch.manual_seed(0)
    ids = torch.randint(100, (2, 16))
    seen = []
    for residual_bf16, autocast in [(False, True), (True, True), (True, False)]:
        model = create_model("gpt", vocab_size=100, context_length=16, layers=2, heads=2, width=32,
                             residual_bf16=residual_bf16)
        model.blocks[1].register_forward_hook(lambda module, args, out: seen.append(out.dtype))
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(ids, labels=ids)["loss"]
        assert torch.isfinite(loss)
    assert seen == [torch.float32, torch.bfloat16, torch.float32]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_both_ways_of_writing_the_rotary_embedding_give_the_same_rotation(dtype):
    """gpt.py rotates with the halves swapped off a GPU and with the halves on one: the two must
    be the same function up to one rounding (the rolled form's fused multiply-add), and the pair
    (x1, x2) turned by each position's angle."""
    from gpuaccel.models.gpt import rotary_tables, rotate_halves, rotate_rolled

    cos, sin = rotary_tables(12, 8)
    x = torch.randn(2, 3, 12, 8).to(dtype)
    rolled, halves = rotate_rolled(x, cos, sin), rotate_halves(x, cos, sin)
    assert rolled.dtype == halves.dtype == dtype
    ulp = torch.finfo(dtype).eps * halves.float().abs().clamp_min(1.0)  # (one rounding of the result)
    assert ((rolled.float() - halves.float()).abs() <= ulp).all()
    angle = 5 * 10000.0 ** (-2 / 8)  # position 5, the second frequency
    x1, x2 = x[0, 0, 5, 1].float(), x[0, 0, 5, 5].float()
    turned = rotate_halves(x, cos, sin)[0, 0, 5].float()
    expected = torch.stack([x1 * math.cos(angle) - x2 * math.sin(angle), x2 * math.cos(angle) + x1 * math.sin(angle)])
    torch.testing.assert_close(torch.stack([turned[1], turned[5]]), expected.to(dtype).float(), atol=2e-2, rtol=1e-2)


def test_cpu_dropout_draws_its_own_mask_and_is_pytorchs_dropout_elsewhere():
    """layers.dropout on a CPU: each element kept with probability 1 - p and scaled by 1 / (1 - p),
    its gradient the same mask; dropout_add is the residual plus that; without training, or
    compiled, they are F.dropout's (no draw, no graph break)."""
    from gpuaccel.models.layers import Dropout, dropout, dropout_add

    p = 0.25
    x = torch.randn(200, 500, requires_grad=True)
    torch.manual_seed(3)
    out = dropout(x, p, True)
    torch.manual_seed(3)
    mask = (torch.rand(200, 500) >= p) / (1 - p)
    assert torch.equal(out, x * mask)
    assert abs((out == 0).float().mean().item() - p) < 0.01
    (grad,) = torch.autograd.grad(out, x, torch.ones_like(out))
    assert torch.equal(grad, mask)
    residual = torch.randn(200, 500)
    torch.manual_seed(3)
    torch.testing.assert_close(dropout_add(x, residual, p, True), residual + x * mask)  # (one rounding, not two)
    assert dropout(x, p, False) is x and torch.equal(dropout_add(x, residual, p, False), residual + x)
    module = Dropout(p)
    assert torch.equal(module.eval()(x), x)
    assert torch._dynamo.explain(module.train())(x).graph_break_count == 0


@pytest.mark.parametrize("causal", [True, False])
def test_cpu_attention_with_dropout_is_sdpas_reference_computation(causal):
    """layers.attention with dropout on a CPU: softmax(q k^T / sqrt(d), masked) with
    layers.dropout's mask, times v; without dropout it is F.scaled_dot_product_attention."""
    from gpuaccel.models.layers import attention

    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 7, 8) for _ in range(3))
    attend = torch.rand(2, 1, 1, 7) > 0.3
    attend[..., 0] = True  # (as SDPA computes it: every query attends to something)
    mask = None if causal else attend
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)
    torch.testing.assert_close(attention(q, k, v, 0.2, False, causal=causal, attend=mask), expected)
    torch.testing.assert_close(attention(q, k, v, 0.0, True, causal=causal, attend=mask), expected)
    scores = q @ k.transpose(-2, -1) / math.sqrt(8)
    blocked = torch.ones(7, 7, dtype=torch.bool).triu(1) if causal else ~attend
    weights = scores.masked_fill(blocked, float("-inf")).softmax(-1)
    torch.manual_seed(5)
    out = attention(q, k, v, 0.2, True, causal=causal, attend=mask)
    torch.manual_seed(5)
    keep = (torch.rand(2, 3, 7, 7) >= 0.2) / 0.8
    torch.testing.assert_close(out, (weights * keep) @ v)
    if not causal:  # a query with nothing to attend to (an empty sentence) gets numbers, not NaN
        assert attention(q, k, v, 0.2, True, attend=torch.zeros(2, 1, 1, 7, dtype=torch.bool)).isfinite().all()


@pytest.mark.parametrize("shape, normalized", [((4, 16, 32), 32), ((3, 5, 6, 10), (6, 10))])
def test_rmsnorm_with_its_gradient_by_hand_is_pytorchs_rmsnorm(shape, normalized):
    """layers.RMSNorm trains on a CPU through a hand-written gradient: the same outputs to the
    bit and the same gradients as nn.RMSNorm, the same parameters; without gradients it is
    nn.RMSNorm's own forward."""
    from gpuaccel.models.layers import RMSNorm

    torch.manual_seed(0)
    theirs, ours = torch.nn.RMSNorm(normalized), RMSNorm(normalized)
    with torch.no_grad():
        theirs.weight.normal_()
    ours.load_state_dict(theirs.state_dict())
    x, grad = torch.randn(*shape, requires_grad=True), torch.randn(*shape)
    out = ours(x)
    assert type(out.grad_fn).__name__ == "_RMSNormByHandBackward"
    assert torch.equal(out, theirs(x))
    for a, b in zip(torch.autograd.grad(out, [x, ours.weight], grad),
                    torch.autograd.grad(theirs(x), [x, theirs.weight], grad)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        assert torch.equal(ours(x), theirs(x))
    assert torch._dynamo.explain(ours)(x).graph_break_count == 0  # compiled, it is nn.RMSNorm: no break
    # the formula itself, in float64 against numerical derivatives
    from gpuaccel.models.layers import _RMSNormByHand

    dims = ours.weight.dim()
    assert torch.autograd.gradcheck(lambda v, w: _RMSNormByHand.apply(v, w, 1e-6, dims),
                                    (torch.randn(*shape, dtype=torch.double, requires_grad=True),
                                     torch.randn(ours.weight.shape, dtype=torch.double, requires_grad=True)))


def test_gpt_draws_every_weight_itself_from_the_seed():
    """GPT's linear layers skip PyTorch's own initialisation (models/gpt.py, ``linear``): every
    weight must still be drawn, GPT-2's way, and the same seed must give the same weights."""
    from gpuaccel.models.gpt import gpt

    def build():
        torch.manual_seed(3)
        return gpt(100, 16, layers=4, heads=2, width=64)

    first, second = build(), build()
    for (name, p), q in zip(first.named_parameters(), second.parameters()):
        assert torch.equal(p, q), name
        if p.ndim == 2:  # N(0, 0.02); the projections into the residual stream 0.02 / sqrt(2 x layers)
            std = 0.02 / math.sqrt(8) if name.endswith(("proj.weight", "down.weight")) else 0.02
            assert abs(p.std().item() - std) < 0.15 * std and abs(p.mean().item()) < 0.1 * std, name
        else:
            assert torch.equal(p, torch.ones_like(p)), name  # the norms' gains
