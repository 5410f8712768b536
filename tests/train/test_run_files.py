"""Run directories a user can trust: one process at a time, no torn or lost records, readable
files, and a resume that refuses data that changed."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from gpuaccel import GpuaccelError, TrainConfig, Trainer
from gpuaccel.data import ImageDataset, load_dataset
from gpuaccel.files import MetricsFile, RunLock, atomic_write, remove_stale_temporaries


def test_a_run_directory_in_use_refuses_a_second_process(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (tmp_path / ".lock").write_text(f"{holder.pid} {os.uname().nodename}\n")
        with pytest.raises(GpuaccelError, match=f"in use by process {holder.pid}"):
            RunLock(tmp_path).acquire()
        with pytest.raises(GpuaccelError, match=f"process {holder.pid}"):
            Trainer(TrainConfig(epochs=1, run_dir=str(tmp_path), monitor=False), quiet=True).fit()
    finally:
        holder.kill()
        holder.wait()
    # the holder is gone: its stale lock does not block the next run
    summary = Trainer(TrainConfig(epochs=1, run_dir=str(tmp_path), monitor=False), quiet=True).fit()
    assert summary["epochs"] == 1 and not (tmp_path / ".lock").exists()


def test_two_cli_runs_into_one_directory_at_once_do_not_both_succeed(tmp_path):
    command = [sys.executable, "-m", "gpuaccel", "train", "--epochs", "4", "--run-dir", str(tmp_path / "r"),
               "--no-monitor", "--quiet"]
    first, second = (subprocess.Popen(command, stderr=subprocess.PIPE, text=True) for _ in range(2))
    results = [(p.wait(timeout=300), p.stderr.read()) for p in (first, second)]
    codes = sorted(code for code, _ in results)
    assert codes[0] == 0 and codes[1] == 2, results  # one trained; the other was told, in one line
    refused = next(err for code, err in results if code == 2)
    assert "in use by process" in refused or "already holds a run" in refused
    records = MetricsFile(tmp_path / "r" / "metrics.jsonl").read()
    assert [r["epoch"] for r in records] == [1, 2, 3, 4]  # one run's log, not two interleaved


def test_a_torn_last_metrics_line_is_skipped_and_repaired_on_resume(tmp_path):
    run = tmp_path / "r"
    Trainer(TrainConfig(epochs=2, run_dir=str(run), monitor=False), quiet=True).fit()
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 99, "epoch": 2.5, "tra')  # a crash (or a full disk) in the middle of an append
    assert len(MetricsFile(run / "metrics.jsonl").read()) == 2
    resumed = Trainer.resume(run, overrides={"epochs": 3}, quiet=True)
    resumed.fit()
    lines = (run / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["epoch"] for line in lines] == [1, 2, 3]


def test_a_torn_line_inside_the_file_is_an_error_not_a_skip(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"st\n{"step": 3}\n')
    with pytest.raises(GpuaccelError, match="line 2 is not JSON"):
        MetricsFile(path).read()


def test_files_follow_the_umask_and_stale_temporaries_go(tmp_path):
    previous = os.umask(0o022)
    try:
        atomic_write(tmp_path / "a.json", lambda f: f.write(b"{}"))
        assert (tmp_path / "a.json").stat().st_mode & 0o777 == 0o644  # mkstemp alone gives 0600
    finally:
        os.umask(previous)
    stale = tmp_path / ".checkpoint.pt.abc123.tmp"
    stale.write_bytes(b"\0" * 1000)
    assert remove_stale_temporaries(tmp_path) == [stale] and not stale.exists()


def test_resume_cleans_what_a_killed_checkpoint_write_left(tmp_path):
    run = tmp_path / "r"
    Trainer(TrainConfig(epochs=1, run_dir=str(run), monitor=False), quiet=True).fit()
    (run / ".checkpoint.pt.x1y2.tmp").write_bytes(b"\0" * 4096)
    (run / "checkpoint.json").write_text('{"global_step": 1}')  # out of step with checkpoint.pt
    trainer = Trainer.resume(run, overrides={"epochs": 2}, quiet=True)
    assert not list(run.glob(".*.tmp"))
    assert json.loads((run / "checkpoint.json").read_text())["global_step"] == trainer.state.global_step
    trainer.run.unlock()


def test_resume_with_a_damaged_or_missing_config_json_takes_the_checkpoints_settings(tmp_path, capsys):
    run = tmp_path / "r"
    Trainer(TrainConfig(epochs=1, batch_size=64, run_dir=str(run), monitor=False), quiet=True).fit()
    for damage in ("{not json", None):
        if damage is None:
            (run / "config.json").unlink()
        else:
            (run / "config.json").write_text(damage)
        trainer = Trainer.resume(run, overrides={"epochs": 1}, quiet=False)
        trainer.run.unlock()
        assert trainer.config.loop.batch_size == 64
        assert json.loads((run / "config.json").read_text())["loop"]["batch_size"] == 64  # rewritten
        assert ("is damaged" if damage else "is missing") in capsys.readouterr().err


def test_resume_takes_its_settings_from_the_checkpoint_whatever_config_json_lacks(tmp_path, capsys):
    run = tmp_path / "r"
    Trainer(TrainConfig(epochs=1, batch_size=32, lr=0.02, run_dir=str(run), monitor=False), quiet=True).fit()
    written = json.loads((run / "config.json").read_text())
    without_batch = {**written, "loop": {k: v for k, v in written["loop"].items() if k != "batch_size"}}
    edits = [({}, "lacks"), (without_batch, "lacks batch_size"),
             ({**written, "optimizer": {**written["optimizer"], "lr": 0.5}}, "differs from the checkpoint in lr"),
             (TrainConfig.from_dict(written).flat() | {"lr": 0.5},
              "differs from the checkpoint in lr")]  # flat, as before
    for edited, said in edits:
        (run / "config.json").write_text(json.dumps(edited))
        trainer = Trainer.resume(run, overrides={"epochs": 2}, quiet=False)
        trainer.run.unlock()
        assert (trainer.config.loop.batch_size, trainer.config.optimizer.lr, trainer.config.loop.epochs) == (32, 0.02,
                                                                                                             2)
        assert json.loads((run / "config.json").read_text())["loop"]["batch_size"] == 32  # rewritten
        err = capsys.readouterr().err
        assert "resuming with the settings checkpoint.pt holds" in err and said in err, err


def test_a_checkpoint_whose_format_version_is_not_a_number_is_one_line(tmp_path, capsys):
    from gpuaccel.cli import main

    run = tmp_path / "r"
    Trainer(TrainConfig(epochs=1, run_dir=str(run), monitor=False), quiet=True).fit()
    for name in ("checkpoint.pt", "model.pt"):
        state = torch.load(run / name, weights_only=True)
        torch.save({**state, "version": "1"}, run / name)
    capsys.readouterr()
    for argv in (["train", "--resume", str(run)], ["infer", str(run), "digits"]):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "its format version '1' is not a whole number" in err[0], err


def test_a_run_directory_that_cannot_be_written_is_one_line_for_the_commands_that_lock_it(tmp_path, capsys,
                                                                                         monkeypatch):
    import errno

    from gpuaccel.cli import main

    run = tmp_path / "r"
    Trainer(TrainConfig(epochs=1, run_dir=str(run), monitor=False), quiet=True).fit()
    real_open = os.open

    def read_only(path, flags, *args, **kwargs):  # (a read-only mount; as root, a chmod would not stop it)
        if str(path).endswith(".lock") and flags & os.O_CREAT:
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return real_open(path, flags, *args, **kwargs)
    monkeypatch.setattr(os, "open", read_only)
    capsys.readouterr()
    for argv in (["export", str(run)], ["train", "--resume", str(run)]):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"cannot write into {run} (Read-only file system)" in err[0], err


def test_resume_refuses_data_whose_class_names_changed(tmp_path):
    digits = load_dataset("digits")
    run = tmp_path / "r"
    Trainer(TrainConfig(epochs=1, run_dir=str(run), monitor=False), dataset=digits, quiet=True).fit()
    renamed = ImageDataset(digits.name, digits.train_images, digits.train_labels, digits.test_images,
                           digits.test_labels, [f"digit {c}" for c in digits.classes], source=digits.source)
    with pytest.raises(GpuaccelError, match="the data changed since .* its classes") as caught:
        Trainer.resume(run, overrides={"epochs": 2}, train_data=renamed, quiet=True)
    assert "\n" not in str(caught.value)
    assert not (run / ".lock").exists()  # a refused resume leaves the directory free
    assert Trainer.resume(run, overrides={"epochs": 2}, train_data=digits, quiet=True).fit()["epochs"] == 2


def test_resume_through_the_cli_refuses_renamed_classes(tmp_path):
    from gpuaccel.cli import main

    data = tmp_path / "d.npz"
    rng = np.random.default_rng(0)
    labels = np.arange(60) % 3
    images = (rng.integers(0, 40, (60, 1, 8, 8)) + 150 * (labels[:, None, None, None] == np.arange(3)[None, :, None,
                                                                                                        None])[:, :1]
              ).astype(np.uint8)
    np.savez(data, images=images, labels=labels, classes=np.array(["a", "b", "c"]))
    run = tmp_path / "r"
    assert main(["train", "--data", str(data), "--epochs", "1", "--run-dir", str(run), "--no-monitor",
                 "--quiet", "--cache-dir", str(tmp_path / "cache")]) == 0
    np.savez(data, images=images, labels=labels, classes=np.array(["x", "b", "c"]))
    assert main(["train", "--resume", str(run), "--epochs", "2", "--quiet"]) == 2


def test_a_full_disk_is_one_clear_error():
    with pytest.raises(GpuaccelError, match="no space left on device while writing /dev/full"):
        MetricsFile("/dev/full").append({"step": 1})


def test_a_disk_that_fills_during_a_checkpoint_is_one_line_and_the_last_checkpoint_stays(tmp_path, monkeypatch):
    """As torch.save reports it: an inline_container RuntimeError raised while handling the
    write's ENOSPC."""
    import errno

    run = tmp_path / "r"
    Trainer(TrainConfig(epochs=1, run_dir=str(run), monitor=False), quiet=True).fit()
    before = (run / "checkpoint.pt").read_bytes()
    real_save = torch.save

    def full_disk(obj, f, *args, **kwargs):
        real_save({"partial": True}, f)
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0") from None

    monkeypatch.setattr(torch, "save", full_disk)  # (what every checkpoint is written through)
    trainer = Trainer.resume(run, overrides={"epochs": 2}, quiet=True)
    with pytest.raises(GpuaccelError, match=r"no space left on device while writing .*checkpoint.pt"):
        trainer.fit()
    trainer.run.unlock()
    assert (run / "checkpoint.pt").read_bytes() == before and not list(run.glob(".*.tmp"))


def test_states_are_written_without_zip_checksums_and_read_back(tmp_path):
    """(torch.load never checks them, and computing them took a third of torch.save's time.)"""
    import zipfile

    from gpuaccel.runtime.state import read_state, write_state

    weights = torch.arange(10_000.0)
    write_state(tmp_path / "state.pt", {"w": weights})
    assert torch.equal(read_state(tmp_path / "state.pt")["w"], weights)
    assert torch.serialization.get_crc32_options()  # (PyTorch's own setting, put back)
    with zipfile.ZipFile(tmp_path / "state.pt") as archive:
        assert archive.testzip() is not None  # (the first record whose checksum is not its bytes')


def test_an_interrupt_mid_write_stays_an_interrupt_and_leaves_the_old_file(tmp_path):
    """torch.save's zip writer turns a Ctrl-C that arrives mid-write into a RuntimeError as it
    closes; the command must still see the interrupt (and end with 130, checkpoint saved)."""
    target = tmp_path / "model.pt"
    target.write_bytes(b"the old file")
    state = {"w": torch.zeros(1000)}

    def interrupted(f):
        try:
            torch.save(state, f)
            raise KeyboardInterrupt
        except KeyboardInterrupt:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 146048 vs 145944")

    with pytest.raises(KeyboardInterrupt):
        atomic_write(target, interrupted)
    assert target.read_bytes() == b"the old file" and not list(tmp_path.glob(".*.tmp"))


def test_the_default_export_takes_any_batch_and_infer_out_is_replaced_whole(tmp_path, capsys, monkeypatch):
    from gpuaccel.cli import main

    run = tmp_path / "r"
    assert main(["train", "--epochs", "1", "--run-dir", str(run), "--no-monitor", "--quiet"]) == 0
    assert main(["export", str(run), "--out", str(tmp_path / "m.onnx"), "--verify-images", "50"]) == 0
    assert json.loads((tmp_path / "m.onnx.json").read_text())["dynamic_batch"] is True
    images = tmp_path / "images"
    images.mkdir()
    from PIL import Image

    for name in ("a.png", "b.png", "c.png"):
        Image.new("L", (8, 8), 200).save(images / name)
    os.rename(images / "c.png", os.fsencode(images) + b"/odd-\xff.png")  # not valid UTF-8
    out = tmp_path / "predictions.csv"
    out.write_text("earlier results\n")
    capsys.readouterr()
    assert main(["infer", str(tmp_path / "m.onnx"), str(images), "--out", str(out), "--force"]) == 0  # 3 images
    rows = out.read_text().splitlines()
    assert len(rows) == 4 and any("odd-\\udcff.png" in row for row in rows)
    assert main(["infer", str(tmp_path / "m.onnx"), str(tmp_path / "missing"), "--out", str(out), "--force"]) == 2
    assert len(out.read_text().splitlines()) == 4  # a failed command leaves the earlier file as it was
    nested = tmp_path / "new" / "dir" / "p.csv"  # made where missing
    assert main(["infer", str(tmp_path / "m.onnx"), str(images), "--out", str(nested)]) == 0 and nested.is_file()
    capsys.readouterr()
    assert main(["infer", str(tmp_path / "m.onnx"), str(images), "--out", str(tmp_path)]) == 2  # a directory
    assert "is a directory; give a file name" in capsys.readouterr().err
    (images / "broken.png").write_bytes(b"\x89PNG not really")  # stops the command, or is left out
    assert main(["infer", str(tmp_path / "m.onnx"), str(images), "--out", str(out), "--force"]) == 2
    assert "broken.png" in capsys.readouterr().err and len(out.read_text().splitlines()) == 4
    with pytest.warns(UserWarning, match="skipped .*broken.png: not a readable image"):
        assert main(["infer", str(tmp_path / "m.onnx"), str(images), "--out", str(out), "--skip-bad", "--force"]) == 0
    assert len(out.read_text().splitlines()) == 4  # the three readable images
    from PIL import Image as PillowImage

    def unreadable(fp, *args, **kwargs):  # (a file this user may not read: mode 000 as another user)
        if str(fp).endswith("a.png"):
            raise PermissionError(13, "Permission denied", str(fp))
        return open_image(fp, *args, **kwargs)
    open_image = PillowImage.open
    monkeypatch.setattr(PillowImage, "open", unreadable)
    (images / "broken.png").unlink()
    with pytest.warns(UserWarning, match="skipped .*a.png: permission denied"):
        assert main(["infer", str(tmp_path / "m.onnx"), str(images), "--out", str(out), "--skip-bad", "--force"]) == 0


def test_an_interrupted_final_evaluation_is_redone_on_resume(tmp_path, monkeypatch):
    run = tmp_path / "r"
    trainer = Trainer(TrainConfig(epochs=2, run_dir=str(run), monitor=False), quiet=True)
    evaluate = Trainer.evaluate
    calls = []

    def interrupted_at_the_end(self, **kwargs):  # (kwargs: the warm-up's pass on a GPU)
        calls.append(self.state.global_step)
        if self.epochs_done >= self.config.loop.epochs:
            raise KeyboardInterrupt  # Ctrl-C during the final evaluation
        return evaluate(self, **kwargs)
    monkeypatch.setattr(Trainer, "evaluate", interrupted_at_the_end)
    with pytest.raises(KeyboardInterrupt):
        trainer.fit()
    monkeypatch.setattr(Trainer, "evaluate", evaluate)
    assert len(MetricsFile(run / "metrics.jsonl").read()) == 1
    summary = Trainer.resume(run, quiet=True).fit()
    records = MetricsFile(run / "metrics.jsonl").read()
    assert [r["epoch"] for r in records] == [1, 2] and records[-1]["train_loss"] is None
    assert summary["metrics"]["accuracy"] == pytest.approx(records[-1]["accuracy"], abs=1e-6)
    assert summary["steps"] == trainer.state.global_step


def test_a_diverging_run_stops_with_a_clear_error(tmp_path, capsys):
    from gpuaccel.cli import main

    code = main(["train", "--lr", "1e30", "--epochs", "2", "--run-dir", str(tmp_path / "r"), "--no-monitor",
                 "--quiet"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "training diverged" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "r" / "model.pt").exists()


def test_resume_with_more_epochs_says_so_and_updates_config_json(tmp_path, capsys):
    run = tmp_path / "r"
    Trainer(TrainConfig(epochs=1, run_dir=str(run), monitor=False), quiet=True).fit()
    capsys.readouterr()
    Trainer.resume(run, overrides={"epochs": 2}).fit()
    err = capsys.readouterr().err
    assert "resuming with --epochs 2 (was 1)" in err and "config.json updated" in err
    assert json.loads((run / "config.json").read_text())["loop"]["epochs"] == 2


def test_a_run_with_a_relative_data_path_resumes_from_elsewhere(tmp_path, monkeypatch, mnist_dir):
    from gpuaccel.cli import main

    monkeypatch.chdir(mnist_dir.parent)
    run = tmp_path / "r"
    assert main(["train", "--data", mnist_dir.name, "--epochs", "1", "--run-dir", str(run), "--no-monitor",
                 "--quiet", "--cache-dir", str(tmp_path / "c")]) == 0
    assert json.loads((run / "config.json").read_text())["data"]["source"] == str(mnist_dir.resolve())
    monkeypatch.chdir(tmp_path)
    # the same data spelled another way is not a change
    assert main(["train", "--resume", str(run), "--data", str(mnist_dir) + "/", "--epochs", "2", "--quiet"]) == 0


def _npz(path, images, labels, **arrays):
    np.savez(path, images=images, labels=labels, **arrays)
    return str(path)


@pytest.mark.parametrize("images, labels, message", [
    (np.full((20, 1, 8, 8), np.nan, dtype=np.float32), np.arange(20) % 2, "NaN or infinite"),
    (np.zeros((20, 1, 8, 8), np.uint8), np.arange(19) % 2, "20 training images but 19 labels"),
    (np.zeros((20, 1, 8, 8), np.uint8), np.zeros(20, int), "has one class"),
])
def test_bad_npz_data_is_a_one_line_error(tmp_path, capsys, images, labels, message):
    from gpuaccel.cli import main

    spec = _npz(tmp_path / "d.npz", images, labels)
    code = main(["train", "--data", spec, "--epochs", "1", "--run-dir", str(tmp_path / "r"), "--quiet",
                 "--cache-dir", str(tmp_path / "c")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and message in err and len(err.splitlines()) == 1, err


def test_sparse_labels_become_that_many_classes_named_by_label(tmp_path):
    spec = _npz(tmp_path / "d.npz", np.random.default_rng(0).integers(0, 255, (40, 1, 8, 8), dtype=np.uint8),
                np.where(np.arange(40) % 2, 7, 0))
    with pytest.warns(UserWarning, match="labels 0, 7 are used as classes 0..1"):
        ds = load_dataset(spec, cache_dir=None)
    assert ds.classes == ["0", "7"] and set(np.unique(ds.train_labels)) == {0, 1}


def test_batch_size_one_with_batch_norm_is_refused(tmp_path):
    with pytest.raises(GpuaccelError, match="batch norms need two or more"):
        Trainer(TrainConfig(model="resnet18", batch_size=1, run_dir=str(tmp_path / "r"), monitor=False))


def test_a_damaged_export_sidecar_is_a_one_line_error(tmp_path, capsys):
    from gpuaccel.cli import main

    run = tmp_path / "r"
    assert main(["train", "--epochs", "1", "--run-dir", str(run), "--no-monitor", "--quiet"]) == 0
    assert main(["export", str(run), "--out", str(tmp_path / "m.onnx"), "--verify-images", "20"]) == 0
    sidecar = tmp_path / "m.onnx.json"
    assert json.loads(sidecar.read_text())["task"]["name"] == "classification"
    sidecar.write_text(sidecar.read_text()[:40])  # truncated
    capsys.readouterr()
    assert main(["infer", str(tmp_path / "m.onnx"), "digits"]) == 2
    err = capsys.readouterr().err.strip()
    assert "is damaged" in err and len(err.splitlines()) == 1


def test_a_symbolic_link_loop_in_an_image_folder_is_a_one_line_error(tmp_path, capsys):
    from PIL import Image

    from gpuaccel.cli import main

    for cls in ("a", "b"):
        (tmp_path / "imgs" / cls).mkdir(parents=True)
        for i in range(3):
            Image.new("L", (8, 8), 60 * i).save(tmp_path / "imgs" / cls / f"{i}.png")
    os.symlink("..", tmp_path / "imgs" / "a" / "up")
    assert main(["train", "--data", str(tmp_path / "imgs"), "--epochs", "1", "--quiet", "--run-dir",
                 str(tmp_path / "r"), "--cache-dir", str(tmp_path / "c")]) == 2
    err = capsys.readouterr().err.strip()
    assert "symbolic link loop" in err and len(err.splitlines()) == 1


def test_a_decompression_bomb_is_a_bad_image_not_a_traceback(tmp_path, monkeypatch):
    from PIL import Image

    from gpuaccel.data.images import ImageSource, _decode_one

    Image.new("L", (64, 64)).save(tmp_path / "big.png")
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)  # 4096 pixels is over twice the limit: an error
    array, reason = _decode_one(ImageSource("big.png", str(tmp_path / "big.png")), None)
    assert array is None and "too large to decode safely" in reason


def test_new_directories_of_one_name_get_their_own_suffix(tmp_path):
    from gpuaccel.files import new_directory

    made = [new_directory(tmp_path / "runs" / "bench-x-20261127-031500") for _ in range(3)]
    assert [p.name for p in made] == ["bench-x-20261127-031500", "bench-x-20261127-031500~2",
                                      "bench-x-20261127-031500~3"]
    assert all(p.is_dir() for p in made)


def test_commands_that_write_into_a_run_directory_take_its_lock(tmp_path, capsys):
    from gpuaccel.cli import main

    run = tmp_path / "r"
    assert main(["train", "--epochs", "1", "--run-dir", str(run), "--no-monitor", "--quiet"]) == 0
    (run / ".lock").write_text(f"{os.getppid()} {os.uname().nodename}\n")  # a live process trains there
    capsys.readouterr()
    for command in (["export", str(run), "--verify-images", "20"], ["quantize", str(run), "--fp16"]):
        assert main(command) == 2
        assert f"{run} is in use by process {os.getppid()}" in capsys.readouterr().err
    assert not list(run.glob("*.onnx"))
    elsewhere = tmp_path / "elsewhere.onnx"  # reading the run to write elsewhere is fine
    assert main(["export", str(run), "--out", str(elsewhere), "--verify-images", "20"]) == 0 and elsewhere.is_file()
    (run / ".lock").unlink()
    assert main(["export", str(run), "--verify-images", "20"]) == 0
    assert (run / "model.onnx").is_file() and not (run / ".lock").exists()
