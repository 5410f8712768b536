"""benchmarks/recipes/tune_recipe.py's emulation of N GPUs on one: the recipe numbers for several
GPUs that docs/results.md reports from one GPU rest on it."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
import torch.nn as nn

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "recipes" / "tune_recipe.py"


@pytest.fixture(scope="module")
def tune_recipe():
    spec = importlib.util.spec_from_file_location("tune_recipe", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def small_model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8, momentum=0.4), nn.GELU(),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))
    model[1].weight.data.uniform_(0.5, 1.5)
    model[1].bias.data.uniform_(-0.5, 0.5)
    return model


def loss_and_grads(model, x, y):
    loss = nn.functional.cross_entropy(model(x), y)
    return loss.detach(), torch.autograd.grad(loss, [p for p in model.parameters()])


@pytest.mark.parametrize("running", ["first", "mean"])
def test_one_process_with_batch_norm_groups_trains_as_that_many_processes_would(tune_recipe, running):
    """Three processes, each with a third of the batch, average their gradients (data parallelism's
    all-reduce); one process with ``batch_norm_groups(3)`` gets the same gradient from the whole batch,
    the same outputs, and running statistics of the first third (each process keeps its own) or of the
    thirds' mean."""
    x, y = torch.randn(12, 3, 6, 6), torch.randint(0, 4, (12,))
    processes = [small_model() for _ in range(3)]
    results = [loss_and_grads(m, x[4 * i:4 * i + 4], y[4 * i:4 * i + 4]) for i, m in enumerate(processes)]
    want_loss = torch.stack([loss for loss, _ in results]).mean()
    want_grads = [torch.stack(g).mean(0) for g in zip(*(grads for _, grads in results))]

    model = small_model()
    with tune_recipe.batch_norm_groups(3, running):
        loss, grads = loss_and_grads(model, x, y)
    torch.testing.assert_close(loss, want_loss)
    for got, want in zip(grads, want_grads):
        torch.testing.assert_close(got, want)
    norms = [m[1] for m in processes]
    for name in ("running_mean", "running_var"):
        stats = torch.stack([getattr(n, name) for n in norms])
        torch.testing.assert_close(getattr(model[1], name), stats[0] if running == "first" else stats.mean(0))


def test_batch_norm_groups_leaves_evaluation_and_batch_norm_itself_as_they_were(tune_recipe):
    model, x = small_model().eval(), torch.randn(5, 3, 6, 6)
    want, plain_forward = model(x), nn.modules.batchnorm._BatchNorm.forward
    with tune_recipe.batch_norm_groups(2):
        torch.testing.assert_close(model(x), want)  # evaluation uses the running statistics, not slices
        with pytest.raises(ValueError, match="does not split into 2"):
            model.train()(x)
    assert nn.modules.batchnorm._BatchNorm.forward is plain_forward
    model.train()(x)  # an odd batch trains again outside the block
