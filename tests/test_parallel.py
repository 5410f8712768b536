"""Data parallel on CPUs with gloo, started by PyTorch's own launcher (torch.distributed.run):
equivalence with one process, gradient accumulation without all-reduce, elastic restart
with resume, and the launcher's errors."""

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
from conftest import assert_user_error

from gpuaccel import TrainConfig, Trainer, create_model
from gpuaccel.errors import GpuaccelError
from gpuaccel.parallel import apply_ddp
from gpuaccel.parallel.launch import worker_arguments

TESTS = Path(__file__).parent
MODEL = "plain_models:plain_cnn"
COMMON = ["--device", "cpu", "--model", MODEL, "--lr", "0.05", "--quiet", "--no-monitor"]


def torchrun(*args, nproc=2, max_restarts=0, log=None):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           f"--max-restarts={max_restarts}", "-m", "gpuaccel", "train", *args]
    if log is not None:  # in the background, into a file: a pipe nobody reads would block the writers
        return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def weights(run_dir: Path) -> dict:
    return torch.load(run_dir / "model.pt", weights_only=True)["model"]


@pytest.mark.parametrize("per_process", [["--batch-size", "32"], ["--batch-size", "16", "--grad-accum", "2"],
                                         ["--batch-size", "16", "--grad-accum", "2", "--shard"]],
                         ids=["batch", "accumulation", "sharded"])
def test_two_processes_train_like_one_with_the_whole_batch(tmp_path, per_process):
    single, double = tmp_path / "one", tmp_path / "two"
    sys.path.insert(0, str(TESTS))
    try:
        Trainer(TrainConfig(device="cpu", model=MODEL, lr=0.05, batch_size=64, epochs=2, monitor=False,
                            run_dir=str(single)), quiet=True).fit()
    finally:
        sys.path.remove(str(TESTS))
    torchrun(*COMMON, *per_process, "--epochs", "2", "--run-dir", str(double))
    one, two = weights(single), weights(double)
    for key in one:
        torch.testing.assert_close(two[key], one[key], atol=2e-5, rtol=1e-4)
    summary = json.loads((double / "summary.json").read_text())
    assert summary["processes"] == 2 and summary["global_batch_size"] == 64
    assert summary["images_seen"] == json.loads((single / "summary.json").read_text())["images_seen"]
    assert not list(double.glob("gpu1*"))  # rank 0 alone writes the run directory


def _workers_of(agent_pid: int) -> list[int]:
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == agent_pid:
            children.append(int(stat.parent.name))
    return children


def test_a_killed_process_is_restarted_and_the_run_resumes(tmp_path):
    run_dir = tmp_path / "elastic"
    epochs, batch, world = 12, 16, 2
    log = open(tmp_path / "torchrun.log", "w")
    agent = torchrun(*COMMON, "--batch-size", str(batch), "--epochs", str(epochs), "--checkpoint-every", "10",
                     "--run-dir", str(run_dir), max_restarts=1, log=log)
    try:
        deadline = time.time() + 120
        while time.time() < deadline:  # wait for a mid-run checkpoint, then kill one worker
            state = run_dir / "checkpoint.json"
            if state.exists() and json.loads(state.read_text())["global_step"] >= 30:
                break
            time.sleep(0.01)
        else:
            pytest.fail("no checkpoint appeared")
        workers = _workers_of(agent.pid)
        assert len(workers) == world
        os.kill(workers[-1], signal.SIGKILL)
        agent.wait(timeout=300)
    finally:
        agent.kill()
        log.close()
    assert agent.returncode == 0, (tmp_path / "torchrun.log").read_text()[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["restarts"] == 1 and summary["stopped_by"] == "epochs" and summary["epochs"] == epochs
    steps_per_epoch = (1438 // world) // batch  # digits: 1438 training images, sharded, full batches
    assert summary["images_seen"] == epochs * steps_per_epoch * batch * world  # as if never interrupted
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in records] == [float(e) for e in range(1, epochs + 1)]


def test_launcher_errors_and_arguments(capsys):
    assert_user_error(capsys, ["train", "--gpus", "64"], "more GPUs than present")
    assert worker_arguments(["--gpus", "2", "--epochs", "3", "--max-restarts=1"], "runs/x") == \
        ["--epochs", "3", "--run-dir", "runs/x"]
    assert worker_arguments(["--gpus=2", "--run-dir", "mine"], "runs/x") == ["--run-dir", "mine"]
    model = create_model("lenet5", num_classes=10, in_channels=1, image_size=8)
    with pytest.raises(GpuaccelError, match="--sync-bn needs GPUs"):
        apply_ddp(model, torch.device("cpu"), sync_batchnorm=True)


# --- activation checkpointing ---------------------------------------------------------------------------

def test_activation_checkpointing_keeps_gradients_and_parameter_names():
    from gpuaccel.parallel import apply_activation_checkpointing

    torch.manual_seed(0)
    plain = create_model("resnet18", num_classes=10, in_channels=3, image_size=32)
    wrapped = create_model("resnet18", num_classes=10, in_channels=3, image_size=32)
    wrapped.load_state_dict(plain.state_dict())
    assert apply_activation_checkpointing(wrapped) == 8  # ResNet-18's eight basic blocks
    assert list(wrapped.state_dict()) == list(plain.state_dict())
    x, y = torch.randn(4, 3, 32, 32), torch.tensor([0, 1, 2, 3])
    for model in (plain, wrapped):
        torch.nn.functional.cross_entropy(model(x), y).backward()
    for (name, a), b in zip(plain.named_parameters(), wrapped.parameters()):
        assert torch.allclose(a.grad, b.grad, atol=1e-5), name


def test_activation_checkpointing_from_the_cli_and_without_blocks(capsys, tmp_path):
    from conftest import run

    code, out, err = run(capsys, "train", "--data", "digits", "--model", "resnet18", "--activation-checkpointing",
                         "--epochs", "1", "--batch-size", "512", "--quiet", "--json", "--run-dir", str(tmp_path / "r"))
    assert code == 0, err
    assert json.loads((tmp_path / "r" / "config.json").read_text())["activation_checkpointing"] is True
    assert_user_error(capsys, ["train", "--data", "digits", "--model", "mlp", "--activation-checkpointing"],
                      "--activation-checkpointing found no blocks")


# --- fully sharded data parallel -------------------------------------------------------------------------

def test_a_sharded_run_resumes_to_the_same_weights_and_saves_whole_checkpoints(tmp_path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    # a constant learning rate: a schedule stretched to the new length on resume would differ
    # 359 test images in batches of 179: one rank evaluates 180 images in 2 batches, the other 1 batch
    common = [*COMMON, "--shard", "--batch-size", "16", "--schedule", "constant", "--warmup-epochs", "0",
              "--eval-batch-size", "179"]
    torchrun(*common, "--epochs", "3", "--run-dir", str(straight))
    torchrun(*common, "--epochs", "1", "--run-dir", str(resumed))
    torchrun("--resume", str(resumed), "--epochs", "3", "--quiet", "--no-monitor")
    one, two = weights(straight), weights(resumed)
    for key in one:
        torch.testing.assert_close(two[key], one[key], atol=1e-6, rtol=1e-5)
    # the checkpoint is whole: it loads into the plain model, optimizer state included
    state = torch.load(resumed / "checkpoint.pt", weights_only=False)
    sys.path.insert(0, str(TESTS))
    try:
        plain = create_model(MODEL, num_classes=10, in_channels=1, image_size=8)
    finally:
        sys.path.remove(str(TESTS))
    plain.load_state_dict(state["model"])
    assert len(state["optimizer"]["state"]) == len(list(plain.parameters()))


def test_shard_errors(capsys, monkeypatch):
    assert_user_error(capsys, ["train", "--data", "digits", "--shard", "--ema", "0.9"], "--ema", "--shard")
    import gpuaccel.parallel.fsdp as fsdp

    monkeypatch.setattr(fsdp.dist, "is_available", lambda: False)
    assert_user_error(capsys, ["train", "--data", "digits", "--shard", "--epochs", "1"], "--shard needs torch.distributed")
