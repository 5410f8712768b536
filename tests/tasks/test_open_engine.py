"""The open engine: a user's own data, model, loss and metrics, through the Python API."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import Dataset

import gpuaccel
from gpuaccel import GpuaccelError, TrainConfig, Trainer
from gpuaccel.runtime import PrefetchLoader, ResidentLoader
from gpuaccel.tasks import Classification, Regression


def config(tmp_path, name="run", **settings) -> TrainConfig:
    base = dict(device="cpu", epochs=4, batch_size=32, lr=0.05, monitor=False, run_dir=str(tmp_path / name))
    return TrainConfig(**{**base, **settings})


class Sequences(Dataset):
    """Token sequences whose label is the token that occurs most often: a GRU must count."""

    def __init__(self, n: int, seed: int, length: int = 12, vocab: int = 6):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randint(0, vocab, (n, length), generator=g)
        self.y = torch.stack([torch.bincount(row, minlength=vocab).argmax() for row in self.x])

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


class GRUClassifier(nn.Module):
    def __init__(self, vocab: int = 6, width: int = 48):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.gru = nn.GRU(width, width, batch_first=True)
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens):
        hidden, _ = self.gru(self.embed(tokens))
        return self.head(hidden[:, -1])


def test_own_dataset_model_and_loss_train_far_above_chance(tmp_path):
    torch.manual_seed(0)
    summary = Trainer(config(tmp_path, epochs=12, optimizer="adamw", lr=0.01, weight_decay=0.0),
                      model=GRUClassifier(), train_data=Sequences(1536, 0), eval_data=Sequences(512, 1),
                      loss_fn=F.cross_entropy,
                      metrics={"accuracy": lambda out, y: (out.argmax(1) == y).float().mean()},
                      quiet=True).fit()
    # chance is about 1/6 (a little more: ties go to the smallest token)
    assert summary["metrics"]["accuracy"] > 0.6, summary["metrics"]
    assert summary["task"] == "custom" and summary["model"] == "object:GRUClassifier"
    assert summary["train_samples"] == 1536 and summary["test_samples"] == 512


def test_dataset_that_fits_is_gathered_on_the_device_and_random_items_are_not(tmp_path):
    trainer = Trainer(config(tmp_path, "a"), model=GRUClassifier(), train_data=Sequences(64, 0),
                      eval_data=Sequences(32, 1), loss_fn=F.cross_entropy, quiet=True)
    assert isinstance(trainer.train_loader, ResidentLoader)

    class Noisy(Sequences):  # augmentation inside __getitem__: items differ from read to read
        def __getitem__(self, i):
            return self.x[i], self.y[i], torch.rand(())

    trainer = Trainer(config(tmp_path, "b", workers=0), model=GRUClassifier(), train_data=Noisy(64, 0),
                      loss_fn=lambda out, y: F.cross_entropy(out, y), quiet=True)
    assert isinstance(trainer.train_loader, PrefetchLoader)
    inputs, targets = trainer.task.split(next(iter(trainer.train_loader.batches(0))))
    assert len(inputs) == 2 and targets.dtype == torch.float32  # (tokens, label) inputs, the noise as target


def linear_data(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 5, generator=g)
    y = x @ torch.tensor([1.5, -2.0, 0.5, 0.0, 3.0]) + 0.7
    return x, y


def test_regression_on_tensors_reports_rmse_and_keeps_float_targets(tmp_path):
    summary = Trainer(config(tmp_path, epochs=15, optimizer="adamw", lr=0.05, weight_decay=0.0,
                             schedule="constant"),
                      model=nn.Linear(5, 1), train_data=linear_data(512, 0), eval_data=linear_data(256, 1),
                      task=Regression(), quiet=True).fit()
    records = [json.loads(line) for line in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    assert set(summary["metrics"]) == {"loss", "rmse", "mae"} and "test_accuracy" not in summary
    # the targets' spread is about 3.7: a model that learnt nothing has an RMSE near it
    assert records[-1]["rmse"] < 0.3 * records[0]["rmse"] and summary["metrics"]["rmse"] < 0.5
    assert summary["best_metrics"]["rmse"] == pytest.approx(min(r["rmse"] for r in records), abs=1e-6)  # lower: better


def test_per_pixel_classification_with_a_user_metric(tmp_path):
    g = torch.Generator().manual_seed(0)
    images = torch.rand(256, 1, 8, 8, generator=g)
    labels = (images[:, 0] > 0.5).long()  # per pixel: bright or not

    def pixel_accuracy(out, y):
        return (out.argmax(1) == y).float().mean()

    model = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 2, 1))
    summary = Trainer(config(tmp_path, epochs=6, lr=0.2), model=model, train_data=(images, labels),
                      loss_fn=F.cross_entropy, metrics={"pixel_accuracy": pixel_accuracy},
                      quiet=True).fit()
    assert 0.9 < summary["metrics"]["pixel_accuracy"] <= 1.0
    assert summary["train_samples"] == 230 and summary["test_samples"] == 26  # a seeded 10% held out


def test_dict_batches_and_the_built_in_classification_task(tmp_path):
    x, y = linear_data(384, 0)
    data = {"features": x, "label": (y > 0.7).long()}
    summary = Trainer(config(tmp_path, epochs=6, lr=0.2), model=nn.Sequential(nn.Linear(5, 16), nn.ReLU(),
                                                                              nn.Linear(16, 2)),
                      train_data=data, task="classification", quiet=True).fit()
    assert summary["metrics"]["accuracy"] > 0.9 and "test_accuracy" not in summary  # one name per value


def test_target_on_any_metric_stops_the_run(tmp_path):
    summary = Trainer(config(tmp_path, epochs=40, optimizer="adamw", lr=0.05, weight_decay=0.0,
                             schedule="constant", eval_every=4, target="rmse=0.5"),
                      model=nn.Linear(5, 1), train_data=linear_data(512, 0), task=Regression(), quiet=True).fit()
    assert summary["stopped_by"] == "target" and summary["metrics"]["rmse"] <= 0.5 and summary["epochs"] < 40
    assert summary["time_to_target"] is not None


def test_a_run_of_a_model_object_resumes_only_with_that_model(tmp_path):
    run = Trainer(config(tmp_path, epochs=1), model=nn.Linear(5, 1), train_data=linear_data(128, 0),
                  task=Regression(), quiet=True)
    run.fit()
    with pytest.raises(GpuaccelError, match="passed as an object"):
        Trainer.resume(run.run_dir, overrides={"epochs": 2}, train_data=linear_data(128, 0), task=Regression())
    with pytest.raises(GpuaccelError, match="came through the Python API"):
        Trainer.resume(run.run_dir, overrides={"epochs": 2}, model=nn.Linear(5, 1))
    resumed = Trainer.resume(run.run_dir, overrides={"epochs": 2}, model=nn.Linear(5, 1),
                             train_data=linear_data(128, 0), task=Regression(), quiet=True)
    assert resumed.state.global_step == run.state.global_step and resumed.fit()["epochs"] == 2


class LinearBatches:
    """A user's own batch source: each batch a function of (seed, epoch, step), as the protocol asks."""

    def __init__(self, steps: int, seed: int):
        self.steps, self.seed, self.asked = steps, seed, []

    def __len__(self):
        return self.steps

    def batches(self, epoch=0, start=0):
        self.asked.append((epoch, start))
        for step in range(start, self.steps):
            yield linear_data(16, self.seed * 10_000 + epoch * 100 + step)


def test_a_users_own_batch_source_trains_through_the_protocol(tmp_path):
    train, held_out = LinearBatches(16, 0), LinearBatches(4, 1)
    assert isinstance(train, gpuaccel.BatchSource)
    summary = Trainer(config(tmp_path, epochs=10, optimizer="adamw", lr=0.1, weight_decay=0.0, schedule="constant"),
                      model=nn.Linear(5, 1), train_data=train, eval_data=held_out, task=Regression(),
                      quiet=True).fit()
    assert summary["metrics"]["rmse"] < 0.5  # (the targets' spread is about 3.7)
    assert [a for a in train.asked if a[0] > 0] == [(epoch, 0) for epoch in range(1, 10)]
    assert held_out.asked and all(a == (0, 0) for a in held_out.asked)
    with pytest.raises(GpuaccelError, match="LinearBatches cannot be split for evaluation; pass eval_data="):
        Trainer(config(tmp_path, "b"), model=nn.Linear(5, 1), train_data=LinearBatches(8, 0), task=Regression())


def test_a_dataloader_given_to_the_trainer_is_taken_as_the_accelerator_takes_it(tmp_path):
    """Its data set resident where safe, batched in the DataLoader's own order (the random numbers
    its iterator draws, from its generator), or with --loader cpu iterated as it is: the same
    batches, so the same weights."""
    from torch.utils.data import DataLoader, TensorDataset

    x = torch.randn(96, 5, generator=torch.Generator().manual_seed(0))
    y = (x[:, 0] > 0).long()

    def trained(placement: str):
        train = DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True,
                           generator=torch.Generator().manual_seed(3))
        held_out = DataLoader(TensorDataset(x[:40], y[:40]), batch_size=16)
        torch.manual_seed(1)
        model = nn.Linear(5, 2)
        trainer = Trainer(TrainConfig(device="cpu", epochs=3, loader=placement, monitor=False, compile=False,
                                      run_dir=str(tmp_path / placement)),
                          model=model, train_data=train, eval_data=held_out, loss_fn=F.cross_entropy, quiet=True)
        trainer.fit()
        return trainer, model

    resident, on_device = trained("auto")
    host, on_host = trained("cpu")
    assert isinstance(resident.train_loader, ResidentLoader) and isinstance(resident.eval_loader, ResidentLoader)
    assert isinstance(host.train_loader, PrefetchLoader)
    assert len(resident.train_loader) == len(host.train_loader) == 6
    assert resident.state.global_step == host.state.global_step == 18
    for a, b in zip(on_device.parameters(), on_host.parameters(), strict=True):
        assert torch.equal(a, b)


def test_every_loader_gpuaccel_makes_serves_the_batch_source_protocol():
    for cls in (ResidentLoader, PrefetchLoader):
        assert issubclass(cls, gpuaccel.BatchSource), cls
    assert not issubclass(torch.utils.data.DataLoader, gpuaccel.BatchSource)


def test_a_resident_loaders_transform_gets_each_training_batchs_own_seed_and_a_resume_the_same_batches():
    """A kind's transform sees a seed per training batch (what its augmentation draws from), the
    same for the same (epoch, step) whichever step a pass starts at, a different one for another
    batch; evaluation batches and samples get None. Tensors drawn per epoch are asked for their
    epoch's."""
    seen = []

    def noisy(batch, seed):
        seen.append(seed)
        x, y = batch
        if seed is None:
            return x, y
        return x + torch.rand(x.shape, generator=torch.Generator().manual_seed(seed)), y

    cpu = torch.device("cpu")
    x, y = torch.arange(40.0).view(20, 2), torch.arange(20)
    train = ResidentLoader((x, y), batch_size=4, device=cpu, train=True, seed=3, rank=1, world_size=2, transform=noisy)
    whole = list(train.batches(2))
    resumed = list(train.batches(2, start=1))
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(whole[1:], resumed))
    seeds = seen[:len(whole)]
    assert None not in seeds and len(set(seeds)) == len(seeds)
    assert seeds == [train.order.batch_seed(2, step) for step in range(len(whole))]
    seen.clear()
    evaluation = ResidentLoader((x, y), batch_size=8, device=cpu, train=False, transform=noisy)
    assert torch.equal(torch.cat([b[0] for b in evaluation.batches(0)]), x)
    evaluation.sample(3)
    assert set(seen) == {None}

    drawn = []

    class Redrawn:  # (as data/ratings.py's NegativeSamples: samples of an epoch, drawn for it)
        def __len__(self):
            return 20

        def __call__(self, epoch):
            drawn.append(epoch)
            return torch.full((20,), float(epoch)), torch.arange(20)

    loader = ResidentLoader(Redrawn(), batch_size=5, device=cpu, train=True)
    assert len(loader) == 4 and {float(b[0][0]) for b in loader.batches(7)} == {7.0} and drawn == [7]


def test_a_kinds_own_order_decides_a_resident_loaders_batches_and_cuts_them_to_its_widths():
    """A kind's order (as text windows, sentence runs and token buckets are) is a ShardedOrder whose
    epoch_plan gives the pass's indices, each batch's size and width: the loader gathers those rows,
    cuts fields of two or more dimensions to the width, leaves the others whole, resumes at any step
    and serves no index past the last batch."""
    from gpuaccel.data.loader import EpochPlan, ShardedOrder

    class Pairs(ShardedOrder):
        def __len__(self):
            return 3

        def epoch_plan(self, epoch, device):
            indices = torch.tensor([4, 1, 0, 3, 2, 5, 6]) + epoch  # (the last index is not in a batch)
            return EpochPlan(indices, [2, 3, 1], [3, 5, 2])

    cpu = torch.device("cpu")
    ids, labels = torch.arange(80).view(10, 8), torch.arange(10) * 10
    loader = ResidentLoader((ids, labels), order=Pairs(10, batch_size=3, train=True, seed=0, rank=0, world_size=1,
                                                        drop_last=False), device=cpu)
    batches = list(loader.batches(1))
    assert [tuple(b[0].shape) for b in batches] == [(2, 3), (3, 5), (1, 2)]
    assert torch.equal(batches[0][0], ids[[5, 2], :3]) and torch.equal(batches[1][1], labels[[1, 4, 3]])
    assert torch.equal(batches[2][0], ids[[6], :2])
    resumed = list(loader.batches(1, start=2))
    assert len(resumed) == 1 and torch.equal(resumed[0][0], batches[2][0])
    assert len(loader) == 3 and loader.batch_size == 3 and loader.train


@pytest.mark.parametrize("arguments, message", [
    (dict(task=Classification(), loss_fn=F.cross_entropy), "not both"),
    (dict(), "say what to minimise"),
    (dict(task="regression", metrics={"acc": "accuracy"}), "cannot compute metric 'accuracy'"),
])
def test_invalid_task_combinations_are_one_line_errors(tmp_path, arguments, message):
    with pytest.raises(GpuaccelError, match=message) as caught:
        Trainer(config(tmp_path), model=nn.Linear(5, 1), train_data=linear_data(64, 0), **arguments)
    assert "\n" not in str(caught.value)


def test_a_task_without_a_loss_is_refused(tmp_path):
    class NoLoss(gpuaccel.tasks.Task):
        name = "no-loss"

    with pytest.raises(GpuaccelError, match="defines no loss"):
        Trainer(config(tmp_path), model=nn.Linear(5, 1), train_data=linear_data(64, 0), task=NoLoss())


def test_target_naming_an_unknown_metric_is_a_cli_error(tmp_path, capsys):
    from gpuaccel.cli import main

    code = main(["train", "--device", "cpu", "--epochs", "1", "--target", "rmse=0.1",
                 "--run-dir", str(tmp_path / "r"), "--no-monitor"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "metric 'rmse'" in err and "accuracy" in err and len(err.splitlines()) == 1


def test_registry_factories_get_only_the_keywords_they_take():
    @gpuaccel.register_model("test-two-layer")
    def two_layer(num_classes: int):  # no in_channels, no image_size
        return nn.Linear(4, num_classes)

    assert gpuaccel.create_model("test-two-layer", num_classes=3, in_channels=1, image_size=8).out_features == 3


FACTORY = """
import torch.nn as nn


def small_cnn(num_classes, in_channels):
    return nn.Sequential(nn.Conv2d(in_channels, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                         nn.Flatten(), nn.Linear(8, num_classes))
"""


def test_a_factory_model_run_resumes_exports_and_infers_from_another_directory(tmp_path, monkeypatch):
    project = tmp_path / "project"
    (project / "mymodels").mkdir(parents=True)
    (project / "mymodels" / "__init__.py").write_text("")
    (project / "mymodels" / "cnn.py").write_text(textwrap.dedent(FACTORY))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    run = project / "runs" / "r"
    gpuaccel_cli = [sys.executable, "-m", "gpuaccel"]

    def cli(*args, cwd):
        return subprocess.run([*gpuaccel_cli, *args], cwd=cwd, capture_output=True, text=True, timeout=300)

    # no PYTHONPATH: gpuaccel puts the working directory on the path itself
    trained = cli("train", "--model", "mymodels.cnn:small_cnn", "--epochs", "1", "--device", "cpu",
                  "--run-dir", str(run), "--no-monitor", "--quiet", cwd=project)
    assert trained.returncode == 0, trained.stderr
    assert json.loads((run / "config.json").read_text())["model"]["model_path"] == str(project.resolve())
    # the rest in this process, from another directory, where mymodels is not importable by itself
    from gpuaccel.cli import main

    monkeypatch.chdir(elsewhere)
    assert "mymodels" not in sys.modules
    assert main(["train", "--resume", str(run), "--epochs", "2", "--quiet"]) == 0
    assert json.loads((run / "summary.json").read_text())["epochs"] == 2
    assert main(["export", str(run), "--out", str(elsewhere / "m.onnx"), "--verify-images", "100"]) == 0
    sys.modules.pop("mymodels.cnn"), sys.modules.pop("mymodels")  # infer finds it again from the run's record
    assert main(["infer", str(run), "digits"]) == 0


def test_loader_keeps_dtypes_and_shards_every_sample_once():
    x = torch.arange(50, dtype=torch.float64).unsqueeze(1)
    y = torch.linspace(0, 1, 50)
    seen = []
    for rank in range(2):
        loader = ResidentLoader((x, y), batch_size=8, device=torch.device("cpu"), train=False, rank=rank,
                              world_size=2)
        for bx, by in loader.batches():
            assert bx.dtype == torch.float64 and by.dtype == torch.float32
            seen += bx[:, 0].long().tolist()
    assert sorted(seen) == list(range(50))
    assert math.isclose(sum(seen), 50 * 49 / 2)
    np.testing.assert_array_equal(np.sort(seen), np.arange(50))


def test_a_bad_label_anywhere_in_a_users_data_is_one_line_before_training(tmp_path):
    """Only the first batch used to be checked: a label out of range later, or only in the
    evaluation data, or two-dimensional targets, were raw IndexError and RuntimeError mid-run."""
    torch.manual_seed(0)
    x, y = torch.randn(300, 4), torch.randint(0, 3, (300,))
    late = y.clone()
    late[-1] = 4
    config = dict(epochs=1, batch_size=32, device="cpu", monitor=False)
    cases = [((x, late), None, "the training data: a target label is 4"),
             ((x[:200], y[:200]), (x[200:], late[200:]), "the evaluation data: a target label is 4"),
             ((x, y[:, None]), None, "take targets (N,), not targets of shape")]
    for n, (train, held, message) in enumerate(cases):
        with pytest.raises(GpuaccelError, match=re.escape(message)):
            Trainer(TrainConfig(**config, run_dir=str(tmp_path / f"r{n}")), model=torch.nn.Linear(4, 3),
                    train_data=train, eval_data=held, task="classification", quiet=True).fit()


class _FreshEachRead(torch.utils.data.Dataset):
    """Noise added at each read (as random augmentation would): not held on the device, so its
    batches are read as training goes; one sample's label is out of range."""

    def __init__(self, bad: int):
        self.bad = bad

    def __len__(self):
        return 96

    def __getitem__(self, i):
        return torch.randn(4) + i % 3, torch.tensor(4 if i == self.bad else i % 3)


@pytest.mark.parametrize("bad", [0, 95])
def test_a_bad_label_in_data_read_batch_by_batch_is_one_line_naming_its_batch(tmp_path, bad):
    """A Dataset that is not held on the device cannot be checked whole before training: each host
    batch is checked as it arrives, the first ones read ahead of the check included, and a bad
    label is one line naming its batch, not PyTorch's IndexError from inside the loss."""
    data = _FreshEachRead(bad)
    config = TrainConfig(epochs=1, batch_size=16, device="cpu", monitor=False, val_split=0.0,
                         run_dir=str(tmp_path / "run"), workers=0)
    with pytest.raises(GpuaccelError, match=r"the training data, batch \d+ of epoch 1: a target label is 4, but "):
        Trainer(config, model=torch.nn.Linear(4, 3), train_data=data, eval_data=_FreshEachRead(-1),
                task="classification", quiet=True).fit()


def test_a_check_that_fails_on_the_first_batch_leaves_no_reader_process_behind(tmp_path):
    """The first batch is read (by worker processes, for a Dataset read batch by batch) before
    the task is checked on it; a failing check must stop them with the error, not leave them to
    the collector or the interpreter's exit."""
    import multiprocessing

    class AllBad(_FreshEachRead):
        def __getitem__(self, i):
            return torch.randn(4), torch.tensor(9)

    config = TrainConfig(epochs=1, batch_size=16, device="cpu", monitor=False, val_split=0.0,
                         run_dir=str(tmp_path / "run"), workers=2)
    trainer = Trainer(config, model=torch.nn.Linear(4, 3), train_data=AllBad(0), eval_data=_FreshEachRead(-1),
                      task="classification", quiet=True)
    with pytest.raises(GpuaccelError, match="a target label is 9"):
        trainer.fit()
    assert multiprocessing.active_children() == []
