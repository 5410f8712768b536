"""The training engine learns, stops when told, logs what it did, and resumes exactly."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import as_from_a_terminal

from gpuaccel import GpuaccelError, TrainConfig, Trainer, load_dataset
from gpuaccel.train import checkpoint


@pytest.fixture(scope="module")
def digits():
    return load_dataset("digits")


def fit(tmp_path, dataset, **kw):
    cfg = TrainConfig(run_dir=str(tmp_path / "run"), cache_dir=None, **kw)
    return Trainer(cfg, dataset=dataset, quiet=True).fit()


def test_short_run_really_learns_and_writes_its_run_dir(tmp_path, digits):
    s = fit(tmp_path, digits, model="lenet5", epochs=6, batch_size=32, label_smoothing=0.1)
    assert s["metrics"]["accuracy"] > 0.9  # chance is 0.1
    run = Path(s["run_dir"])
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert set(records[0]) >= {"step", "epoch", "loss", "accuracy", "samples_per_second", "elapsed"}
    assert records[-1]["accuracy"] == pytest.approx(s["metrics"]["accuracy"], abs=1e-6)
    assert json.loads((run / "summary.json").read_text())["metrics"]["accuracy"] == s["metrics"]["accuracy"]
    assert json.loads((run / "config.json").read_text())["model"]["name"] == "lenet5"
    final = checkpoint.load(run / "model.pt")
    assert final["model_name"] == "lenet5" and final["classes"] == digits.classes
    chosen = ("cuda:0", "bf16" if torch.cuda.is_bf16_supported() else "fp16") if torch.cuda.is_available() \
        else ("cpu", "fp32")
    assert s["stopped_by"] == "epochs" and (s["device"], s["precision"]) == chosen
    assert s["jpeg_decoder"] is None  # in-memory data


def test_learns_from_generated_image_folder(tmp_path, image_folder):
    ds = load_dataset(str(image_folder), cache_dir=None)
    s = fit(tmp_path, ds, model="resnet18", epochs=4, batch_size=8, lr=0.02, crop_padding=1)
    assert s["metrics"]["accuracy"] >= 0.8  # three classes: chance is 0.33


@pytest.mark.parametrize("options", [
    dict(optimizer="adamw", lr=3e-3, schedule="cosine", grad_clip=1.0),
    dict(schedule="constant", grad_accum=3, flip="random", cutout=2, crop_padding=1, precision="bf16"),
    dict(model="mlp", nesterov=False, momentum=0.0, eval_every=20),
    dict(optimizer="muon", muon_lr=0.1, precision="bf16"),
])
def test_option_combinations_train(tmp_path, digits, options):
    s = fit(tmp_path, digits, **{"epochs": 4, "batch_size": 32, **options})
    assert s["metrics"]["accuracy"] > 0.6


def test_grad_accumulation_counts_optimizer_steps(tmp_path, digits):
    s = fit(tmp_path, digits, epochs=1, batch_size=32, grad_accum=4)
    assert s["steps"] == -(-(len(digits.train_labels) // 32) // 4)


def test_a_fraction_of_an_epoch_stops_inside_the_last_one(tmp_path, digits):
    s = fit(tmp_path, digits, epochs=1.5, batch_size=32, lr=0.05)
    records = [json.loads(line) for line in (Path(s["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    steps_per_epoch = records[0]["step"]  # evaluated at the end of the first epoch, then at the stop
    assert len(records) == 2 and steps_per_epoch == len(digits.train_labels) // 32
    assert s["steps"] == records[1]["step"] == -(-3 * steps_per_epoch // 2) and s["stopped_by"] == "epochs"
    assert s["epochs"] == pytest.approx(1.5, abs=1 / steps_per_epoch)
    assert records[-1]["accuracy"] == pytest.approx(s["metrics"]["accuracy"]) and s["metrics"]["accuracy"] > 0.5


def test_target_accuracy_stops_early_and_records_time(tmp_path, digits):
    s = fit(tmp_path, digits, epochs=30, batch_size=32, target_acc=0.85, eval_every=10)
    assert s["stopped_by"] == "target" and s["metrics"]["accuracy"] >= 0.85 and s["target"] == "accuracy=0.85"
    assert 0 < s["time_to_target"] <= s["train_seconds"] and s["epochs"] < 30


def test_time_limit_stops(tmp_path, digits):
    s = fit(tmp_path, digits, model="resnet18", epochs=50, batch_size=64, time_limit=1.0)
    assert s["stopped_by"] == "time_limit" and s["epochs"] < 50 and s["metrics"]["accuracy"] is not None


def test_time_limit_keeps_time_for_the_final_evaluation(tmp_path, digits, monkeypatch):
    import time

    evaluate = Trainer.evaluate

    def slow(self, *args, **kwargs):  # an evaluation of 0.6 s, against a limit of 2 s
        time.sleep(0.6)
        return evaluate(self, *args, **kwargs)

    monkeypatch.setattr(Trainer, "evaluate", slow)
    s = fit(tmp_path, digits, model="lenet5", epochs=500, batch_size=64, time_limit=2.0, eval_every=60,
            checkpoint_epochs=0)
    assert s["stopped_by"] == "time_limit"
    assert s["train_seconds"] <= 2.0 - 0.6 + 0.15  # stopped early enough for the last evaluation (0.15: a slow step)


def test_time_limit_holds_before_the_first_evaluation_and_the_progress_line_knows_it(tmp_path, digits, monkeypatch):
    """No evaluation yet to reckon the last one by: the limit is kept with an estimate of it, and
    a step's length besides; the progress line's time left is the limit's, where that is shorter."""
    from gpuaccel.train import progress

    lines, init = [], progress.Progress.__init__

    def often(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.every = 0.2
    monkeypatch.setattr(progress.Progress, "__init__", often)
    monkeypatch.setattr(progress.Progress, "log", lambda self, line: lines.append(line))
    config = TrainConfig(run_dir=str(tmp_path / "run"), cache_dir=None, model="lenet5", epochs=500, batch_size=64,
                         time_limit=1.5, eval_every=100_000, checkpoint_epochs=0, monitor=False)
    s = Trainer(config, dataset=digits, quiet=False).fit()
    assert s["stopped_by"] == "time_limit" and s["train_seconds"] <= 1.5  # (rounded to the millisecond)
    left = [line for line in lines if " left" in line]
    assert left and all(" h " not in line and " min " not in line for line in left), left


def test_run_dir_with_a_checkpoint_is_not_overwritten(tmp_path, digits):
    fit(tmp_path, digits, epochs=1)
    with pytest.raises(GpuaccelError, match="already holds a run"):
        fit(tmp_path, digits, epochs=1)


def test_checkpoint_files_are_replaced_atomically(tmp_path):
    target = tmp_path / "state.pt"
    checkpoint.save(target, {"a": torch.ones(3)})

    def broken(f):
        f.write(b"partial")
        raise OSError("disk full")
    with pytest.raises(OSError):
        checkpoint.atomic_write(target, broken)
    assert torch.equal(checkpoint.load(target)["a"], torch.ones(3))  # the old file survived intact
    assert [p.name for p in tmp_path.iterdir()] == ["state.pt"]  # no temporary left behind


def _train_command(run_dir, epochs=2):
    return [sys.executable, "-m", "gpuaccel", "train", "--data", "digits", "--model", "lenet5", "--batch-size", "16",
            "--epochs", str(epochs), "--checkpoint-every", "10", "--run-dir", str(run_dir), "--quiet",
            "--deterministic"]  # on a GPU, cuDNN's autotuner may pick other kernels after the restart


def _final_weights(run_dir):
    return checkpoint.load(Path(run_dir) / "model.pt")["model"]


def _env():
    return {**os.environ, "OMP_NUM_THREADS": "1"}


def test_resume_after_sigkill_ends_with_identical_weights(tmp_path):
    reference = tmp_path / "reference"
    subprocess.run(_train_command(reference), check=True, env=_env(), capture_output=True)

    killed = tmp_path / "killed"
    proc = subprocess.Popen(_train_command(killed), env=_env(), stderr=subprocess.PIPE)
    marker = killed / "checkpoint.json"
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        if marker.exists():
            position = json.loads(marker.read_text())
            if position["epoch"] >= 1 and position["batch_in_epoch"] > 0:
                break  # a checkpoint in the middle of the second epoch
        time.sleep(0.005)
    assert proc.poll() is None, "training finished before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert not (killed / "summary.json").exists()
    stopped_at = json.loads(marker.read_text())
    assert stopped_at["batch_in_epoch"] > 0  # resume starts mid-epoch

    result = subprocess.run([sys.executable, "-m", "gpuaccel", "train", "--resume", str(killed), "--json"],
                            env=_env(), capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["epochs"] == 2
    ref, got = _final_weights(reference), _final_weights(killed)
    assert ref.keys() == got.keys()
    for key in ref:
        assert torch.equal(ref[key], got[key]), key
    steps = [json.loads(line)["step"] for line in (killed / "metrics.jsonl").read_text().splitlines()]
    assert steps == sorted(set(steps)) and len(steps) == 2  # one record per evaluation, none repeated


def test_ctrl_c_saves_a_checkpoint_and_exits_130(tmp_path):
    run_dir = tmp_path / "interrupted"
    proc = subprocess.Popen(_train_command(run_dir, epochs=200), env=_env(),
                            stderr=subprocess.PIPE, text=True, preexec_fn=as_from_a_terminal)
    deadline = time.time() + 120
    while not (run_dir / "checkpoint.json").exists() and time.time() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130
    assert "checkpoint saved" in err and f"--resume {run_dir}" in err
    assert (run_dir / "checkpoint.pt").exists()


def test_the_training_clock_waits_for_queued_steps_before_pausing_for_a_checkpoint(monkeypatch, tmp_path):
    """Checkpoint time is not training time, but GPU steps still queued when a checkpoint
    starts are: every save must come right after a device synchronisation, also at epoch
    ends without an evaluation."""
    import gpuaccel.train.trainer as trainer_module

    events = []
    monkeypatch.setattr(trainer_module, "synchronize", lambda device: events.append("sync"))
    save = Trainer.save_checkpoint
    monkeypatch.setattr(Trainer, "save_checkpoint", lambda self, **kw: (events.append("save"), save(self, **kw))[1])
    Trainer(TrainConfig(data="digits", epochs=3, eval_every=10**6, monitor=False, run_dir=str(tmp_path / "r")),
            quiet=True).fit()
    saves = [i for i, event in enumerate(events) if event == "save"]
    assert len(saves) == 3 and all(events[i - 1] == "sync" for i in saves)


def test_a_checkpoint_between_evaluations_records_the_training_time_so_far(monkeypatch, tmp_path, digits):
    """A resumed run's totals (training seconds, samples per second) start from what its
    checkpoint recorded, also when it was saved between two evaluations."""
    recorded = []
    save = Trainer.save_checkpoint
    monkeypatch.setattr(Trainer, "save_checkpoint", lambda self, **kw: (
        recorded.append((self.state.global_step, self.state.train_seconds)), save(self, **kw))[1])
    fit(tmp_path / "r", digits, model="mlp", epochs=2, eval_every=10**6, checkpoint_every=5, monitor=False)
    between = [(step, seconds) for step, seconds in recorded if step % 5 == 0 and step < recorded[-1][0]]
    assert between and all(seconds > 0 for _, seconds in between)
    assert [s for _, s in recorded] == sorted(s for _, s in recorded)  # the clock only moves forward


def test_checkpoint_epochs_sets_which_epoch_ends_are_saved(monkeypatch, tmp_path, digits):
    saved_at = []
    save = Trainer.save_checkpoint
    monkeypatch.setattr(Trainer, "save_checkpoint",
                        lambda self, **kw: (saved_at.append(self.state.epoch), save(self, **kw))[1])
    for every, expected in ((1, [1, 2, 3, 4]), (2, [2, 4]), (0, [4])):  # (the end is always saved)
        saved_at.clear()
        fit(tmp_path / str(every), digits, model="mlp", epochs=4, eval_every=10**6, monitor=False,
            checkpoint_epochs=every)
        assert saved_at == expected, every
    with pytest.raises(GpuaccelError, match="checkpoint_epochs must be a whole number >= 0"):
        TrainConfig(checkpoint_epochs=-1).validate()


def test_training_runs_with_the_warm_up_objects_frozen_and_leaves_the_collector_as_it_was(monkeypatch, tmp_path,
                                                                                           digits):
    """Objects that exist before training (compilation's, the model's) are frozen out of the
    garbage collector's full passes during training, and thawed again afterwards, also when
    some were frozen before (Python 3.12 starts with 375 frozen objects)."""
    import gc

    frozen_at_steps = []
    step = Trainer._train_step
    monkeypatch.setattr(Trainer, "_train_step",
                        lambda self, *a, **k: (frozen_at_steps.append(gc.get_freeze_count()), step(self, *a, **k))[1])
    for frozen_before in (False, True):
        gc.unfreeze()
        if frozen_before:
            gc.freeze()
        before = gc.get_freeze_count()
        fit(tmp_path / str(frozen_before), digits, epochs=0.2, monitor=False)
        training_steps = frozen_at_steps[-3:]  # the warm-up's steps come first, before the freeze
        assert min(training_steps) > max(before, 1000), frozen_before  # the trainer's objects too
        assert gc.get_freeze_count() == 0, frozen_before


@pytest.mark.parametrize("optimizer", ["sgd", "muon", "adamw"])
def test_the_step_as_a_graph_records_it_trains_exactly_like_the_eager_step(tmp_path, digits, optimizer):
    """What the CUDA graph of a whole step records differs from an eager step only in what it
    reads: learning rates and the weight average's blend from tensors, momentum buffers and
    Adam's moments created as zeros beforehand. Run eagerly here with those, the step gives the
    same weights, average, optimizer state and losses as the trainer's eager step."""
    import itertools

    from gpuaccel.runtime.capture import prepare_graph_state, tensor_learning_rates

    cfg = TrainConfig(data="digits", epochs=1, batch_size=64, lr=0.2, momentum=0.9, nesterov=True,
                      bias_lr_scale=4.0, label_smoothing=0.1, grad_clip=0.5, ema=0.9, monitor=False,
                      cache_dir=None, optimizer=optimizer, muon_lr=0.1, device="cpu")
    usual = Trainer(cfg.replace(run_dir=str(tmp_path / "a")), dataset=digits, quiet=True)
    graphed = Trainer(cfg.replace(run_dir=str(tmp_path / "b")), dataset=digits, quiet=True)
    assert usual.step.uncaptured is not None  # on the CPU the trainer never captures
    prepare_graph_state(graphed.optimizer)
    rates = [[torch.zeros(()) for _ in graphed.optimizer.param_groups]]
    for images, labels in itertools.islice(usual.train_loader.batches(0), 6):
        expected = usual.train_step(images, labels)
        graphed.ema.advance_weight()
        with tensor_learning_rates([graphed.optimizer], rates):
            got = graphed._train_step([(images, labels)]) / len(labels)
        graphed.scheduler.step()
        assert torch.allclose(got, expected, atol=1e-5)
    for a, b in zip(usual.model.state_dict().values(), graphed.model.state_dict().values()):
        assert torch.allclose(a.float(), b.float(), atol=1e-5)
    for a, b in zip(usual.ema.module.state_dict().values(), graphed.ema.module.state_dict().values()):
        assert torch.allclose(a.float(), b.float(), atol=1e-5)
    names = ["exp_avg", "exp_avg_sq", "step"] if optimizer == "adamw" else ["momentum_buffer"]
    for p, q in zip(usual.model.parameters(), graphed.model.parameters()):
        for name in names:
            assert torch.allclose(usual.optimizer.state[p][name].float(), graphed.optimizer.state[q][name].float(),
                                  atol=1e-5)
    assert usual.scheduler.get_last_lr() == graphed.scheduler.get_last_lr()
    assert all(isinstance(group["lr"], float) for group in graphed.optimizer.param_groups)


@pytest.mark.gpu
def test_a_captured_step_records_each_batch_shape_and_replays_them_in_any_order():
    """Progressive resizing trains on two or more batch shapes: each gets its own recording,
    and replaying them interleaved trains exactly like eager steps."""
    import copy

    import torch.nn as nn

    from gpuaccel.runtime import CapturedStep

    torch.manual_seed(0)
    graphed = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                            nn.Linear(8, 4)).cuda()
    eager = copy.deepcopy(graphed)
    graphed_sgd = torch.optim.SGD(graphed.parameters(), lr=0.1, momentum=0.9, fused=True)
    eager_sgd = torch.optim.SGD(eager.parameters(), lr=0.1, momentum=0.9, fused=True)
    loss_fn = nn.functional.cross_entropy

    def train_step(x, y):
        graphed_sgd.zero_grad(set_to_none=True)
        loss = loss_fn(graphed(x), y)
        loss.backward()
        graphed_sgd.step()
        return loss.detach()

    step = CapturedStep(train_step, [graphed_sgd], torch.device("cuda"), strict=True)
    batches = [(torch.randn(16, 3, side, side, device="cuda"), torch.randint(0, 4, (16,), device="cuda"))
               for side in (8, 6, 6, 8, 6, 8, 8)]
    saved = copy.deepcopy(graphed.state_dict()), copy.deepcopy(graphed_sgd.state_dict())
    step.warm(*batches[0])
    step.warm(*batches[1])
    graphed.load_state_dict(saved[0])  # in place: the recordings must see the restored weights
    graphed_sgd.load_state_dict(saved[1])
    step.record()
    assert len(step.recordings) == 2 and step.captured
    for x, y in batches:
        got = step(x, y).clone()
        eager_sgd.zero_grad(set_to_none=True)
        expected = loss_fn(eager(x), y)
        expected.backward()
        eager_sgd.step()
        torch.testing.assert_close(got, expected.detach(), atol=1e-4, rtol=1e-4)
    for a, b in zip(graphed.parameters(), eager.parameters()):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    step.release()
    assert not step.captured


def test_the_summary_accounts_for_the_process_time_phase_by_phase(tmp_path):
    from gpuaccel.monitor.phases import BEFORE, process_age

    config = TrainConfig(data="digits", epochs=1, device="cpu", monitor=False, run_dir=str(tmp_path / "run"))
    summary = Trainer(config, quiet=True).fit()
    phases = summary["phases"]
    assert list(phases)[:3] == [BEFORE, "device (CUDA initialisation)", "reading the data"]
    assert phases["training"] == pytest.approx(summary["train_seconds"], abs=0.01)
    assert phases["checkpoints during the loop"] > 0  # (the end's checkpoint, apart from the evaluations)
    assert sum(phases.values()) == pytest.approx(process_age(), abs=0.5)  # no second left out


def test_a_compiled_run_sets_up_with_torch_compiles_import_as_a_phase_of_its_own():
    trainer = Trainer(TrainConfig(data="digits", epochs=1, device="cpu", compile=True, monitor=False, run_dir=None),
                      quiet=True)  # (torch.compile compiles at the first step: none here)
    phases = list(trainer.times.phases.phases)
    assert phases[-3:] == ["loaders (the data on the device, data-dependent initialisation)",
                           "importing torch.compile (Dynamo, Inductor)", "parallel strategy, optimizer, training step"]
    plain = Trainer(TrainConfig(data="digits", epochs=1, device="cpu", monitor=False, run_dir=None), quiet=True)
    assert "importing torch.compile (Dynamo, Inductor)" not in plain.times.phases.phases


def test_the_warm_up_says_where_its_seconds_went():
    from gpuaccel.train.warmup import FIRST_STEP

    trainer = Trainer(TrainConfig(data="digits", epochs=1, device="cpu", monitor=False, run_dir=None), quiet=True)
    seconds = trainer.warm_up()
    parts = trainer.times.warmup_phases
    assert list(parts) == ["saving the state to put back", FIRST_STEP, "2 more training steps per shape",
                           "an evaluation", "putting the state back", "recording the step graph"]
    assert sum(parts.values()) == pytest.approx(seconds, abs=0.01)


@pytest.mark.parametrize("compile_eval", [True, False])
def test_evaluation_runs_the_compiled_forward_only_with_compile_eval(monkeypatch, tmp_path, digits, compile_eval):
    """--no-compile-eval: training calls what torch.compile made, evaluation the plain model,
    and the warm-up has no evaluation to prepare."""
    modes = []

    def compiled(self, module):  # stands in for torch.compile: notes which mode each call ran in
        def forward(*args):
            modes.append("train" if module.training else "eval")
            return module(*args)
        return forward

    monkeypatch.setattr(Trainer, "_compiled", compiled)
    config = TrainConfig(run_dir=str(tmp_path / "run"), cache_dir=None, model="mlp", epochs=1, monitor=False,
                         compile=True, compile_eval=compile_eval)
    trainer = Trainer(config, dataset=digits, quiet=True)
    evaluations = []
    evaluate = trainer.evaluate
    monkeypatch.setattr(trainer, "evaluate", lambda **kw: (evaluations.append(kw), evaluate(**kw))[1])
    trainer.warm_up()
    assert evaluations == ([{"each_shape": True}] if compile_eval else [])
    summary = trainer.fit()
    assert "train" in modes and ("eval" in modes) == compile_eval
    assert summary["metrics"]["accuracy"] > 0.5


@pytest.mark.gpu
@pytest.mark.parametrize("search", [True, False])  # (not "benchmark": pytest-benchmark's fixture has that name)
def test_cudnn_autotuning_follows_the_setting(tmp_path, digits, search):
    Trainer(TrainConfig(run_dir=str(tmp_path / "run"), cache_dir=None, device="cuda", cudnn_benchmark=search),
            dataset=digits, quiet=True)
    assert torch.backends.cudnn.benchmark is search


def test_off_a_terminal_a_long_run_logs_a_line_at_a_steady_cadence(monkeypatch):
    import io

    from gpuaccel.train import progress as progress_module

    clock = iter(float(t) for t in range(0, 1000, 10))  # each reading 10 s later
    monkeypatch.setattr(progress_module.time, "monotonic", lambda: next(clock))
    out = io.StringIO()  # not a terminal
    progress = progress_module.Progress(100, initial=20, stream=out, every_seconds=30)
    for _ in range(6):
        progress.advance()
    lines = out.getvalue().splitlines()
    assert lines == ["step 23/100 (23%), 0.1 steps/s, about 12 min 50 s left",
                     "step 26/100 (26%), 0.1 steps/s, about 12 min 20 s left"], lines
    progress.log("an evaluation's line")  # a line restarts the period
    progress.advance()
    progress.advance()
    assert out.getvalue().splitlines()[-1] == "an evaluation's line"
    quiet = io.StringIO()
    progress = progress_module.Progress(100, stream=quiet, quiet=True, every_seconds=0)
    progress.advance()
    assert quiet.getvalue() == ""


class ScriptedEvaluations(Trainer):
    """Evaluations that report the accuracies given, in turn (the warm-up's pass aside)."""

    def __init__(self, config, accuracies, **kw):
        super().__init__(config, **kw)
        self.script = list(accuracies)

    def evaluate(self, each_shape: bool = False) -> dict:
        result = super().evaluate(each_shape)
        return result if each_shape else {**result, "accuracy": self.script.pop(0)}


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_the_best_evaluation_is_kept_in_best_pt_where_it_is_not_the_last(tmp_path, device, monkeypatch):
    """(On a GPU the kept weights are copied into page-locked buffers reused at each better
    evaluation; on the CPU, where the gathered state is the live weights, a copy of it:
    ``Trainer.keep_best``.) best.pt is written at checkpoints, except the last one where the
    last evaluation is the best: model.pt holds those weights."""
    from gpuaccel.train.run_dir import RunDirectory

    written = []  # the accuracy of each best.pt written
    save_best = RunDirectory.save_best
    monkeypatch.setattr(RunDirectory, "save_best",
                        lambda run, state: written.append(state["metrics"]["accuracy"]) or save_best(run, state))

    def train(run, accuracies, **kw):
        config = TrainConfig(data="digits", epochs=len(accuracies), device=device, monitor=False, run_dir=str(run),
                             **kw)
        trainer = ScriptedEvaluations(config, accuracies, quiet=True)
        return trainer.fit(), trainer

    summary, _ = train(tmp_path / "peak", [0.5, 0.9, 0.7])
    assert summary["best_model"]["file"] == "best.pt" and summary["best_model"]["value"] == 0.9
    best = torch.load(tmp_path / "peak" / "best.pt", weights_only=False)
    last = torch.load(tmp_path / "peak" / "model.pt", weights_only=False)
    assert best["metrics"]["accuracy"] == 0.9 and last["metrics"]["accuracy"] == 0.7
    steps_per_epoch = summary["steps"] // 3
    assert summary["best_model"]["step"] == 2 * steps_per_epoch
    assert any(not torch.equal(best["model"][k], last["model"][k]) for k in last["model"])
    assert written == [0.5, 0.9]
    written.clear()
    summary, trainer = train(tmp_path / "rising", [0.5, 0.7, 0.9])
    assert summary["best_model"] == {"file": "model.pt", "step": summary["steps"], "metric": "accuracy", "value": 0.9}
    assert not (tmp_path / "rising" / "best.pt").exists() and written == [0.5, 0.7]
    last = torch.load(tmp_path / "rising" / "model.pt", weights_only=False)  # (the kept best weights)
    assert last["metrics"]["accuracy"] == 0.9
    assert all(torch.equal(last["model"][k], v.cpu()) for k, v in trainer.model.state_dict().items())
    # ranked by the target's metric where there is one (here the loss: lower is better)
    summary, _ = train(tmp_path / "target", [0.5, 0.9], target="loss=0.0001")
    assert summary["best_model"]["metric"] == "loss"


def test_a_non_finite_held_out_loss_is_a_warning_not_silence(tmp_path):
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 4, generator=g), torch.randint(0, 2, (64,), generator=g)
    held = x[:16].clone()
    held[3, 1] = float("nan")  # one bad value in the evaluation data
    config = TrainConfig(epochs=1, batch_size=16, device="cpu", monitor=False, run_dir=str(tmp_path / "r"))
    with pytest.warns(UserWarning, match=r"the held-out loss is not finite at step 4 while training's loss is "
                                         r"\d.*the evaluation data hold NaN or infinite values"):
        Trainer(config, model=torch.nn.Linear(4, 2), train_data=(x, y), eval_data=(held, y[:16]),
                task="classification", quiet=True).fit()


@pytest.mark.parametrize("data, model, fails_at", [
    ("digits", "gpt", "missing 1 required positional argument: 'vocab_size'"),  # building it
    ("text", "resnet18", "unexpected keyword argument 'vocab_size'"),
    ("ratings", "dlrm", "must have the same dtype"),  # its first forward pass
    ("text", "dlrm", "missing 1 required positional argument: 'sparse'"),
])
def test_a_built_in_model_named_for_data_it_cannot_read_is_one_line_naming_the_datas_own(tmp_path, capsys, data,
                                                                                          model, fails_at):
    from conftest import assert_user_error

    paths = {"digits": "digits", "text": tmp_path / "story.txt", "ratings": tmp_path / "ratings.csv"}
    paths["text"].write_text("the quick brown fox jumps over the lazy dog. " * 200)
    paths["ratings"].write_text("user,item,rating\n" + "".join(f"{u},{i},{1 + (u * i) % 5}\n"
                                                              for u in range(20) for i in range(15)))
    own = {"digits": "lenet5", "text": "gpt", "ratings": "matrix_factorization"}[data]
    assert_user_error(capsys, ["train", "--data", str(paths[data]), "--model", model, "--device", "cpu", "--epochs",
                               "0.01", "--no-monitor", "--quiet", "--run-dir", str(tmp_path / "run")],
                      f"model {model} cannot read the", fails_at, f"the model made for them is {own}")


def test_ranks_writing_parts_of_a_checkpoint_agree_on_when_by_the_clock():
    """With sharded state every rank writes its part of a checkpoint: a rank whose clock said
    'checkpoint_seconds passed' alone would wait in the write's collective for the others, still
    training. Any rank's clock decides for all, every 16 steps, read at the next check (so the
    host never waits for the GPU's queue); a rank-0-only write (DDP) keeps its own clock."""
    from gpuaccel.train.cadence import Cadence

    class Verdict:
        def result(self):
            return True  # the other rank's clock said it is time

    class TwoRanks:
        active = True

        def __init__(self):
            self.sent = []

        def start_any(self, flag, device):
            self.sent.append(flag)
            return Verdict()

    config = TrainConfig(checkpoint_seconds=3600)
    ranks = TwoRanks()
    sharded = Cadence(config, ranks, torch.device("cpu"), collective_checkpoints=True)
    assert not sharded.checkpoint_due(17, 0, False, False) and ranks.sent == []  # between checks: no collective
    assert not sharded.checkpoint_due(32, 0, False, False) and ranks.sent == [False]  # sent; nothing agreed yet
    assert sharded.checkpoint_due(48, 0, False, False) and ranks.sent == [False, False]  # the verdict of step 32
    sharded.checkpointed()  # (a verdict from before the checkpoint is dropped)
    assert not sharded.checkpoint_due(64, 0, False, False)
    assert sharded.checkpoint_due(5, 0, False, True) and len(ranks.sent) == 3  # the last step: all know it
    replicated = Cadence(config, TwoRanks(), torch.device("cpu"))
    assert not replicated.checkpoint_due(32, 0, False, False)


@pytest.mark.gpu
def test_a_run_that_may_train_uncompiled_leaves_cudnns_attention_off_until_it_compiles_or_ends(tmp_path):
    """(cuDNN builds its attention kernels at run time: seconds of a first uncompiled run;
    ``compiling.avoid_runtime_compiles``.)"""
    text = tmp_path / "play.txt"
    text.write_text("to be or not to be, that is the question. " * 400)
    assert torch.backends.cuda.cudnn_sdp_enabled()
    config = TrainConfig(data=str(text), model="gpt", model_args={"layers": 1, "heads": 2, "width": 32}, context=32,
                         compile=True, compile_mode="reduce-overhead", epochs=1, monitor=False, run_dir=None)
    try:
        trainer = Trainer(config, quiet=True)
        assert trainer.compile_plan == "deferred" and not torch.backends.cuda.cudnn_sdp_enabled()
        trainer.compile_now()
        assert torch.backends.cuda.cudnn_sdp_enabled()
        compiled = Trainer(config.replace(compile_background=False), quiet=True)
        assert compiled.compile_plan == "now" and torch.backends.cuda.cudnn_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(True)


@pytest.mark.gpu
def test_a_gpt_is_built_on_the_gpu_that_trains_it(tmp_path):
    """(Its initial values drawn there, not on the host: ``registry.builds_on_device``.)"""
    from gpuaccel.models.gpt import GPT

    text = tmp_path / "play.txt"
    text.write_text("to be or not to be, that is the question. " * 400)
    config = TrainConfig(data=str(text), model="gpt", model_args={"layers": 1, "heads": 2, "width": 32}, context=32,
                         epochs=1, seed=3, monitor=False, run_dir=None)
    trainer = Trainer(config, quiet=True)
    torch.manual_seed(3)
    with torch.device("cuda"):
        expected = GPT(trainer.model.vocab_size, 32, layers=1, heads=2, width=32)
    built = dict(trainer.model.named_parameters())
    assert built.keys() == dict(expected.named_parameters()).keys()
    for name, value in expected.named_parameters():
        assert torch.equal(built[name], value), name


def test_cudnns_attention_is_put_back_however_a_run_ends(monkeypatch):
    """(Turned off while a run may train uncompiled, ``compiling.avoid_runtime_compiles``:
    a later run in the process would compile with another attention kernel otherwise.)"""
    from gpuaccel.compiling import avoid_runtime_compiles

    trainer = Trainer(TrainConfig(data="digits", epochs=1, device="cpu", monitor=False, run_dir=None), quiet=True)
    avoid_runtime_compiles()  # (as a GPU run whose compile is deferred does)
    try:
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        monkeypatch.setattr(trainer, "_fit", lambda: 1 / 0)
        with pytest.raises(ZeroDivisionError):
            trainer.fit()
        assert torch.backends.cuda.cudnn_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(True)
