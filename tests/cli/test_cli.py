"""The command line: help a newcomer can read, and one clear line (exit 2) for every user error."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import CLASSES, assert_user_error, make_image_folder, run

from gpuaccel.cli import main

@pytest.fixture
def quick(tmp_path):
    """Common options for a fast run writing into tmp_path."""
    return ["--epochs", "1", "--quiet", "--cache-dir", str(tmp_path / "cache")]


def test_help_explains_the_options(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["train", "--help"])
    out = capsys.readouterr().out
    assert exc.value.code == 0
    for text in ("--data SPEC", "--target METRIC=VALUE", "--target-acc", "--resume RUN", "examples:", "digits"):
        assert text in out


def test_help_groups_the_data_settings_by_the_kinds_of_data_they_are_for(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    sections = {}  # option -> the title of the group it is listed under
    title = None
    for line in out.splitlines():
        if line and not line.startswith(" ") and line.endswith(":"):
            title = line[:-1]
        elif line.startswith("  --"):
            sections[line.split()[0]] = title
    assert sections["--data"] == sections["--val-split"] == "data settings"
    assert sections["--sample-rate"] == "data settings (audio data)"
    assert sections["--tokenizer"] == "data settings (text and sentences data)"
    assert sections["--zoom"] == "data settings (scenes data)"
    assert sections["--lr"] == "optimizer settings"


def test_console_script_entry_point(tmp_path):
    result = subprocess.run([sys.executable, "-m", "gpuaccel", "models"], capture_output=True, text=True)
    assert result.returncode == 0 and "resnet18" in result.stdout


def test_json_summary_on_stdout(capsys, tmp_path, quick):
    code, out, _ = run(capsys, "train", "--run-dir", str(tmp_path / "r"), "--json", *quick)
    summary = json.loads(out)
    assert code == 0 and summary["model"] == "lenet5" and summary["data"] == "digits"
    assert summary["run_dir"] == str(tmp_path / "r")


def test_human_summary(capsys, tmp_path, quick):
    code, out, _ = run(capsys, "train", "--recipe", "digits", "--run-dir", str(tmp_path / "r"), *quick)
    assert code == 0
    for label in ("device", "precision", "epochs", "time", "set-up", "throughput", "test accuracy", "saved to"):
        assert label in out


def test_missing_path(capsys, tmp_path):
    assert_user_error(capsys, ["train", "--data", str(tmp_path / "nope")], "does not exist")


def test_empty_data_set(capsys, tmp_path):
    (tmp_path / "empty" / "train" / "cat").mkdir(parents=True)
    assert_user_error(capsys, ["train", "--data", str(tmp_path / "empty")], "empty")


def test_class_folder_without_images(capsys, tmp_path, quick):
    root = make_image_folder(tmp_path / "img", per_class=(2, 1))
    (root / "train" / "zebra").mkdir()
    (root / "train" / "zebra" / "notes.txt").write_text("no images here")
    assert_user_error(capsys, ["train", "--data", str(root), *quick], "zebra", "holds no images")


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_bad_image_named_then_skipped(capsys, tmp_path, quick, damage):
    root = make_image_folder(tmp_path / "img", per_class=(4, 2), ext="jpg", size=32)
    bad = root / "train" / CLASSES[1] / "0002.jpg"
    bad.write_bytes(b"not an image" if damage == "garbage" else bad.read_bytes()[: len(bad.read_bytes()) // 2])
    assert_user_error(capsys, ["train", "--data", str(root), *quick], str(bad), "--skip-bad")
    code, out, err = run(capsys, "train", "--data", str(root), "--skip-bad", "--json",
                         "--run-dir", str(tmp_path / "r"), *quick)
    assert code == 0 and json.loads(out)["skipped_samples"] == 1


def test_labels_out_of_range(capsys, tmp_path):
    path = tmp_path / "bad.npz"
    np.savez(path, images=np.zeros((20, 4, 4), np.uint8), labels=np.arange(20) % 4, classes=np.array(["a", "b", "c"]))
    assert_user_error(capsys, ["train", "--data", str(path)], "label 3 is out of range", "3 classes")
    neg = tmp_path / "neg.npz"
    np.savez(neg, images=np.zeros((20, 4, 4), np.uint8), labels=np.arange(20) - 1)
    assert_user_error(capsys, ["train", "--data", str(neg)], "label -1 is out of range")


@pytest.mark.parametrize("argv,needles", [
    (["--model", "resnet9000"], ["unknown model 'resnet9000'", "lenet5"]),
    (["--optimizer", "lion"], ["unknown optimizer 'lion'", "sgd, adamw"]),
    (["--precision", "fp8"], ["unknown precision 'fp8'", "bf16"]),
    (["--schedule", "step"], ["unknown schedule 'step'", "onecycle"]),
    (["--flip", "sideways"], ["unknown flip 'sideways'", "alternate"]),
    (["--loader", "disk"], ["unknown loader 'disk'", "gpu"]),
    (["--batch-size", "0"], ["--batch-size must be"]),
    (["--epochs", "0"], ["--epochs must be a positive number"]),
    (["--target-acc", "99"], ["--target-acc is a fraction"]),
    (["--precision", "fp16", "--device", "cpu"], ["fp16 needs a CUDA GPU"]),
    (["--recipe", "nope"], ["unknown recipe 'nope'", "digits"]),
    (["--bogus"], ["unrecognized arguments: --bogus", "--help"]),
    (["--epochs", "many"], ["invalid float value"]),
    (["--data", "bogus:/tmp"], ["unknown data kind 'bogus'"]),
])
def test_unknown_or_invalid_values(capsys, argv, needles):
    assert_user_error(capsys, ["train", *argv], *needles)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_cuda_without_gpu(capsys):
    assert_user_error(capsys, ["train", "--device", "cuda"], "no CUDA GPU", "--device cpu")


def test_resume_errors(capsys, tmp_path, quick):
    assert_user_error(capsys, ["train", "--resume", str(tmp_path / "gone")], "does not exist")
    run_dir = tmp_path / "run"
    assert run(capsys, "train", "--run-dir", str(run_dir), *quick)[0] == 0
    assert_user_error(capsys, ["train", "--resume", str(run_dir), "--model", "mlp"],
                      "checkpoint of model 'lenet5'", "not 'mlp'")
    assert_user_error(capsys, ["train", "--resume", str(run_dir), "--lr", "1.0"], "--lr cannot change")
    (run_dir / "checkpoint.pt").write_bytes(b"this is not a checkpoint")
    assert_user_error(capsys, ["train", "--resume", str(run_dir)], "not a readable gpuaccel checkpoint")


def test_resume_can_extend_a_finished_run(capsys, tmp_path, quick):
    run_dir = tmp_path / "run"
    assert run(capsys, "train", "--run-dir", str(run_dir), *quick)[0] == 0
    code, out, _ = run(capsys, "train", "--resume", str(run_dir), "--epochs", "2", "--json")
    assert code == 0 and json.loads(out)["epochs"] == 2


def test_plain_train_is_the_demo_and_reaches_97_percent(capsys, tmp_path):
    code, out, _ = run(capsys, "train", "--run-dir", str(tmp_path / "r"), "--json", "--no-monitor")
    summary = json.loads(out)
    assert code == 0 and summary["metrics"]["accuracy"] >= 0.97 and summary["epochs"] == 15


def test_an_empty_inductor_cache_setting_counts_as_unset(monkeypatch):
    """TORCHINDUCTOR_CACHE_DIR="" names no folder: left in the environment, Inductor's first use
    (importing Dynamo, as a fused optimizer does on a GPU) fails trying to make ''."""
    import os

    from gpuaccel import caches
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "")
    monkeypatch.setenv("GPUACCEL_CACHE_DIR", "/proc/gpuaccel-cache")
    assert caches.use_compile_cache() is None and "TORCHINDUCTOR_CACHE_DIR" not in os.environ


def test_places_that_cannot_be_written_give_one_line_or_a_warning(tmp_path, capsys, monkeypatch):
    """A run directory (given, or the default runs/ under a read-only working directory) that
    cannot be made is one line and exit 2; a cache directory that cannot be written costs speed
    only: a warning, and the run goes on (a process of its own: caches are set up as it starts).
    (/proc refuses new entries, even to root.)"""
    import os

    train = ["train", "--epochs", "1", "--no-monitor", "--quiet"]
    line = assert_user_error(capsys, [*train, "--run-dir", "/proc/gpuaccel-run"], "cannot create ")
    assert line.startswith("gpuaccel: error: cannot create ")
    monkeypatch.chdir("/proc")
    assert assert_user_error(capsys, train, "cannot create ").startswith("gpuaccel: error: cannot create ")
    monkeypatch.chdir(tmp_path)
    done = subprocess.run([sys.executable, "-m", "gpuaccel", *train, "--run-dir", str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=300, check=False,
                          env={**os.environ, "GPUACCEL_CACHE_DIR": "/proc/gpuaccel-cache", "TORCHINDUCTOR_CACHE_DIR": ""})
    assert done.returncode == 0, done.stderr
    assert "the cache directory /proc/gpuaccel-cache cannot be written" in done.stderr


def test_a_cuda_build_on_a_machine_without_a_gpu_says_nothing_of_cuda_home(monkeypatch, tmp_path, capsys, caplog):
    """torch.utils.cpp_extension, imported when Inductor first compiles, tells a CUDA build of
    PyTorch on a machine without a GPU "No CUDA runtime is found, using CUDA_HOME=...": nothing a
    CPU user can act on. Simulated here: the module imported afresh as under a CUDA build."""
    import logging
    import sys

    import torch

    from gpuaccel.compiling import import_cpp_extension_quietly
    monkeypatch.setattr(torch.cuda, "_is_compiled", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setenv("CUDA_HOME", str(tmp_path))
    monkeypatch.delitem(sys.modules, "torch.utils.cpp_extension", raising=False)
    monkeypatch.delattr(torch.utils, "cpp_extension", raising=False)
    logger = logging.getLogger("torch.utils.cpp_extension")
    monkeypatch.setattr(logger, "filters", list(logger.filters))
    with caplog.at_level(logging.WARNING):
        import_cpp_extension_quietly()
    assert "torch.utils.cpp_extension" in sys.modules
    assert "CUDA_HOME" not in capsys.readouterr().err  # (printed, as earlier versions of PyTorch do)
    assert not [r for r in caplog.records if "CUDA_HOME" in r.getMessage()]  # (logged, as torch 2.13 does)


def test_options_are_spelled_out_and_a_mistyped_one_points_to_its_commands_help(capsys):
    line = assert_user_error(capsys, ["train", "--epoch", "1"], "unrecognized arguments: --epoch 1")
    assert "(see 'gpuaccel train --help')" in line
    line = assert_user_error(capsys, ["train", "--model", "resnet-18", "--epochs", "0.01"], "did you mean 'resnet18'?")
    assert "unknown model 'resnet-18'" in line


def test_help_says_what_train_and_infer_do_beyond_classifying_images(capsys):
    from gpuaccel.cli import build_parser

    parser = build_parser()
    top = " ".join(subprocess.run([sys.executable, "-m", "gpuaccel", "--help"], capture_output=True,
                                  text=True).stdout.split())
    assert "sentence pairs, recordings, ratings" in top and "image classification from the command line" not in top
    infer = " ".join(parser.commands["infer"].format_help().split())
    for words in ("with a detector, boxes", "with a segmenter, masks", "segmentation: a folder", "translation"):
        assert words in infer, words


def test_a_resume_says_where_it_continues_and_one_input_is_one(tmp_path, capsys):
    from PIL import Image

    run = tmp_path / "r"
    assert main(["train", "--epochs", "1", "--run-dir", str(run), "--no-monitor", "--quiet"]) == 0
    capsys.readouterr()
    assert main(["train", "--resume", str(run), "--epochs", "2", "--quiet"]) == 0
    assert main(["train", "--resume", str(run), "--epochs", "3"]) == 0
    err = capsys.readouterr().err
    assert f"resuming {run} from step " in err and "(epoch 2.00 of 3" in err
    Image.new("L", (8, 8), 128).save(tmp_path / "one.png")
    assert main(["infer", str(run), str(tmp_path / "one.png")]) == 0
    assert "\n1 image with pytorch" in "\n" + capsys.readouterr().err
