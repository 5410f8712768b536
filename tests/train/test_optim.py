"""Muon: orthogonalised updates for convolution filters, PyTorch's SGD for everything else."""

from __future__ import annotations

import pytest
import torch

from gpuaccel import TrainConfig, create_model
from gpuaccel.train.optim import Muon, orthogonalize


@pytest.mark.parametrize("shape", [(3, 16, 72), (2, 50, 12)])
def test_orthogonalize_brings_every_singular_value_near_one(shape):
    torch.manual_seed(0)
    # badly conditioned on purpose: singular values spread over two orders of magnitude (five
    # quintic steps lift one of 1e-3 of the largest only to about 0.4)
    u, _, v = torch.linalg.svd(torch.randn(shape), full_matrices=False)
    spread = torch.logspace(0, -2, min(shape[1:]))
    matrices = u @ torch.diag_embed(spread.expand(shape[0], -1)) @ v
    result = orthogonalize(matrices).float()
    assert result.shape == matrices.shape
    singular = torch.linalg.svdvals(result)
    assert singular.min() > 0.5 and singular.max() < 1.3
    # the same singular vectors: U V^T up to the leftover spread of the singular values
    exact = u @ v
    cosine = (result * exact).sum((1, 2)) / (result.norm(dim=(1, 2)) * exact.norm(dim=(1, 2)))
    assert cosine.min() > 0.95


def test_groups_without_orthogonalisation_step_like_pytorch_sgd():
    torch.manual_seed(0)
    params = [torch.randn(5, 4, requires_grad=True), torch.randn(5, requires_grad=True)]
    copies = [p.detach().clone().requires_grad_() for p in params]
    ours = Muon([{"params": params[:1], "weight_decay": 0.01}, {"params": params[1:], "lr": 0.3}],
                lr=0.1, momentum=0.8, nesterov=True)
    theirs = torch.optim.SGD([{"params": copies[:1], "weight_decay": 0.01}, {"params": copies[1:], "lr": 0.3}],
                             lr=0.1, momentum=0.8, nesterov=True)
    for step in range(4):
        grads = [torch.randn_like(p) for p in params]
        for group, opt in ((params, ours), (copies, theirs)):
            for p, g in zip(group, grads):
                p.grad = g.clone()
            opt.step()
    for p, q in zip(params, copies):
        assert torch.allclose(p, q, atol=1e-6)


@pytest.mark.parametrize("tensor_lr", [False, True])
def test_filters_are_renormalised_then_moved_by_the_orthogonalised_momentum(tensor_lr):
    torch.manual_seed(0)
    # 8 output channels: one batched iteration, the narrower two padded (one of them tall)
    a, b, c, d = torch.randn(8, 3, 3, 3), torch.randn(8, 3, 3, 3), torch.randn(8, 2, 1, 1), torch.randn(8, 5, 1, 1)
    e = torch.randn(4, 8, 1, 1)
    params = [t.clone().requires_grad_() for t in (a, b, c, d, e)]
    lr = torch.tensor(0.05) if tensor_lr else 0.05
    opt = Muon([{"params": params, "orthogonalize": True, "lr": lr}], momentum=0.5, nesterov=True)
    grads = [[torch.randn_like(p) for p in params] for _ in range(2)]
    expected = [t.clone() for t in (a, b, c, d, e)]
    buffers = [torch.zeros_like(t) for t in expected]
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.clone()
        opt.step()
        for i, g in enumerate(step_grads):
            buffers[i] = 0.5 * buffers[i] + g
            update = (g + 0.5 * buffers[i]).reshape(len(g), -1)
            scale = max(1.0, update.size(0) / update.size(1)) ** 0.5
            w = expected[i] * len(g) ** 0.5 / expected[i].norm()
            expected[i] = w - 0.05 * scale * orthogonalize(update[None])[0].float().view_as(g)
    # bf16 iterations over padded and unpadded matrices round differently: up to 3% of an update
    # (about 0.1 here); a wrong scale, slice or renormalisation is off by far more
    for p, want in zip(params, expected):
        assert torch.allclose(p.detach(), want, atol=5e-3)


def test_build_optimizer_orthogonalises_only_convolution_filters():
    model = create_model("lenet5", image_size=8)
    opt = TrainConfig(optimizer="muon", lr=0.1, bias_lr_scale=4.0, muon_lr=0.2,
                      muon_ns_steps=3).optimizer.build(model)  # the section builds its optimizer
    assert isinstance(opt, Muon)
    weights, biases, filters = opt.param_groups
    assert all(p.ndim == 4 for p in filters["params"]) and filters["orthogonalize"] and filters["lr"] == 0.2
    assert filters["momentum"] == 0.6 and filters["ns_steps"] == 3
    assert all(p.ndim == 2 for p in weights["params"]) and not weights["orthogonalize"] and weights["lr"] == 0.1
    assert all(p.ndim == 1 for p in biases["params"]) and biases["lr"] == pytest.approx(0.4)
    conv_count = sum(1 for m in model.modules() if isinstance(m, torch.nn.Conv2d))
    assert len(filters["params"]) == conv_count > 0


def test_small_filter_banks_orthogonalise_in_one_padded_batch_as_they_would_apart():
    from gpuaccel.train.optim import muon_update, newton_schulz_batches

    shapes = [(8, 27), (8, 2), (4, 8), (16, 72)]
    assert newton_schulz_batches(shapes) == [[0, 1, 2, 3]]
    assert newton_schulz_batches([(1024, 9216)] * 2 + [(64, 576)]) == [[0, 1], [2]]  # (large: one per row count)
    torch.manual_seed(0)
    params = [torch.randn(r, c) for r, c in shapes]
    grads = [torch.randn_like(p) for p in params]
    together, apart = [p.clone() for p in params], [p.clone() for p in params]
    muon_update(together, grads, [], 0.1, 0.0, False, 5, [[0, 1, 2, 3]])
    muon_update(apart, grads, [], 0.1, 0.0, False, 5, [[0, 1], [2], [3]])
    # zero rows and columns change nothing but the bf16 products' rounding (one in 1e-3 of an
    # update here): a padded row or column leaking into a matrix would move it by the update's size
    for a, b, p in zip(together, apart, params):
        assert torch.allclose(a, b, atol=2e-3) and not torch.allclose(a, p, atol=1e-2)
