"""Export and verify round trips, inference with every artefact, and the deployment errors."""

from __future__ import annotations

import csv
import io
import json
import os
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import CLASSES, make_image_folder
from PIL import Image

from gpuaccel import TrainConfig, Trainer
from gpuaccel.cli import main
from gpuaccel.deploy import export, load_runner, load_trained, runners, verify
from gpuaccel.deploy.runners import onnx_has_cuda, openvino_version

FORMATS = ["onnx", "pt2", "torchscript"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("deploy") / "run"
    Trainer(TrainConfig(model="lenet5", epochs=3, batch_size=32, run_dir=str(path)), quiet=True).fit()
    return path


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dynamic", [True, False])
def test_export_round_trip_matches_the_original(run_dir, tmp_path, fmt, dynamic):
    trained = load_trained(run_dir)
    artifact = export(trained, fmt, tmp_path / f"m.{fmt}", dynamic_batch=dynamic)
    images = np.random.default_rng(0).integers(0, 256, (37, 1, 8, 8), dtype=np.uint8)
    report = verify(trained, artifact, images, dynamic_batch=dynamic)
    assert report["passed"] and report["top1_agreement"] == 1.0 and report["max_abs_diff"] < 1e-4
    meta = json.loads((tmp_path / f"m.{fmt}.json").read_text())
    assert meta["classes"] == trained.classes and meta["in_channels"] == 1 and meta["image_size"] == 8
    if dynamic:  # any batch size runs
        assert load_runner(artifact)(np.random.rand(5, 1, 8, 8).astype(np.float32)).shape == (5, 10)


def test_export_cli_verifies_on_held_out_data(run_dir, tmp_path, capsys):
    out = tmp_path / "cli.onnx"
    code = main(["export", str(run_dir), "--format", "onnx", "--out", str(out), "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["passed"] and report["images"] == 359  # the digits held-out split
    assert out.exists()


def test_exported_model_has_normalisation_inside(run_dir):
    """Fed raw [0, 1] test images, the deployable module scores what the trainer measured with
    its own normalisation (on the same CPU, in fp32), so the statistics built in are the
    training data's."""
    trained = load_trained(run_dir)
    data = trained.load_data(None, "test")
    with torch.no_grad():
        logits = trained.module(torch.from_numpy(data.test_images).float() / 255)
    accuracy = (logits.argmax(1).numpy() == data.test_labels).mean()
    recorded = json.loads((run_dir / "summary.json").read_text())["metrics"]["accuracy"]
    assert accuracy == pytest.approx(recorded, abs=1e-6) and recorded > 0.5
    assert trained.module.mean.shape == (1, 1, 1, 1) and 0 < trained.module.std.item() < 1


def test_infer_on_a_folder_writes_the_expected_csv(run_dir, tmp_path, capsys):
    folder = tmp_path / "imgs"
    folder.mkdir()
    for i in range(3):
        Image.fromarray(np.full((8, 8), 40 * i, np.uint8), "L").save(folder / f"{i}.png")
    csv_path = tmp_path / "preds.csv"
    code = main(["infer", str(run_dir / "model.pt"), str(folder), "--top-k", "3", "--out", str(csv_path)])
    err = capsys.readouterr().err
    rows = list(csv.reader(io.StringIO(csv_path.read_text())))
    assert code == 0 and rows[0] == ["input", "class_1", "prob_1", "class_2", "prob_2", "class_3", "prob_3"]
    assert [r[0] for r in rows[1:]] == [str(folder / f"{i}.png") for i in range(3)]
    for row in rows[1:]:
        probs = [float(p) for p in row[2::2]]
        assert row[1] in [str(d) for d in range(10)] and probs == sorted(probs, reverse=True)
    assert "images/s" in err and "latency median" in err


def test_infer_on_a_data_set_reports_accuracy_with_every_backend(run_dir, tmp_path, capsys):
    onnx_path = export(load_trained(run_dir), "onnx", tmp_path / "m.onnx", dynamic_batch=True)
    for model in (str(run_dir), str(onnx_path)):
        assert main(["infer", model, "digits", "--out", str(tmp_path / "p.csv"), "--force"]) == 0
        err = capsys.readouterr().err
        accuracy = float(re.search(r"accuracy ([\d.]+)% on the held-out split of digits \(20% of its images held", err)[1])
        assert accuracy > 80


def test_infer_converts_channels_and_size_with_warnings(run_dir, tmp_path, capsys):
    root = make_image_folder(tmp_path / "rgb", per_class=(4, 0), size=12, split=False)
    with pytest.warns(UserWarning) as caught:  # (a folder of images: each one labelled)
        assert main(["infer", str(run_dir), str(root / CLASSES[0])]) == 0
    messages = " ".join(str(w.message) for w in caught)
    assert "3 channel(s), the model takes 1" in messages and "resized" in messages
    assert len(capsys.readouterr().out.strip().splitlines()) == 1 + 4


def _one_line_error(capsys, argv, *needles):
    code = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("gpuaccel: error:"), err
    for needle in needles:
        assert needle in err[0]


def test_deploy_errors(run_dir, tmp_path, capsys):
    not_ckpt = tmp_path / "x.pt"
    torch.save({"weights": torch.ones(2)}, not_ckpt)
    _one_line_error(capsys, ["export", str(not_ckpt)], "not a gpuaccel checkpoint")
    bad_onnx = tmp_path / "bad.onnx"
    bad_onnx.write_bytes(b"\x08\x01garbage")
    (tmp_path / "bad.onnx.json").write_text(json.dumps({"classes": ["a"], "in_channels": 1, "image_size": 8}))
    _one_line_error(capsys, ["infer", str(bad_onnx), "digits"], "not a valid ONNX model")
    _one_line_error(capsys, ["export", str(run_dir), "--format", "tflite"], "unknown export format 'tflite'")
    _one_line_error(capsys, ["export", str(run_dir), "--data", str(tmp_path / "missing")],
                    "cannot load held-out images", "--data")
    _one_line_error(capsys, ["infer", str(tmp_path / "none.onnx"), "digits"], "does not exist")


def test_unexportable_model_names_the_problem_and_suggests_another_format(tmp_path):
    from gpuaccel import GpuaccelError
    from gpuaccel.deploy.artifact import Normalized, TrainedModel

    class DataDependent(torch.nn.Module):
        def forward(self, x):
            if x.mean() > 0.5:  # control flow on a tensor's value: torch.export cannot capture it
                return x.flatten(1)[:, :2]
            return -x.flatten(1)[:, :2]

    trained = TrainedModel(Normalized(DataDependent(), [0.0], [1.0]), ["a", "b"], "custom",
                           {"in_channels": 1, "image_size": 4, "num_classes": 2}, {}, tmp_path)
    with pytest.raises(GpuaccelError, match="cannot be exported as pt2: its forward pass branches on a tensor's "
                                            r"value \(test_deploy.py:\d+\).*torch.where"):
        export(trained, "pt2", tmp_path / "m.pt2")


def test_fp16_conversion_halves_the_file_and_keeps_accuracy(run_dir, tmp_path, capsys):
    out = tmp_path / "m.fp16.onnx"
    code = main(["quantize", str(run_dir), "--fp16", "--out", str(out), "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["artifact"] == str(out)
    assert report["fp16"]["size_bytes"] < 0.7 * report["fp32"]["size_bytes"]
    assert abs(report["fp16"]["test_accuracy"] - report["fp32"]["test_accuracy"]) <= 0.01
    assert json.loads((tmp_path / "m.fp16.onnx.json").read_text())["format"] == "onnx-fp16"
    probs = load_runner(out)(np.random.rand(3, 1, 8, 8).astype(np.float32))
    assert probs.dtype == np.float32 and probs.shape == (3, 10)  # float32 in and out




@pytest.mark.gpu
@pytest.mark.skipif(not onnx_has_cuda(), reason="needs onnxruntime-gpu")
def test_fp16_artefact_is_evaluated_and_timed_on_the_gpu(run_dir, tmp_path, capsys):
    out = tmp_path / "m.fp16.onnx"
    assert main(["quantize", str(run_dir), "--fp16", "--out", str(out), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["device"] == "cuda"
    assert abs(report["fp16"]["test_accuracy"] - report["fp32"]["test_accuracy"]) <= 0.01
    x = np.random.default_rng(0).random((4, 1, 8, 8), dtype=np.float32)
    on_gpu, on_cpu = load_runner(out, "cuda")(x), load_runner(out)(x)
    np.testing.assert_allclose(on_gpu, on_cpu, atol=0.05)  # the same artefact, two runtimes


@pytest.mark.gpu
@pytest.mark.skipif(not onnx_has_cuda(), reason="needs onnxruntime-gpu")
def test_bench_infer_times_onnx_runtime_on_the_gpu(run_dir, capsys):
    assert main(["bench-infer", str(run_dir), "--repeats", "20", "--json"]) == 0
    rows = {r["backend"]: r for r in json.loads(capsys.readouterr().out)["rows"]}
    for name in ("onnxruntime-cuda-fp32", "onnxruntime-cuda-fp16", "onnxruntime-cuda-fp16-cuda-graphs"):
        assert rows[name]["latency_p50_ms"] > 0 and rows[name]["best_images_per_second"] > 0, rows[name]


@pytest.mark.gpu
@pytest.mark.skipif(not onnx_has_cuda(), reason="needs onnxruntime-gpu")
@pytest.mark.parametrize("cuda_graph", [False, True])
def test_gpu_bound_onnx_calls_see_each_new_input(run_dir, tmp_path, cuda_graph):
    from gpuaccel.deploy.bench import onnx_cuda_call

    onnx_file = export(load_trained(run_dir), "onnx", tmp_path / "m.onnx", dynamic_batch=True)
    call = onnx_cuda_call(onnx_file, torch.device("cuda"), cuda_graph=cuda_graph)
    reference = load_runner(onnx_file)
    for seed in range(3):  # a replayed graph must read each call's input, not the first one's
        x = torch.rand(5, 1, 8, 8, generator=torch.Generator().manual_seed(seed)).cuda()
        np.testing.assert_allclose(call(x).cpu().numpy(), reference(x.cpu().numpy()), rtol=1e-2, atol=1e-2)


def test_onnx_on_a_gpu_without_onnxruntime_gpu_is_a_clear_error(run_dir, tmp_path, capsys, monkeypatch):
    onnx_file = export(load_trained(run_dir), "onnx", tmp_path / "m.onnx")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the GPU side of the check is not under test
    monkeypatch.setattr(runners, "onnx_has_cuda", lambda: False)
    _one_line_error(capsys, ["infer", str(onnx_file), "digits", "--device", "cuda:0"],
                    "needs onnxruntime-gpu", "--device cpu")
    # a build that lists the CUDA provider but cannot start it falls back to the CPU; that is an error too
    monkeypatch.setattr(runners, "onnx_has_cuda", lambda: True)
    if not onnx_has_cuda():  # a CPU-only onnxruntime really does fall back
        _one_line_error(capsys, ["infer", str(onnx_file), "digits", "--device", "cuda:0"],
                        "could not start its CUDA provider")


def test_int8_quantisation_keeps_digits_accuracy(run_dir, tmp_path, capsys):
    out = tmp_path / "m.int8.onnx"
    code = main(["quantize", str(run_dir), "--int8", "--calib", "256", "--out", str(out), "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and out.exists() and report["calibration_samples"] == 256
    assert report["int8"]["size_bytes"] < report["fp32"]["size_bytes"]
    assert report["int8"]["test_accuracy"] >= report["fp32"]["test_accuracy"] - 0.02
    import onnx
    ops = {node.op_type for node in onnx.load(str(out)).graph.node}
    assert {"QuantizeLinear", "DequantizeLinear"} <= ops  # really quantised, not a copy
    assert main(["quantize", str(run_dir), "--int8", "--calib", "64", "--out", str(tmp_path / "again.onnx")]) == 0
    err = capsys.readouterr().err  # (minutes for a large model: each stage is said as it starts)
    stages = ["exporting the model to ONNX", "calibrating and quantising to int8 on 64", "evaluating and timing"]
    assert all(stage in err for stage in stages) and err.index(stages[0]) < err.index(stages[2])


def test_quantize_without_calibration_data_is_a_clear_error(run_dir, tmp_path, capsys):
    _one_line_error(capsys, ["quantize", str(run_dir), "--int8", "--data", str(tmp_path / "gone")],
                    "no data to calibrate", "--data")
    _one_line_error(capsys, ["quantize", str(run_dir)], "--int8")
    _one_line_error(capsys, ["quantize", str(run_dir), "--int8", "--fp16"], "one of them")
    _one_line_error(capsys, ["bench-infer", str(run_dir), "--threads", "0"], "--threads")


def test_bench_infer_covers_the_cpu_backends(run_dir, capsys):
    threads = torch.get_num_threads()
    try:
        assert main(["bench-infer", str(run_dir), "--repeats", "20", "--threads", "1", "--json"]) == 0
    finally:
        torch.set_num_threads(threads)
    result = json.loads(capsys.readouterr().out)
    assert result["cpu_threads"] == 1 and result["onnxruntime_threads"] == 1
    names = [r["backend"] for r in result["rows"]]
    cpu_rows = ["pytorch-cpu-fp32", "onnxruntime-cpu-fp32", "onnxruntime-cpu-int8"]
    if openvino_version():
        cpu_rows += ["openvino-cpu-fp32", "openvino-cpu-int8"]
    assert names[:len(cpu_rows)] == cpu_rows
    for row in result["rows"][:len(cpu_rows)]:
        assert 0 < row["latency_p50_ms"] <= row["latency_p99_ms"] and row["best_images_per_second"] > 0


needs_openvino = pytest.mark.skipif(openvino_version() is None, reason="needs OpenVINO (gpuaccel[openvino])")


@needs_openvino
def test_openvino_runs_fp32_and_int8_onnx_like_onnx_runtime(run_dir, tmp_path, capsys):
    from gpuaccel.data import load_dataset
    from gpuaccel.deploy.quantize import calibration_sample, quantize_int8

    data = load_dataset("digits")
    fp32 = export(load_trained(run_dir), "onnx", tmp_path / "m.onnx", dynamic_batch=True)
    int8 = quantize_int8(fp32, tmp_path / "m.int8.onnx", calibration_sample(data.train_images, 256))
    (tmp_path / "m.int8.onnx.json").write_text((tmp_path / "m.onnx.json").read_text())
    images = data.test_images.astype(np.float32) / 255
    for path, tolerance, min_agreement in ((fp32, 1e-4, 1.0), (int8, None, 0.97)):
        reference = load_runner(path)(images)
        openvino = load_runner(path, threads=1, runtime="openvino")
        assert openvino.kind == "openvino"
        logits = openvino(images)
        assert logits.shape == reference.shape
        agreement = np.mean(logits.argmax(1) == reference.argmax(1))
        assert agreement >= min_agreement, (path.name, agreement)
        if tolerance is not None:
            np.testing.assert_allclose(logits, reference, atol=tolerance)
    assert main(["infer", str(int8), "digits", "--runtime", "openvino", "--out", str(tmp_path / "p.csv")]) == 0
    err = capsys.readouterr().err
    assert "with openvino on cpu" in err and float(re.search(r"accuracy ([\d.]+)%", err)[1]) > 80
    bad_onnx = tmp_path / "bad.onnx"
    bad_onnx.write_bytes(b"\x08\x01garbage")
    (tmp_path / "bad.onnx.json").write_text((tmp_path / "m.onnx.json").read_text())
    _one_line_error(capsys, ["infer", str(bad_onnx), "digits", "--runtime", "openvino"], "OpenVINO cannot read")


@needs_openvino
def test_quantize_reports_openvino_latency_and_accuracy(run_dir, tmp_path, capsys):
    out = tmp_path / "m.int8.onnx"
    code = main(["quantize", str(run_dir), "--int8", "--calib", "256", "--out", str(out), "--runtime", "openvino",
                 "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["runtime"] == "openvino" and report["device"] == "cpu"
    assert report["int8"]["test_accuracy"] >= report["fp32"]["test_accuracy"] - 0.02
    assert report["int8"]["latency_p50_ms"] > 0 and report["fp32"]["best_images_per_second"] > 0


def test_runtime_errors(run_dir, tmp_path, capsys, monkeypatch):
    onnx_file = export(load_trained(run_dir), "onnx", tmp_path / "m.onnx")
    _one_line_error(capsys, ["infer", str(onnx_file), "digits", "--runtime", "tvm"], "unknown runtime 'tvm'",
                    "openvino")
    _one_line_error(capsys, ["quantize", str(run_dir), "--int8", "--runtime", "tvm"], "unknown runtime 'tvm'")
    _one_line_error(capsys, ["infer", str(run_dir), "digits", "--runtime", "openvino"], "runs .onnx files")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    _one_line_error(capsys, ["infer", str(onnx_file), "digits", "--runtime", "openvino", "--device", "cuda"],
                    "on the CPU")
    monkeypatch.setitem(sys.modules, "openvino", None)  # as if not installed
    _one_line_error(capsys, ["infer", str(onnx_file), "digits", "--runtime", "openvino"],
                    "pip install 'gpuaccel[openvino]'")


def test_an_export_or_quantisation_that_dies_mid_write_leaves_the_previous_artefact(run_dir, tmp_path, monkeypatch,
                                                                                    capsys):
    pytest.importorskip("onnxruntime")
    import importlib

    export_module = importlib.import_module("gpuaccel.deploy.export")  # (the package re-exports a function of that name)

    out = tmp_path / "m.onnx"
    assert main(["export", str(run_dir), "--out", str(out), "--json"]) == 0
    int8 = tmp_path / "m.int8.onnx"
    assert main(["quantize", str(out), "--int8", "--calib", "64", "--out", str(int8), "--json"]) == 0
    capsys.readouterr()
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}

    def dies_half_way(path):
        def write(*args):
            target = next(a for a in args if isinstance(a, (str, type(out))) and str(a).endswith(".tmp"))
            open(target, "wb").write(b"\x08\x01half an ONNX file")
            raise KeyboardInterrupt  # what SIGINT raises; SIGKILL leaves the .tmp file, removed later
        return write

    monkeypatch.setattr(export_module, "_write", lambda fmt, module, example, path, *rest: dies_half_way(path)(path))
    assert main(["export", str(run_dir), "--out", str(out)]) == 130  # "interrupted"
    monkeypatch.setattr("onnxruntime.quantization.quantize_static",
                        lambda model, path, *args, **kw: dies_half_way(path)(path))
    assert main(["quantize", str(out), "--int8", "--calib", "64", "--out", str(int8)]) == 130
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before  # nothing half-written, nothing left over
    assert main(["infer", str(int8), "digits", "--out", str(tmp_path / "p.csv")]) == 0


def test_quantisation_keeps_its_intermediate_files_beside_its_output_where_a_later_lock_removes_them(
        run_dir, tmp_path, monkeypatch, capsys):
    """The fp32 export and ONNX Runtime's prepared model live in a hidden scratch directory beside
    the output, not in the system's temporary directory, where a killed quantisation would leave
    tens of MB until a reboot; the next command that takes the run's lock removes a leftover one."""
    pytest.importorskip("onnxruntime")
    import onnxruntime.quantization as ortq

    from gpuaccel.files import remove_stale_temporaries, run_directory_lock

    real, seen = ortq.quantize_static, []

    def quantize_static(model, path, *args, **kw):
        seen.append(Path(model))
        return real(model, path, *args, **kw)

    monkeypatch.setattr(ortq, "quantize_static", quantize_static)
    assert main(["quantize", str(run_dir), "--int8", "--calib", "64", "--json"]) == 0
    capsys.readouterr()
    scratch = seen[0].parent
    assert scratch.parent == run_dir and scratch.name.startswith(".model.int8.onnx.") and scratch.name.endswith(".tmp")
    assert not scratch.exists()  # removed when quantisation ended
    left = run_dir / ".model.int8.onnx.killed.tmp"  # what SIGKILL would leave
    (left / "sub").mkdir(parents=True)
    (left / "prepared.onnx").write_bytes(b"x" * 1000)
    with run_directory_lock(run_dir):
        pass
    assert not left.exists() and remove_stale_temporaries(run_dir) == []


def test_an_export_to_a_place_that_cannot_be_written_names_the_place_not_the_format(run_dir, capsys):
    """(/proc refuses new files and directories, even to root.)"""
    _one_line_error(capsys, ["export", str(run_dir), "--out", "/proc/gpuaccel-m.onnx"],
                    "cannot write /proc/gpuaccel-m.onnx")
    _one_line_error(capsys, ["export", str(run_dir), "--out", "/proc/gpuaccel-dir/m.onnx"], "cannot create /proc/gpuaccel-dir")


BRANCHY = """
import torch.nn as nn

class Branchy(nn.Module):
    def __init__(self, num_classes=10, in_channels=1, image_size=8):
        super().__init__()
        self.a = nn.Linear(in_channels * image_size * image_size, num_classes)
        self.b = nn.Linear(in_channels * image_size * image_size, num_classes)

    def forward(self, x):
        x = x.flatten(1)
        if x.sum() > 0:  # a branch on a value: an export keeps one way or refuses
            return self.a(x)
        return self.b(x) * 3.0

def branchy(num_classes=10, in_channels=1, image_size=8):
    return Branchy(num_classes, in_channels, image_size)
"""


def test_a_branch_on_a_tensor_value_is_one_line_and_an_unverified_export_is_removed(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "branchy.py").write_text(BRANCHY)
    run = tmp_path / "run"
    assert main(["train", "--model", "branchy:branchy", "--epochs", "1", "--run-dir", str(run), "--quiet"]) == 0
    capsys.readouterr()
    for fmt in ("onnx", "pt2"):
        code = main(["export", str(run), "--format", fmt])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1, err  # (not the traced graph)
        assert "branches on a tensor's value (branchy.py:12)" in err[0]
    code = main(["export", str(run), "--format", "torchscript"])  # traced: one branch kept, the outputs differ
    err = capsys.readouterr().err
    assert code == 1 and "the outputs differ" in err and "removed it" in err
    assert not (run / "model.ts").exists() and not (run / "model.ts.json").exists()
    assert main(["export", str(run), "--format", "torchscript", "--keep-unverified"]) == 1
    assert (run / "model.ts").exists()


def test_infer_never_replaces_a_file_of_the_run_and_another_file_only_with_force(run_dir, tmp_path, capsys):
    before = (run_dir / "model.pt").read_bytes()
    _one_line_error(capsys, ["infer", str(run_dir), "digits", "--out", str(run_dir / "model.pt")],
                    "is the run's own model.pt")
    _one_line_error(capsys, ["infer", str(run_dir), "digits", "--out", str(run_dir / "model.pt"), "--force"],
                    "is the run's own model.pt")
    assert (run_dir / "model.pt").read_bytes() == before
    out = tmp_path / "predictions.csv"
    out.write_text("keep me")
    _one_line_error(capsys, ["infer", str(run_dir), "digits", "--out", str(out)], "exists; pass --force")
    assert out.read_text() == "keep me"
    assert main(["infer", str(run_dir), "digits", "--out", str(out), "--force"]) == 0
    assert out.read_text().startswith("input,class_1,prob_1")
    capsys.readouterr()
    _one_line_error(capsys, ["export", str(run_dir), "--out", str(run_dir / "checkpoint.pt")],
                    "is the run's own checkpoint.pt")


def test_infer_on_a_fifo_is_one_line(run_dir, tmp_path, capsys):
    fifo = tmp_path / "x.png"
    os.mkfifo(fifo)
    _one_line_error(capsys, ["infer", str(run_dir), str(fifo)], "is a FIFO (named pipe), not a regular file")
    zero = tmp_path / "z.png"
    os.symlink("/dev/zero", zero)
    _one_line_error(capsys, ["infer", str(run_dir), str(zero)], "is a device, not a regular file")


def test_infer_on_a_folder_of_class_folders_scores_its_held_out_split_and_says_which(run_dir, tmp_path, capsys):
    """A folder of class folders is a data set, as MNIST's files are: its held-out split, with the
    accuracy and which split it was; a flat folder of images is images to label."""
    folder = make_image_folder(tmp_path / "classes", per_class=(10, 4), size=8, split=True)
    assert main(["infer", str(run_dir), str(folder)]) == 0
    out, err = capsys.readouterr()
    assert len(out.strip().splitlines()) == 1 + 4 * len(CLASSES)  # the test/ folder's images only
    assert "accuracy" in err and "on the held-out split of classes (its test split)" in err
    flat = make_image_folder(tmp_path / "flat", per_class=(3, 0), size=8, split=False) / CLASSES[0]
    assert main(["infer", str(run_dir), str(flat)]) == 0
    out, err = capsys.readouterr()
    assert len(out.strip().splitlines()) == 1 + 3 and "accuracy" not in err


def test_inputs_are_fitted_to_the_model_a_part_at_a_time_with_the_same_result(monkeypatch):
    """(Grey and resized a few images at a time: a whole chunk's float copies were 8-16x its bytes.)"""
    from gpuaccel.deploy import infer

    images = np.random.default_rng(0).integers(0, 256, (20, 3, 12, 10), dtype=np.uint8)
    with pytest.warns(UserWarning):
        whole = infer.fit_to_model(images, 1, 8)
    monkeypatch.setattr(infer, "FITTED_AT_ONCE", 7)
    with pytest.warns(UserWarning):
        parts = infer.fit_to_model(images, 1, 8)
    assert whole.shape == (20, 1, 8, 8) and whole.dtype == np.uint8 and np.array_equal(parts, whole)


def test_inputs_are_decoded_one_chunk_ahead_of_the_model_not_more():
    """(Decoders faster than the model had filled a third chunk while the model worked on the first.)"""
    import time

    from gpuaccel.deploy.infer import ahead

    made = []

    def chunks():
        for i in range(5):
            made.append(i)
            yield i

    for chunk in ahead(chunks()):
        time.sleep(0.05)  # (the model, slower than the decoders)
        assert max(made) <= chunk + 1, (chunk, made)
    assert made == list(range(5))


def test_infer_memory_does_not_grow_with_the_number_of_inputs(run_dir, tmp_path, capsys, monkeypatch):
    """Files are read, run and written a chunk at a time: five times the frames take no more memory
    (each frame's RGB-to-grey conversion alone is 49 KB of floats: all at once they would)."""
    import tracemalloc

    from gpuaccel.deploy import infer

    monkeypatch.setattr(infer, "CHUNK", 150)
    frames = np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    peaks = {}
    for count in (300, 1500):
        folder = tmp_path / f"frames{count}"
        folder.mkdir()
        for i in range(count):
            Image.fromarray(np.roll(frames, i, axis=1)).save(folder / f"{i:05d}.png")
        out = tmp_path / f"p{count}.csv"
        tracemalloc.start()
        with pytest.warns(UserWarning):  # (the channel and size conversions are said)
            assert main(["infer", str(run_dir), str(folder), "--out", str(out)]) == 0
        peaks[count] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        rows = out.read_text().splitlines()
        assert len(rows) == 1 + count and rows[1].startswith(str(folder / "00000.png"))
        assert rows[-1].startswith(str(folder / f"{count - 1:05d}.png"))  # in input order
    assert peaks[1500] <= 1.2 * peaks[300], peaks
