"""gpuaccel bench, the monitors and the HTML report: behaviour on the CPU, the page in a real browser."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest
import torch
from conftest import assert_user_error, run

from gpuaccel.bench.ladder import RUNG_NAMES, training_flops_per_image
from gpuaccel.monitor import DataWaitMeter, GpuSampler
from gpuaccel.monitor.gpu import read_samples

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory):
    """One quick ladder on the built-in digits, with time-to-accuracy, shared by the tests below."""
    from gpuaccel.cli import main

    run_dir = tmp_path_factory.mktemp("bench") / "run"
    code = main(["bench", "--quick", "--only", "cpu,gpu-fp32,cuda-graphs,multi-gpu", "--time-to-acc", "0.5",
                 "--epochs", "2", "--run-dir", str(run_dir), "--json"])
    assert code == 0
    return run_dir


@pytest.fixture(scope="module")
def train_run(tmp_path_factory):
    from gpuaccel.cli import main

    run_dir = tmp_path_factory.mktemp("train") / "run"
    assert main(["train", "--epochs", "3", "--quiet", "--run-dir", str(run_dir), "--profile", "--profile-steps", "3-5",
                 "--tensorboard"]) == 0
    return run_dir


@pytest.fixture(scope="module")
def text_run(tmp_path_factory):
    """A character language model: a run with no images and no accuracy."""
    from gpuaccel.cli import main

    folder = tmp_path_factory.mktemp("text")
    (folder / "corpus.txt").write_text("to be, or not to be: that is the question.\n" * 200)
    run_dir = folder / "run"
    assert main(["train", "--data", str(folder / "corpus.txt"), "--model", "gpt", "--model-args",
                 "layers=1,heads=2,width=16,dropout=0.0", "--context", "16", "--batch-size", "16", "--epochs", "2",
                 "--eval-every", "10", "--no-monitor", "--quiet", "--run-dir", str(run_dir)]) == 0
    return run_dir


def test_ladder_measures_the_cpu_and_explains_every_skipped_rung(bench_run):
    results = json.loads((bench_run / "results.json").read_text())
    rungs = {r["rung"]: r for r in results["rungs"]}
    assert list(rungs) == ["cpu", "gpu-fp32", "cuda-graphs", "multi-gpu"]  # --only keeps the ladder's order
    cpu = rungs["cpu"]
    assert cpu["images_per_second"] > 0 and cpu["images_per_second_min"] <= cpu["images_per_second"] \
        <= cpu["images_per_second_max"]
    assert 0 <= cpu["data_wait_share"] < 1 and 0 < cpu["mfu"] < 1
    assert cpu["speedup_vs_cpu"] == pytest.approx(1.0)
    assert results["training_flops_per_image"] > 0 and results["env"]["cpu"]["cores"] >= 1
    if not torch.cuda.is_available():
        for name in ("gpu-fp32", "cuda-graphs", "multi-gpu"):
            assert rungs[name]["skipped"] == "no CUDA GPU here"
        assert "time_to_acc" not in cpu  # time-to-accuracy is for the GPU rungs


def test_bench_writes_a_report_with_the_ladder(bench_run):
    page = (bench_run / "report.html").read_text()
    assert '<table id="ladder">' in page and "skipped: " in page and "<svg" in page
    for fetch in ('src="http', "src='http", 'href="http', "url(http", "<script"):
        assert fetch not in page  # self-contained: nothing to fetch, nothing to run


def test_flop_count_of_an_mlp_matches_the_arithmetic():
    # forward 2*sum(in*out); backward: weight gradients as much again, input gradients for layers 2 and 3
    layers = [(64, 512), (512, 256), (256, 10)]
    forward = 2 * sum(i * o for i, o in layers)
    expected = 2 * forward + 2 * sum(i * o for i, o in layers[1:])
    assert training_flops_per_image("mlp", {"num_classes": 10, "in_channels": 1, "image_size": 8}) == expected


def test_data_wait_meter_tells_slow_data_from_slow_compute():
    def batches(delay):
        for i in range(5):
            time.sleep(delay)
            yield i

    for data_delay, compute_delay, low, high in ((0.03, 0.0, 0.8, 1.0), (0.0, 0.03, 0.0, 0.2)):
        meter = DataWaitMeter(torch.device("cpu"))
        for _ in meter.timed(batches(data_delay)):
            time.sleep(compute_delay)
        share = meter.read()["data_share"]
        assert low <= share <= high, (data_delay, compute_delay, share)
    assert meter.read()["data_share"] == 0.0  # read resets


def test_gpu_sampler_without_a_gpu_says_why_and_does_nothing(tmp_path):
    sampler = GpuSampler(tmp_path / "gpu.jsonl", [])
    with sampler:
        pass
    assert sampler.unavailable and sampler.mean("util") is None
    assert not (tmp_path / "gpu.jsonl").exists()


def test_read_samples_ignores_a_torn_last_line(tmp_path):
    path = tmp_path / "gpu.jsonl"
    path.write_text('{"t": 0.1, "gpu": 0, "util": 50}\n{"t": 0.2, "gpu": 0, "ut')
    assert read_samples(path) == [{"t": 0.1, "gpu": 0, "util": 50}]


def test_train_profile_and_tensorboard_outputs(train_run):
    trace = json.loads((train_run / "profile" / "trace.json").read_text())
    assert trace["traceEvents"] and "convolution" in (train_run / "profile" / "ops.txt").read_text()
    # --profile-steps 3-5: the profiler numbers steps from 0
    assert {e["name"] for e in trace["traceEvents"] if e.get("name", "").startswith("ProfilerStep")} == \
        {"ProfilerStep#2", "ProfilerStep#3", "ProfilerStep#4"}
    assert list((train_run / "tensorboard").glob("events.out.tfevents.*"))
    records = [json.loads(line) for line in (train_run / "metrics.jsonl").read_text().splitlines()]
    assert all(0 <= r["data_wait"] <= 1 for r in records)


@pytest.mark.parametrize("steps", ["5", "0-3", "9-8", "a-b"])
def test_a_malformed_profile_window_is_refused_in_one_line(capsys, steps):
    assert_user_error(capsys, ["train", "--profile", "--profile-steps", steps], "--profile-steps is FIRST-LAST")


def test_report_of_a_training_run(train_run, capsys):
    code, out, err = run(capsys, "report", str(train_run))
    assert code == 0 and out.strip().endswith("report.html")
    page = (train_run / "report.html").read_text()
    assert '<table id="summary"' in page and '<table id="evaluations">' in page and page.count("<svg") >= 2
    results = json.loads((train_run / "results.json").read_text())
    assert results["kind"] == "train" and len(results["metrics"]) == 3


def test_report_of_runs_without_images(text_run, capsys, tmp_path):
    """Every run the product makes gets a report: a language model (loss, no accuracy), and a
    regression trained from Python on tensors."""
    import gpuaccel

    code, out, _ = run(capsys, "report", str(text_run))
    page = (text_run / "report.html").read_text()
    assert code == 0 and '<table id="summary"' in page and '<table id="evaluations">' in page
    assert "windows/s" in page and "tokens/s" in page and "test perplexity" in page and page.count("<svg") >= 1
    x = torch.randn(256, 3)
    y = x @ torch.tensor([1.0, -2.0, 0.5])
    regression = tmp_path / "regression"
    gpuaccel.Trainer(gpuaccel.TrainConfig(epochs=2, batch_size=32, lr=0.05, monitor=False, run_dir=str(regression)),
                     model=torch.nn.Linear(3, 1), train_data=(x, y.unsqueeze(1)), task="regression", quiet=True).fit()
    code, _, _ = run(capsys, "report", str(regression))
    page = (regression / "report.html").read_text()
    assert code == 0 and "test rmse" in page and "<th>rmse</th>" in page


def test_a_report_that_cannot_be_made_leaves_no_results_file(capsys, tmp_path):
    (tmp_path / "summary.json").write_text('{"model": "m"}')  # a summary without the rest
    assert_user_error(capsys, ["report", str(tmp_path)], "cannot read the run")
    assert not (tmp_path / "results.json").exists()


def test_a_report_into_a_run_it_cannot_write_says_so(train_run, capsys, monkeypatch):
    """A run on a read-only disk is read, not "unreadable": the write is what fails, and is named."""
    import gpuaccel.bench.report as report

    def read_only(path, write):
        raise PermissionError(30, "Read-only file system", str(path))
    monkeypatch.setattr(report, "atomic_write", read_only)
    assert_user_error(capsys, ["report", str(train_run)], f"cannot write the report into {train_run} "
                                                          "(Read-only file system)")


def test_a_bench_directory_is_one_benchmarks_alone(bench_run, capsys, tmp_path):
    from gpuaccel.files import RunLock

    assert_user_error(capsys, ["bench", "--quick", "--only", "cpu", "--run-dir", str(bench_run)],
                      "holds a benchmark's results already")
    (tmp_path / RunLock.NAME).write_text(f"1 {os.uname().nodename}\n")  # a live process benchmarks there now
    assert_user_error(capsys, ["bench", "--quick", "--only", "cpu", "--run-dir", str(tmp_path)], "is in use by process 1")


def test_bench_and_report_errors(capsys, tmp_path):
    assert_user_error(capsys, ["bench", "--only", "cpu,warp-drive"], "unknown rung 'warp-drive'", RUNG_NAMES[0])
    assert_user_error(capsys, ["bench", "--precision", "fp32"], "auto, bf16 or fp16")
    assert_user_error(capsys, ["bench", "--device", "cpu", "--precision", "fp16"], "fp16 needs a CUDA GPU")
    assert_user_error(capsys, ["bench", "--time-to-acc", "90"], "fraction")
    assert_user_error(capsys, ["report", str(tmp_path / "missing")], "is not a directory")
    assert_user_error(capsys, ["report", str(tmp_path)], "holds no gpuaccel run")
    (tmp_path / "results.json").write_text("{not json")
    assert_user_error(capsys, ["report", str(tmp_path)], "cannot read the run")


def _open_in_chromium(page_path: Path, screenshot: Path):
    playwright = pytest.importorskip("playwright.sync_api")
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=[
            "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
            "--disable-sync", "--no-first-run"])
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            errors = []
            page.on("console", lambda message: errors.append(message.text) if message.type == "error" else None)
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.goto(page_path.resolve().as_uri())
            page.wait_for_load_state("load")
            table = page.locator("table#ladder, table#summary").first
            table.screenshot(path=str(screenshot))
            box = table.bounding_box()
            rows = page.locator("table#ladder tr, table#summary tr").count()
            figures = page.locator("figure svg").count()
        finally:
            browser.close()
    return errors, box, rows, figures


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (.ci/run installs it)")
@pytest.mark.parametrize("which", ["bench_run", "train_run", "text_run"])
def test_report_renders_in_headless_chromium(which, request, tmp_path):
    from PIL import Image

    run_dir = request.getfixturevalue(which)
    errors, box, rows, figures = _open_in_chromium(run_dir / "report.html", tmp_path / "table.png")
    assert errors == []
    assert box is not None and box["width"] > 300 and box["height"] > 100 and box["y"] < 900
    assert rows >= 5 and figures >= 1
    shot = Image.open(tmp_path / "table.png").convert("L")
    low, high = shot.getextrema()
    assert shot.width > 300 and high - low > 100  # text on a background, not a blank box


def test_the_multi_gpu_rung_launches_a_valid_recipe_and_reports_a_failed_launch(monkeypatch, tmp_path):
    """The rung hands the previous rung's settings to `gpuaccel train --gpus N` as a recipe; with
    fewer than two GPUs the launcher refuses, and the rung is skipped with its reason."""
    from gpuaccel.bench import ladder
    from gpuaccel.train import TrainConfig
    from gpuaccel.train.recipes import load_recipe

    visible = torch.cuda.device_count()
    if visible >= 2:
        pytest.skip("two GPUs are here: the launch would run")
    monkeypatch.setattr(ladder.torch.cuda, "device_count", lambda: 2)  # the ladder sees two, the launcher does not
    rung = next(r for r in ladder.RUNGS if r.name == "multi-gpu")
    config = TrainConfig(data="digits", model="lenet5", batch_size=256, lr=0.2, compile=True,
                         compile_mode="reduce-overhead", device="cuda:0")
    row = ladder._measure_data_parallel(rung, config, ladder.BenchOptions(quick=True), 1.0, None, tmp_path,
                                        lambda line: None)
    assert row["skipped"] == "gpuaccel train --gpus 2 failed: --gpus 2 asks for more GPUs than present " \
                             f"({visible} visible to PyTorch)"
    settings = TrainConfig.from_dict(load_recipe(str(tmp_path / "rungs" / "multi-gpu-2.yaml"))).validate()
    assert (settings.loop.batch_size, settings.optimizer.lr, settings.runtime.compile_mode,
            settings.runtime.device) == \
        (256, 0.2, "reduce-overhead", "auto")  # per GPU, as the rung before; each process takes its own GPU
    assert settings.loop.time_limit == 0.9 and settings.loop.eval_every == 10**9 and settings.loop.target is None


def test_the_headline_rung_with_a_target_is_the_one_that_reached_it_soonest():
    from gpuaccel.bench.ladder import best_rung

    rows = [{"rung": "fast-but-wrong", "images_per_second": 9000.0, "time_to_acc": None, "final_accuracy": 0.225},
            {"rung": "slower", "images_per_second": 5000.0, "time_to_acc": 3.0, "final_accuracy": 0.8},
            {"rung": "slowest", "images_per_second": 3000.0, "time_to_acc": 4.5, "final_accuracy": 0.8}]
    assert best_rung(rows, 0.8)["rung"] == "slower" and best_rung(rows, 0.8)["ranked_by"] == "time to 80% accuracy"
    assert best_rung(rows, None)["rung"] == "fast-but-wrong"
    assert best_rung(rows[:1], 0.8)["unreached"] is True
