"""The pieces behind the speed recipes: whitening init, weight averaging, test-time
augmentation, the warm-up that leaves no trace, and recipe files."""

from __future__ import annotations

import json

import pytest
import torch

from gpuaccel import GpuaccelError, TrainConfig, Trainer, create_model, load_dataset
from gpuaccel.data.images import gpu_jpeg_decoder_available
from gpuaccel.models.layers import TritonMaxPool2d
from gpuaccel.train.ema import WeightAverage
from gpuaccel.train.recipes import list_recipes, load_recipe


def test_fastnet_first_layer_whitens_patches():
    torch.manual_seed(0)
    mix = torch.randn(12, 12)
    # correlated 2x2 patches: random images pushed through a fixed mixing of patch pixels
    images = torch.nn.functional.conv_transpose2d(torch.randn(256, 12, 8, 8), mix.view(12, 3, 2, 2), stride=2)
    model = create_model("fastnet")
    model.data_init(images)
    out = torch.nn.functional.conv2d(images, model.whiten.weight[:12])  # the positive half of the filters
    flat = out.permute(0, 2, 3, 1).reshape(-1, 12)
    cov = torch.cov(flat.T)
    assert torch.allclose(cov, torch.eye(12), atol=0.05)
    assert not model.whiten.weight.requires_grad and not model.whiten.bias.requires_grad


def test_fastnet_res_adds_each_stage_input_to_its_last_two_convolutions():
    torch.manual_seed(0)
    model = create_model("fastnet_res")
    assert [s.conv1.out_channels for s in model.stages] == [128, 384, 512]
    stage = model.stages[1]
    x = torch.randn(4, 128, 15, 15)
    with torch.no_grad():
        stage.conv3.weight.zero_()  # the residual branch then adds GELU(0) = 0
    stage.eval()
    assert isinstance(stage.pool, TritonMaxPool2d)  # gpuaccel's kernels on a GPU, PyTorch's here
    first = torch.nn.functional.gelu(stage.norm1(torch.nn.functional.max_pool2d(stage.conv1(x), 2)))
    torch.testing.assert_close(stage(x), first)
    with torch.no_grad():
        stage.conv3.weight.normal_()
    assert not torch.allclose(stage(x), first)
    logits = model(torch.randn(2, 3, 32, 32))
    assert logits.shape == (2, 10)


def test_weight_average_tracks_with_warmup_decay():
    model = torch.nn.Linear(3, 2)
    avg = WeightAverage(model, decay=0.9)
    start = avg.module.weight.clone()
    with torch.no_grad():
        model.weight.add_(1.0)
    avg.update(model)  # first decay is min(0.9, 2/11)
    d = 2 / 11
    torch.testing.assert_close(avg.module.weight, d * start + (1 - d) * model.weight)
    for _ in range(200):
        avg.update(model)
    torch.testing.assert_close(avg.module.weight, model.weight, atol=1e-6, rtol=0)
    restored = WeightAverage(model, 0.9)
    restored.load_state_dict(avg.state_dict())
    assert restored.updates == avg.updates


@pytest.fixture(scope="module")
def digits():
    return load_dataset("digits")


@pytest.mark.parametrize("tta", [0, 1, 2])
def test_tta_levels_evaluate(tmp_path, digits, tta):
    cfg = TrainConfig(model="lenet5", epochs=2, batch_size=32, tta=tta, ema=0.9, run_dir=str(tmp_path / "r"))
    summary = Trainer(cfg, dataset=digits, quiet=True).fit()
    assert summary["metrics"]["accuracy"] > 0.5


def test_tta_of_a_symmetric_model_changes_nothing(tmp_path, digits):
    trainer = Trainer(TrainConfig(model="mlp", tta=1, run_dir=str(tmp_path / "r")), dataset=digits, quiet=True)
    images = torch.rand(4, 1, 8, 8)
    symmetric = images + images.flip(-1)
    net = lambda x: x.flatten(1)[:, :3]  # noqa: E731 -- any function; mirrored inputs are identical
    torch.testing.assert_close(trainer.task.eval_outputs(net, symmetric), net(symmetric))
    assert trainer.task.tta == 1


def test_warm_up_leaves_no_trace(tmp_path, digits):
    cfg = TrainConfig(model="lenet5", ema=0.9, run_dir=str(tmp_path / "r"))
    trainer = Trainer(cfg, dataset=digits, quiet=True)
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    rng = torch.get_rng_state()
    trainer.warm_up()
    for k, v in trainer.model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert trainer.optimizer.state_dict()["state"] == {}
    assert trainer.scheduler.last_epoch == 0 and trainer.ema.updates == 0
    assert torch.equal(torch.get_rng_state(), rng)


def test_progressive_resizing_trains_small_first_and_warms_every_size(tmp_path, cifar_dir):
    cfg = TrainConfig(data=str(cifar_dir / "cifar-10-batches-py"), model="fastnet", epochs=2, batch_size=20,
                      model_args={"widths": [8, 16, 16]}, size_schedule=["16:1"], brightness=0.1, contrast=0.1,
                      crop_padding=2, flip="alternate", optimizer="muon", device="cpu", monitor=False,
                      run_dir=str(tmp_path / "r"))
    trainer = Trainer(cfg, quiet=True)
    first = next(iter(trainer.train_loader.batches(0)))
    assert [x.shape[-1] for x, _ in trainer._each_training_shape(*first)] == [16, 32]
    sides = []
    trainer.model.register_forward_pre_hook(lambda module, args: sides.append((module.training, args[0].shape[-1])))
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    trainer.warm_up()  # trains each shape three steps, then puts everything back
    assert sorted({side for _, side in sides}) == [16, 32]
    assert all(torch.equal(v, before[k]) for k, v in trainer.model.state_dict().items())
    sides.clear()
    checks = []  # the task's check of the first batch: one forward pass on two of its samples
    trainer.model.register_forward_pre_hook(lambda module, args: checks.append(args[0].shape[0] == 2))
    trainer.fit()
    evaluated = [side for (is_training, side), check in zip(sides, checks) if not is_training and not check]
    training = [side for is_training, side in sides if is_training]
    assert training == [16] * 5 + [32] * 5  # 100 images, batches of 20: epoch 0 at 16 px, epoch 1 at full size
    assert set(evaluated) == {32} and checks.count(True) == 1  # evaluated at full size
    assert json.loads((tmp_path / "r" / "config.json").read_text())["data"]["size_schedule"] == ["16:1"]


@pytest.mark.parametrize("options, needle", [({"size_schedule": ["24"]}, "SIZE:EPOCHS"),
                                             ({"brightness": 1.5}, "brightness must be"),
                                             ({"contrast": -0.1}, "contrast must be")])
def test_resizing_and_jitter_options_are_checked(options, needle):
    with pytest.raises(GpuaccelError, match=needle):
        TrainConfig(**options).validate()


def test_shipped_recipes_are_valid_configs():
    assert {"digits", "cifar10-fast", "cifar10-accurate"} <= set(list_recipes())
    for name in list_recipes():
        TrainConfig.from_dict(load_recipe(name)).validate()


def test_user_recipe_file_and_errors(tmp_path):
    good = tmp_path / "mine.yaml"
    good.write_text("model: mlp\nepochs: 3\n")
    assert load_recipe(str(good)) == {"model": "mlp", "epochs": 3}
    bad = tmp_path / "bad.yaml"
    bad.write_text("modle: mlp\n")
    with pytest.raises(GpuaccelError, match="unknown training setting"):
        TrainConfig.from_dict(load_recipe(str(bad)))
    broken = tmp_path / "broken.yaml"
    broken.write_text("model: [unclosed\n")
    with pytest.raises(GpuaccelError, match="not valid YAML"):
        load_recipe(str(broken))


def test_model_arguments_change_a_recipes_key_by_key_and_another_model_drops_them():
    from gpuaccel.train.recipes import training_settings

    gpt2 = training_settings({"model_args": {"activation": "gelu"}}, "gpt2-small")
    assert gpt2["model_args"] == {**load_recipe("gpt2-small")["model_args"], "activation": "gelu"}
    assert gpt2["model_args"]["layers"] == 12
    assert training_settings({"model": "resnet18"}, "cifar10-fast")["model_args"] is None
    assert training_settings({"model": "resnet18", "model_args": {"width": 2}}, "cifar10-fast")["model_args"] == \
        {"width": 2}
    assert training_settings({"epochs": 1}, "cifar10-fast")["model_args"] == {"activation": "silu"}


def test_gpu_jpeg_decoding_only_with_a_cuda_device():
    assert not gpu_jpeg_decoder_available(None)
    assert not gpu_jpeg_decoder_available(torch.device("cpu"))


def test_bias_lr_scale_sets_the_second_group():
    from gpuaccel.train.optim import build_optimizer
    model = create_model("lenet5", image_size=8)
    opt = build_optimizer(model, TrainConfig(lr=0.1, bias_lr_scale=4.0).optimizer)
    assert [g["lr"] for g in opt.param_groups] == [0.1, pytest.approx(0.4)]
    assert opt.param_groups[1]["weight_decay"] == 0.0
    assert all(p.ndim == 1 for p in opt.param_groups[1]["params"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="what a recipe does on a machine without a GPU")
def test_a_recipe_that_compiles_for_gpus_runs_uncompiled_on_a_cpu_unless_asked(capsys):
    from gpuaccel.cli import main

    assert main(["train", "--recipe", "cifar10-fast", "--print-config"]) == 0
    out, err = capsys.readouterr()
    assert "compile: false" in out and "the cifar10-fast recipe compiles its model for GPUs" in err
    assert "--compile compiles anyway" in err
    assert main(["train", "--recipe", "cifar10-fast", "--compile", "--print-config"]) == 0
    out, err = capsys.readouterr()
    assert "compile: true" in out and "note" not in err


def test_compile_regions_compiles_each_copy_of_the_repeated_block_and_nothing_else(tmp_path):
    """--compile-regions: the gpt's layers (one nn.ModuleList of one class) are compiled in place,
    the model around them is not; a model without repeated blocks is compiled whole."""
    from gpuaccel.compiling import compile_regions

    config = TrainConfig(data=str(tmp_path / "t.txt"), model="gpt", model_args={"layers": 3, "heads": 2, "width": 16},
                         context=8, batch_size=4, device="cpu", compile=True, compile_regions=True,
                         run_dir=str(tmp_path / "run"), monitor=False)
    (tmp_path / "t.txt").write_text("to be or not to be, that is the question " * 40)
    trainer = Trainer(config, quiet=True)
    blocks = [m for m in trainer.model.modules() if isinstance(m, torch.nn.ModuleList)][0]
    assert trainer.forward is trainer.model and len(blocks) == 3
    assert all(block._compiled_call_impl is not None for block in blocks)
    assert trainer.model._compiled_call_impl is None
    flat = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
    assert compile_regions(flat, "default") == 0 and flat._compiled_call_impl is None
