"""Pruning: channels really removed (and rebuilt from the stored structure), zeros kept through
fine-tuning, the pruned run usable by the other deploy commands, and the errors."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import assert_user_error, run

from gpuaccel import TrainConfig, Trainer, create_model
from gpuaccel.deploy import export, load_trained, verify
from gpuaccel.deploy.prune import prune_channels
from gpuaccel.models.structure import apply_structure, layer_structure

pytest.importorskip("torch_pruning")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("prune") / "run"
    Trainer(TrainConfig(model="lenet5", epochs=4, batch_size=32, run_dir=str(path)), quiet=True).fit()
    return path


@pytest.mark.parametrize("name", ["resnet18", "mobilenet_v2", "fastnet"])
def test_channel_pruning_shrinks_the_model_and_the_structure_rebuilds_it(name):
    torch.manual_seed(0)
    args = {"num_classes": 10, "in_channels": 3, "image_size": 32}
    model = create_model(name, **args).eval()
    before = sum(p.numel() for p in model.parameters())
    x = torch.rand(2, 3, 32, 32)
    prune_channels(model, 0.5, x[:1])
    after = sum(p.numel() for p in model.parameters())
    assert after < 0.45 * before  # half the channels on both sides of most weights: about a quarter left
    assert model(x).shape == (2, 10)
    # a fresh registry model reshaped to the stored widths takes the pruned weights exactly
    rebuilt = apply_structure(create_model(name, **args), layer_structure(model)).eval()
    rebuilt.load_state_dict(model.state_dict())
    torch.testing.assert_close(rebuilt(x), model(x))


def test_structured_prune_cli_fine_tunes_and_leaves_a_usable_run(run_dir, tmp_path, capsys):
    out = tmp_path / "pruned"
    code, stdout, err = run(capsys, "prune", str(run_dir), "--structured", "--sparsity", "0.5",
                            "--finetune-epochs", "2", "--out", str(out), "--json")
    assert code == 0, err
    report = json.loads(stdout)
    assert report["after"]["parameters"] < 0.6 * report["before"]["parameters"]
    assert report["after"]["flops_per_image"] < 0.6 * report["before"]["flops_per_image"]
    assert report["finetune"]["epochs"] == 2 and report["after"]["test_accuracy"] > 0.5
    # the latencies printed before and after are the speed-up's own alternating rounds: they agree with it
    ratio = report["before"]["latency_p50_ms"] / report["after"]["latency_p50_ms"]
    assert 0.8 * report["speedup_batch1_min"] <= ratio <= 1.25 * report["speedup_batch1_max"]
    assert json.loads((out / "prune.json").read_text())["method"] == "structured"
    trained = load_trained(out)  # rebuilt from the stored structure
    assert sum(p.numel() for p in trained.module.parameters()) == report["after"]["parameters"]
    artifact = export(trained, "onnx", tmp_path / "pruned.onnx", dynamic_batch=True)
    images = np.random.default_rng(0).integers(0, 256, (16, 1, 8, 8), dtype=np.uint8)
    assert verify(trained, artifact, images, dynamic_batch=True)["passed"]
    # and the pruned run can be trained on: resume it for one more epoch
    resumed = Trainer.resume(out, overrides={"epochs": 3}, quiet=True)
    assert resumed.fit()["epochs"] == 3


def test_unstructured_prune_keeps_its_zeros_through_fine_tuning(run_dir, tmp_path, capsys):
    out = tmp_path / "sparse"
    code, stdout, _ = run(capsys, "prune", str(run_dir), "--sparsity", "0.6", "--finetune-epochs", "0.5",
                          "--out", str(out), "--json")
    assert code == 0
    report = json.loads(stdout)
    weights = [m.weight for m in load_trained(out).module.modules() if isinstance(m, (torch.nn.Conv2d,
                                                                                       torch.nn.Linear))]
    zeros = sum(int((w == 0).sum()) for w in weights) / sum(w.numel() for w in weights)
    assert 0.59 < zeros < 0.62
    assert report["after"]["parameters"] == report["before"]["parameters"]
    assert report["finetune"]["epochs"] == 0.5  # (a fraction of an epoch is a number of epochs too)


def test_prune_errors(run_dir, tmp_path, capsys):
    assert_user_error(capsys, ["prune", str(run_dir), "--sparsity", "1.5"], "--sparsity", "(0, 1)")
    assert_user_error(capsys, ["prune", str(tmp_path / "nothing")], str(tmp_path / "nothing"))
    out = tmp_path / "again"
    assert run(capsys, "prune", str(run_dir), "--out", str(out), "--json")[0] == 0
    assert_user_error(capsys, ["prune", str(run_dir), "--out", str(out)], "already holds a model")
