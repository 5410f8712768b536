"""Data parallel on CPUs with gloo: equivalence with one process, gradient accumulation without
all-reduce, elastic restart with resume, and the launcher's errors. What is about launching
(restarts, a killed launcher, one process's error stopping the others, Slurm) runs under
PyTorch's own launcher (torch.distributed.run); what the processes compute together runs in
processes forked with torchrun's environment (tests/launch.py: seconds of imports less a launch)."""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import assert_user_error
from launch import free_port, run_processes

from gpuaccel import TrainConfig, Trainer, create_model
from gpuaccel.errors import GpuaccelError
from gpuaccel.parallel import apply_ddp
from gpuaccel.parallel.launch import worker_arguments

TESTS = Path(__file__).resolve().parents[1]  # (the helpers beside conftest.py)
MODEL = "plain_models:plain_cnn"
COMMON = ["--device", "cpu", "--model", MODEL, "--lr", "0.05", "--quiet", "--no-monitor"]


def torchrun(*args, log, max_restarts=0) -> subprocess.Popen:
    """``gpuaccel train ARGS`` in two processes under torchrun, started in the background, their
    output into ``log`` (a file: a pipe nobody reads would block the writers)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           f"--max-restarts={max_restarts}", "-m", "gpuaccel", "train", *args]
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)


@contextlib.contextmanager
def plain_models_importable():
    """plain_models (this folder) importable in this process, as torchrun's get it on PYTHONPATH."""
    sys.path.insert(0, str(TESTS))
    try:
        yield
    finally:
        sys.path.remove(str(TESTS))


def train_one_process(run_dir: Path, **settings) -> None:
    """The single-process reference run, on the CPU, quietly."""
    with plain_models_importable():
        Trainer(TrainConfig(device="cpu", lr=0.05, monitor=False, run_dir=str(run_dir), **settings), quiet=True).fit()



@pytest.fixture(scope="module")
def one_process_run(tmp_path_factory) -> Path:
    """The reference most tests here compare with, trained once for them all: MODEL, batch 64,
    2 epochs, one process (read only)."""
    run_dir = tmp_path_factory.mktemp("reference") / "one"
    train_one_process(run_dir, model=MODEL, batch_size=64, epochs=2)
    return run_dir

def weights(run_dir: Path) -> dict:
    return torch.load(run_dir / "model.pt", weights_only=True)["model"]


def assert_same_training(reference: Path, run: Path, *, processes: int, global_batch: int, atol: float) -> None:
    """``run`` ended with ``reference``'s weights, after as many images, with ``processes``."""
    one, two = weights(reference), weights(run)
    assert sorted(one) == sorted(two)
    for key in one:
        torch.testing.assert_close(two[key].float(), one[key].float(), atol=atol, rtol=1e-4)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["processes"] == processes and summary["global_batch_size"] == global_batch
    assert summary["samples_seen"] == json.loads((reference / "summary.json").read_text())["samples_seen"]


# (a per-process --batch-size 32 trains exactly what --batch-size 64 --global-batch does, so the
# plain data-parallel case is the global-batch one; the other tests give per-process batches)
@pytest.mark.parametrize("per_process", [["--batch-size", "16", "--grad-accum", "2"],
                                         ["--batch-size", "16", "--grad-accum", "2", "--shard"],
                                         ["--batch-size", "64", "--global-batch"]],
                         ids=["accumulation", "sharded", "global-batch"])
def test_two_processes_train_like_one_with_the_whole_batch(tmp_path, one_process_run, per_process):
    single, double = one_process_run, tmp_path / "two"
    run_processes(*COMMON, *per_process, "--epochs", "2", "--run-dir", str(double))
    assert_same_training(single, double, processes=2, global_batch=64, atol=2e-5)
    assert not list(double.glob("gpu1*"))  # rank 0 alone writes the run directory


def test_step_graph_averages_gradients_like_one_process_with_the_whole_batch(tmp_path, one_process_run):
    """The data parallel a captured step does (rank 0's weights broadcast, the gradients averaged
    inside the step: in one all-reduce after the backward pass, or in buckets of 1 kB launched
    from the backward pass as it finishes them, on the last micro-batch of an accumulation only),
    run eagerly on CPUs, trains like one process with the whole batch. (One launch for the three.)"""
    runs = {"one-all-reduce": "32", "buckets": "32:0.001:1", "buckets-accumulation": "16:0.001:2"}
    done = run_processes("2", *(f"{tmp_path / name}:{spec}" for name, spec in runs.items()),
                         program=(str(TESTS / "step_graph_worker.py"),))
    for name in runs:
        assert_same_training(one_process_run, tmp_path / name, processes=2, global_batch=64, atol=2e-5)
    for name in ("buckets", "buckets-accumulation"):  # plain_cnn's gradients from the last layer's: 1.3, 65.7, 0.3 kB
        for rank in (0, 1):
            assert f"{tmp_path / name}: rank {rank}: 3 buckets" in done.stdout, (name, done.stdout[-2000:])


@pytest.fixture(scope="module")
def dlrm_one_process(tmp_path_factory) -> Path:
    """The run directory of tests/dlrm_worker.py's DLRM trained by one process with the whole
    batch of 64: what the data-parallel runs below must match."""
    from dlrm_worker import train

    single = tmp_path_factory.mktemp("dlrm") / "one"
    train(str(single), 64)
    return single


def test_dlrm_tables_updated_in_the_backward_pass_train_on_two_processes_like_one(tmp_path, dlrm_one_process):
    """Tables sharded across the processes (3 tables on 2 processes: one slot without a table;
    each process looks up and updates its tables' rows for every process's ids; graph-chunks: the
    rows and gradients cross in 2 chunks of the records) or replicated (each process gathers
    every process's rows and gradients); either way the update is the one a process with the
    whole batch takes, and model.pt holds the whole tables. (One launch for the four.)"""
    single, kinds = dlrm_one_process, ["ddp", "graph", "graph-chunks", "ddp-replicated"]
    run_processes(str(tmp_path), "32", ",".join(kinds), program=(str(TESTS / "dlrm_worker.py"),))
    reference = json.loads((single / "summary.json").read_text())["metrics"]
    for kind in kinds:
        double = tmp_path / kind
        assert_same_training(single, double, processes=2, global_batch=64, atol=2e-5)
        assert torch.load(double / "model.pt", weights_only=True)["model"]["tables.accumulator"].sum() > 0
        summary = json.loads((double / "summary.json").read_text())
        assert ("tables sharded across the processes" in summary["strategy"]) == (kind != "ddp-replicated"), \
            (kind, summary["strategy"])
        assert summary["metrics"] == pytest.approx(reference, rel=1e-4), kind  # the held-out set evaluated alike


def test_dlrm_tables_sharded_over_more_processes_than_tables_train_like_one(tmp_path, dlrm_one_process):
    """3 tables on 4 processes: one process holds no table (its slot looks up the spare row).
    (One launch for both kinds.)"""
    single, kinds = dlrm_one_process, ["graph", "graph-chunks"]
    run_processes(str(tmp_path), "16", ",".join(kinds), nproc=4, program=(str(TESTS / "dlrm_worker.py"),))
    reference = json.loads((single / "summary.json").read_text())["metrics"]
    for kind in kinds:
        assert_same_training(single, tmp_path / kind, processes=4, global_batch=64, atol=2e-5)
        assert json.loads((tmp_path / kind / "summary.json").read_text())["metrics"] == pytest.approx(reference, rel=1e-4), kind


@pytest.mark.parametrize("processes", [2, 4])
def test_sharded_tables_update_only_their_own_rows_and_save_and_load_whole_tables(tmp_path, processes):
    """A slot without a table looks up a spare zero row; updating it from every process's ids
    piled world x batch atomic adds onto one row (the worker asserts it never is). 3 tables: 2
    processes have one blank slot between them, on 4 one process holds no table. Their state is
    the whole tables, and loading whole tables keeps each process's share. (One launch for both:
    a launch costs seconds on a CPU.)"""
    run_processes(str(tmp_path), "8", "tables", nproc=processes, program=(str(TESTS / "dlrm_worker.py"),))
    back = torch.load(tmp_path / "state.pt", weights_only=True)
    assert torch.equal(back["weight"], torch.arange(800.0).view(100, 8))
    assert torch.equal(back["accumulator"], torch.arange(100.0))


def test_a_weight_average_of_sharded_tables_is_refused_on_every_process(tmp_path):
    done = run_processes(str(tmp_path / "run"), "32", "ema", program=(str(TESTS / "dlrm_worker.py"),))
    # (the two processes share the output: their lines may interleave)
    assert sorted(re.findall(r"rank (\d) refused", done.stdout)) == ["0", "1"], done.stdout
    assert "ema cannot average embedding tables sharded across processes" in done.stdout


def test_sharded_and_pipelined_strategies_refuse_tables_updated_in_the_backward_pass():
    from gpuaccel.parallel.base import refuse_backward_updates

    model = create_model("dlrm", table_sizes=[5, 3], dim=4, bottom=[8], top=[8], required=())
    with pytest.raises(GpuaccelError, match="tables.weight, which its module updates inside the backward pass"):
        refuse_backward_updates(model, "FSDP (--shard)")
    refuse_backward_updates(create_model("resnet18"), "FSDP (--shard)")  # nothing of the kind: accepted


def test_a_run_directory_refused_on_rank_0_stops_every_process_with_one_line(tmp_path):
    """Rank 0 alone looks at the run directory; its refusal reaches the others, which would
    otherwise wait for rank 0 in a collective (with NCCL, until the process group's timeout)."""
    train_one_process(tmp_path / "taken", model=MODEL, batch_size=64, epochs=1)
    output = run_processes(*COMMON, "--run-dir", str(tmp_path / "taken"), exit_codes=[2, 2], timeout=120).stdout
    assert output.count("gpuaccel: error: ") == 2 and output.count("already holds a run") == 2, output[-3000:]
    assert "Traceback" not in output, output[-3000:]


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
    assert summary["samples_seen"] == epochs * steps_per_epoch * batch * world  # as if never interrupted
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in records] == [float(e) for e in range(1, epochs + 1)]
    # the same samples in the same order as a run never interrupted: the weights of one process
    # with the whole batch
    train_one_process(tmp_path / "one", model=MODEL, batch_size=batch * world, epochs=epochs)
    assert_same_training(tmp_path / "one", run_dir, processes=world, global_batch=batch * world, atol=5e-5)


def test_the_tasks_of_a_slurm_step_on_two_machines_train_like_one_process(tmp_path, one_process_run):
    """srun's tasks, one per node of two "machines" (each its node's task 0), find each other
    from the SLURM_* variables alone, with no torchrun, and train like one process."""
    single, double = one_process_run, tmp_path / "two"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    env.update(PYTHONPATH=os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]), OMP_NUM_THREADS="1",
               SLURM_STEP_NUM_TASKS="2", SLURM_NNODES="2", SLURM_STEP_NODELIST="localhost,127.0.0.1",
               SLURM_JOB_ID="4242", MASTER_PORT=str(free_port()))
    tasks = [subprocess.Popen([sys.executable, "-m", "gpuaccel", "train", *COMMON, "--batch-size", "32", "--epochs",
                               "2", "--run-dir", str(double)],
                              env={**env, "SLURM_PROCID": str(task), "SLURM_NODEID": str(task), "SLURM_LOCALID": "0"},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for task in range(2)]
    outputs = [task.communicate(timeout=300)[0] for task in tasks]
    assert [task.returncode for task in tasks] == [0, 0], outputs
    assert_same_training(single, double, processes=2, global_batch=64, atol=2e-5)


def test_slurm_variables_name_the_process_group():
    from gpuaccel.parallel.distributed import first_host, slurm_environment

    step = {"SLURM_PROCID": "5", "SLURM_STEP_NUM_TASKS": "8", "SLURM_LOCALID": "1",
            "SLURM_STEP_NODELIST": "gpu[07-09,12],cpu1", "SLURM_JOB_ID": "123456"}
    assert slurm_environment(step) == {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "gpu07",
                                       "MASTER_PORT": "29956"}
    assert slurm_environment({**step, "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "1234"})["MASTER_ADDR"] == "10.0.0.1"
    assert slurm_environment({**step, "RANK": "0"}) == {}  # torchrun (under srun) set it up already
    # a batch script in an allocation of many tasks is one process: the job's count is not the step's
    assert slurm_environment({"SLURM_PROCID": "0", "SLURM_NTASKS": "8", "SLURM_JOB_NODELIST": "n1"}) == {}
    assert [first_host(n) for n in ("n1,n2", "node[3-4]", "a[09]-ib,b1", "x")] == ["n1", "node3", "a09-ib", "x"]


RANK_DATA = """import os, sys
from gpuaccel.cli import main
data = sys.argv[1] if os.environ["RANK"] == "0" else sys.argv[2]  # each rank its own --data
sys.exit(main(["train", "--data", data, *sys.argv[3:]]))
"""


@pytest.mark.parametrize("difference", ["pixels", "classes"])
def test_processes_given_different_data_stop_at_start_with_one_line(tmp_path, difference):
    import shutil

    import numpy as np
    from conftest import make_image_folder
    from PIL import Image

    first = make_image_folder(tmp_path / "a", per_class=(8, 2), size=8)
    other = tmp_path / "b"
    shutil.copytree(first, other)
    if difference == "pixels":  # same classes, counts and shapes; other images
        for path in other.rglob("*.png"):
            Image.fromarray(255 - np.asarray(Image.open(path))).save(path)
    else:
        for split in ("train", "test"):
            shutil.rmtree(sorted((other / split).iterdir())[-1])
    script = tmp_path / "rank_data.py"
    script.write_text(RANK_DATA)
    done = run_processes(str(first), str(other), *COMMON, "--epochs", "1", "--run-dir", str(tmp_path / "run"),
                         program=(str(script),), env={"GPUACCEL_CACHE_DIR": str(tmp_path / "cache")},
                         exit_codes=[2, 2])
    output = done.stdout
    assert output.count("gpuaccel: error: the processes of this run disagree") == 2, output[-3000:]
    assert "this process (rank 1) was given other data than rank 0" in output
    assert "another process was given other data or model than this one (rank 0)" in output
    assert "site-packages/gpuaccel" not in output and "src/gpuaccel" not in output  # no traceback through gpuaccel
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_global_batch_that_does_not_split_over_the_processes_is_refused():
    config = TrainConfig(batch_size=30, global_batch=True)
    assert config.loop.batch_per_process(3) == 10 and TrainConfig(batch_size=30).loop.batch_per_process(4) == 30
    with pytest.raises(GpuaccelError, match="does not split evenly over 4 processes"):
        config.loop.batch_per_process(4)


def test_launcher_errors_and_arguments(capsys):
    assert_user_error(capsys, ["train", "--gpus", "64"], "more GPUs than present")
    assert worker_arguments(["--gpus", "2", "--epochs", "3", "--max-restarts=1"], "runs/x") == \
        ["--epochs", "3", "--run-dir", "runs/x"]
    assert worker_arguments(["--gpus=2", "--run-dir", "mine"], "runs/x") == ["--run-dir", "mine"]
    # a resume continues in its run's directory (adding one was refused: "--run-dir cannot change")
    assert worker_arguments(["--resume", "runs/a", "--gpus", "2", "--epochs", "4"], "runs/x") == \
        ["--resume", "runs/a", "--epochs", "4"]
    model = create_model("lenet5", num_classes=10, in_channels=1, image_size=8)
    with pytest.raises(GpuaccelError, match="sync_bn needs GPUs"):
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
    assert json.loads((tmp_path / "r" / "config.json").read_text())["model"]["activation_checkpointing"] is True
    assert_user_error(capsys, ["train", "--data", "digits", "--model", "mlp", "--activation-checkpointing"],
                      "--activation-checkpointing found no blocks")


# --- fully sharded data parallel -------------------------------------------------------------------------

def test_a_sharded_run_resumes_to_the_same_weights_from_its_shards_and_saves_a_whole_model(tmp_path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    # a constant learning rate: a schedule stretched to the new length on resume would differ
    # 359 test images in batches of 179: one rank evaluates 180 images in 2 batches, the other 1 batch
    common = [*COMMON, "--shard", "--batch-size", "16", "--schedule", "constant", "--warmup-epochs", "0",
              "--eval-batch-size", "179"]
    run_processes(*common, "--epochs", "3", "--run-dir", str(straight))
    run_processes(*common, "--epochs", "1", "--run-dir", str(resumed))
    run_processes("--resume", str(resumed), "--epochs", "3", "--quiet", "--no-monitor")
    assert_same_training(straight, resumed, processes=2, global_batch=32, atol=1e-6)
    # the checkpoint keeps each process's shards (DCP) in a folder it names, the last one only;
    # model.pt is whole: it loads into the plain model
    state = torch.load(resumed / "checkpoint.pt", weights_only=False)
    assert state["model"] is None and state["optimizer"] is None
    assert sorted(p.name for p in resumed.glob("checkpoint.shards-*")) == [state["shards"]]
    assert (resumed / state["shards"] / ".metadata").exists()
    with plain_models_importable():
        plain = create_model(MODEL, num_classes=10, in_channels=1, image_size=8)
    plain.load_state_dict(torch.load(resumed / "model.pt", weights_only=False)["model"])


def test_fsdp_units_group_consecutive_blocks_until_each_holds_the_size():
    from gpuaccel.parallel.checkpointing import _outermost_blocks
    from gpuaccel.parallel.fsdp import fsdp_units

    model = create_model("resnet18")
    blocks = list(_outermost_blocks(model))
    sizes = {id(b): sum(p.numel() * p.element_size() for p in b.parameters()) for b in blocks}
    assert fsdp_units(model, 0) == [[b] for b in blocks]
    unit_bytes = 4 * 2**20
    units = fsdp_units(model, unit_bytes)
    assert [b for unit in units for b in unit] == blocks  # every block once, in order
    assert 1 < len(units) < len(blocks)
    for unit in units[:-1]:  # each unit reaches the size, and would not without its last block
        assert sum(sizes[id(b)] for b in unit) >= unit_bytes > sum(sizes[id(b)] for b in unit[:-1])


def test_sharded_blocks_in_units_of_several_train_on_two_processes_like_one(tmp_path):
    """FSDP with a unit of two blocks (one all-gather for both) and a unit of one, which stays
    gathered after its forward pass, trains like one process with the whole batch."""
    single, double = tmp_path / "one", tmp_path / "two"
    train_one_process(single, model="plain_models:residual_mlp", batch_size=64, epochs=1)
    # blocks of 4,224 bytes in units of 0.005 MiB (5,243 bytes): blocks (1, 2) and (3)
    run_processes(*COMMON, "--model", "plain_models:residual_mlp", "--shard", "--shard-unit-mb", "0.005",
             "--batch-size", "32", "--epochs", "1", "--run-dir", str(double))
    assert_same_training(single, double, processes=2, global_batch=64, atol=2e-5)
    assert "FSDP (2 units)" in json.loads((double / "summary.json").read_text())["strategy"]


def test_sharded_strategy_gathers_bf16_weights_under_bf16_and_fuses_adam_only():
    from types import SimpleNamespace

    from gpuaccel.runtime.strategy import training_strategy

    def strategy(precision):
        placement = SimpleNamespace(device=torch.device("cpu"), dist=SimpleNamespace(active=True, rank=0, world_size=2),
                                    precision=SimpleNamespace(loss_scaling=False, autocast_dtype=precision))
        return training_strategy(TrainConfig(data="digits", shard=True, shard_unit_mb=8), placement,
                                 captured_step=False, channels_last=False)

    bf16, fp32 = strategy(torch.bfloat16), strategy(None)
    assert bf16.param_dtype == torch.bfloat16 and fp32.param_dtype is None and bf16.unit_mb == 8
    assert bf16.fuses("adamw") and bf16.fuses("adam") and not bf16.fuses("sgd")  # (DTensor: no fused SGD)


def test_shard_errors(capsys, monkeypatch):
    assert_user_error(capsys, ["train", "--data", "digits", "--shard", "--ema", "0.9"], "--ema", "--shard")
    import gpuaccel.parallel.fsdp as fsdp

    monkeypatch.setattr(fsdp.dist, "is_available", lambda: False)
    assert_user_error(capsys, ["train", "--data", "digits", "--shard", "--epochs", "1"], "--shard needs torch.distributed")


def test_offload_errors(capsys):
    assert_user_error(capsys, ["train", "--data", "digits", "--offload", "cpu"], "--offload cpu works with --shard")
    assert_user_error(capsys, ["train", "--data", "digits", "--offload", "gpu"], "offload")
    assert_user_error(capsys, ["train", "--data", "digits", "--device", "cpu", "--shard", "--offload", "cpu",
                               "--epochs", "1"], "this run is on the CPU already")


# --- pipeline stages -------------------------------------------------------------------------------------

PIPELINE = ["--device", "cpu", "--lr", "0.05", "--quiet", "--no-monitor", "--eval-batch-size", "50",
            "--schedule", "constant", "--warmup-epochs", "0"]


def test_pipeline_stages_match_accumulating_the_same_micro_batches_and_resume(tmp_path, mnist_dir):
    """2 stages x 2 micro-batches of 16 = one process accumulating two batches of 16, batch norm
    included (each micro-batch is normalised by its own statistics in both), and gradient
    clipping by the norm over both stages. Resuming the
    pipelined run mid-way gives the same weights, and its checkpoint is one whole model."""
    single, piped = tmp_path / "single", tmp_path / "piped"
    common = [*PIPELINE, "--data", str(mnist_dir), "--model", "plain_models:bn_cnn"]
    train_one_process(single, data=str(mnist_dir), model="plain_models:bn_cnn", batch_size=16, grad_accum=2,
                      epochs=2, eval_batch_size=50, schedule="constant", warmup_epochs=0, grad_clip=0.3)
    piped_args = [*common, "--pipeline-stages", "2", "--batch-size", "32", "--microbatches", "2", "--grad-clip", "0.3"]
    run_processes(*piped_args, "--epochs", "1", "--run-dir", str(piped))
    run_processes("--resume", str(piped), "--epochs", "2", "--quiet", "--no-monitor")
    assert_same_training(single, piped, processes=2, global_batch=32, atol=1e-5)  # batch-norm statistics too
    a, b = (json.loads((d / "summary.json").read_text()) for d in (single, piped))
    assert b["steps"] == a["steps"] and b["metrics"]["accuracy"] == pytest.approx(a["metrics"]["accuracy"])
    by_process = b["setup_phases_by_process"]  # (each process's set-up, gathered as the warm-up starts)
    assert len(by_process) == 2 and all("reading the data" in phases for phases in by_process), by_process
    assert "waiting for the slowest process to arrive" in b["warmup_phases"] and a["setup_phases_by_process"] is None
    state = torch.load(piped / "checkpoint.pt", weights_only=False)
    with plain_models_importable():
        create_model("plain_models:bn_cnn", **state["model_args"]).load_state_dict(state["model"])
    # split by FLOPs: the first convolution (0.6 MFLOP) | the rest (2.4 MFLOP); one momentum buffer per parameter
    assert [len(stage["state"]) for stage in state["optimizer"]] == [2, 8]


def test_a_gpt_split_into_two_pipeline_stages_trains_like_one_process(tmp_path):
    """Each attention layer holds its own rotary tables, so only the residual stream crosses the
    stage boundary (before, the tables crossed it too and the split was refused)."""
    text = tmp_path / "text.txt"
    text.write_text("".join(f"line {i % 17}: the quick brown fox jumps over the lazy dog.\n" for i in range(384)))
    single, piped = tmp_path / "single", tmp_path / "piped"  # (576 windows: 36 whole steps of 16)
    gpt = dict(model="gpt", model_args={"layers": 2, "heads": 2, "width": 32, "dropout": 0.0}, context=32)
    train_one_process(single, data=str(text), **gpt, batch_size=8, grad_accum=2, epochs=1, schedule="constant",
                      warmup_epochs=0)
    run_processes("--device", "cpu", "--quiet", "--no-monitor", "--data", str(text), "--model", "gpt", "--model-args",
                  "layers=2,heads=2,width=32,dropout=0", "--context", "32", "--pipeline-stages", "2", "--batch-size",
                  "16", "--microbatches", "2", "--epochs", "1", "--schedule", "constant", "--warmup-epochs", "0",
                  "--lr", "0.05", "--run-dir", str(piped))
    assert_same_training(single, piped, processes=2, global_batch=16, atol=1e-5)


def test_a_gpt_in_pipeline_stages_trains_in_bf16(tmp_path):
    """The stages are traced under the run's autocast dtype: traced in fp32, the rotary
    embedding's x.float() became a check that x is fp32, which its bf16 activations failed
    (torch 2.13: an error at the first step)."""
    text = tmp_path / "text.txt"
    text.write_text("".join(f"line {i % 17}: the quick brown fox jumps over the lazy dog.\n" for i in range(96)))
    run_processes("--device", "cpu", "--quiet", "--no-monitor", "--data", str(text), "--model", "gpt", "--model-args",
                  "layers=2,heads=2,width=32,dropout=0", "--context", "32", "--pipeline-stages", "2", "--batch-size",
                  "16", "--precision", "bf16", "--epochs", "1", "--run-dir", str(tmp_path / "run"))
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["precision"] == "bf16" and summary["steps"] > 0 and math.isfinite(summary["metrics"]["loss"])


def test_stages_are_traced_under_an_autocast_of_the_device_holding_the_weights():
    """On GPUs the model is traced while its weights are still on the CPU, where the run's CUDA
    autocast does nothing: the trace takes the run's dtype on the weights' own device."""
    from gpuaccel.parallel.pipeline import tracing_precision

    model = torch.nn.Linear(4, 4)
    with tracing_precision(model, torch.bfloat16):
        assert model(torch.zeros(2, 4)).dtype == torch.bfloat16
    with tracing_precision(model, None):
        assert model(torch.zeros(2, 4)).dtype == torch.float32


def test_a_stage_traced_on_one_device_runs_on_another():
    """torch.export records a cast (the rotary embedding's x.float()) with a check of the device
    x had while traced: stages traced on the CPU failed on their GPU ("Tensor device mismatch!
    Expected: cpu"). Here traced on the meta device and run on the CPU."""
    from torch.distributed.pipelining import SplitPoint, pipeline

    from gpuaccel.parallel.pipeline import _drop_traced_metadata_checks, _run_compiled_graphs

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(8, 8)

        def forward(self, x):
            return (self.linear(x) * x.float().mean()).to(torch.bfloat16)

    model = torch.nn.Sequential(Block(), Block()).to("meta")
    pipe = pipeline(model, mb_args=(torch.zeros(2, 8, device="meta", dtype=torch.bfloat16),),
                    split_spec={"1": SplitPoint.BEGINNING})
    stage = pipe.get_stage_module(1)
    _drop_traced_metadata_checks(stage)
    _run_compiled_graphs(stage)
    stage.to_empty(device="cpu")
    torch.nn.init.ones_(stage.get_submodule("1.linear").weight)
    torch.nn.init.zeros_(stage.get_submodule("1.linear").bias)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # as the stage runs: under the run's autocast
        out = stage(torch.ones(2, 8, dtype=torch.bfloat16))
    assert out.dtype == torch.bfloat16 and out.device.type == "cpu" and torch.equal(out, torch.full((2, 8), 8.0,
                                                                                                   dtype=torch.bfloat16))


def test_a_pipeline_takes_batches_with_gaps_between_rows():
    """A language model's tokens are a view (x = window[:, :-1]): its rows are 1,025 apart, not
    1,024, and the pipeline's stages refused them (stride mismatch) on the GPU."""
    run_processes(program=(str(TESTS / "pipeline_worker.py"),))


def test_two_pipelines_of_two_stages_train_like_one_process(tmp_path, mnist_dir):
    """4 processes = 2 data-parallel replicas x 2 stages (GPipe, split where asked)."""
    single, piped = tmp_path / "single", tmp_path / "piped"
    common = [*PIPELINE, "--data", str(mnist_dir), "--model", MODEL, "--epochs", "1"]
    train_one_process(single, data=str(mnist_dir), model=MODEL, batch_size=64, epochs=1, eval_batch_size=50,
                      schedule="constant", warmup_epochs=0)
    run_processes(*common, "--pipeline-stages", "2", "--batch-size", "32", "--microbatches", "2", "--split-points",
                  "3", "--pipeline-schedule", "gpipe", "--run-dir", str(piped), nproc=4)
    assert_same_training(single, piped, processes=4, global_batch=64, atol=1e-5)


def test_pipeline_stages_checkpoint_their_blocks(tmp_path, mnist_dir):
    """--activation-checkpointing in a pipeline wraps each stage's blocks (found by name in the
    traced stage): the same weights as one process checkpointing and accumulating, and batch-norm
    statistics stepped twice per micro-batch as there (the recomputed forward)."""
    single, piped = tmp_path / "single", tmp_path / "piped"
    model = "plain_models:tiny_resnet"
    train_one_process(single, data=str(mnist_dir), model=model, batch_size=16, grad_accum=2, epochs=1,
                      eval_batch_size=50, schedule="constant", warmup_epochs=0, activation_checkpointing=True)
    loud = [arg for arg in PIPELINE if arg != "--quiet"]
    done = run_processes(*loud, "--data", str(mnist_dir), "--model", model, "--activation-checkpointing", "--epochs",
                         "1", "--pipeline-stages", "2", "--batch-size", "32", "--microbatches", "2",
                         "--run-dir", str(piped))
    log = done.stdout  # (each process's output and errors; progress lines go to stderr)
    assert "split before stages.1.0" in log and "1 block checkpointed" in log
    one, two = weights(single), weights(piped)
    for key in one:
        if "running_" not in key:  # the two recomputations come in another order: EMA statistics differ slightly
            torch.testing.assert_close(two[key].float(), one[key].float(), atol=1e-5, rtol=1e-4)
    micro_batches = 2 * (300 // 32)  # 9 steps of 2
    assert int(two["stem.1.num_batches_tracked"]) == micro_batches  # outside the blocks: not recomputed
    for stage in (0, 1):  # a block of each stage: its forward and its recomputation
        assert int(two[f"stages.{stage}.0.conv1.1.num_batches_tracked"]) == 2 * micro_batches


def test_split_points_balance_the_stages_flops():
    from gpuaccel.parallel.pipeline import balanced_split, split_units, unit_costs

    model = create_model("resnet18", num_classes=10, in_channels=3, image_size=32)
    units = split_units(model)
    assert units[:3] == ["stem.0", "stem.1", "stem.2"] and units[-2:] == ["pool", "fc"]
    assert "stages.1.0" in units and not any(u.startswith("stages.1.0.") for u in units)  # blocks stay whole
    costs = unit_costs(model, torch.zeros(1, 3, 32, 32))
    assert [name for name, _ in costs] == units  # forward order
    assert sum(c for _, c in costs) > 0.5e9  # ResNet-18 at 32 px: about 0.56 GFLOP (multiply-adds x 2)
    assert dict(costs)["stem.2"] == 0 and dict(costs)["stages.0.0"] == dict(costs)["stages.3.1"]  # ReLU; equal blocks
    costs = [("a", 5), ("b", 1), ("c", 1), ("d", 1), ("e", 4)]
    assert balanced_split(costs, 2) == ["c"]  # 6 | 6, not 5 | 7
    with pytest.raises(GpuaccelError, match="more stages than the model has layers"):
        balanced_split(costs, 6)

    def largest_stage(points, costs):
        names = [n for n, _ in costs]
        bounds = [0, *(names.index(p) for p in points), len(costs)]
        return max(sum(c for _, c in costs[i:j]) for i, j in zip(bounds, bounds[1:]))

    generator = torch.Generator().manual_seed(0)
    for _ in range(20):  # the least possible largest stage, against every way to split
        costs = [(str(i), int(c)) for i, c in enumerate(torch.randint(0, 50, (7,), generator=generator))]
        best = min(largest_stage([costs[i][0], costs[j][0]], costs) for i in range(1, 7) for j in range(i + 1, 7))
        assert largest_stage(balanced_split(costs, 3), costs) == best


def test_pipeline_errors(capsys):
    base = ["train", "--data", "digits", "--epochs", "1"]
    assert_user_error(capsys, [*base, "--pipeline-stages", "2"], "needs a multiple of 2 processes")
    assert_user_error(capsys, [*base, "--pipeline-stages", "2", "--batch-size", "30", "--microbatches", "4"],
                      "--batch-size 30 does not split into 4")
    assert TrainConfig(pipeline_stages=3, batch_size=128).pipeline_microbatches == 8
    assert TrainConfig(pipeline_stages=2, batch_size=30).pipeline_microbatches == 5
    assert_user_error(capsys, [*base, "--pipeline-stages", "2", "--grad-accum", "2"], "--grad-accum")
    assert_user_error(capsys, [*base, "--pipeline-stages", "2", "--split-points", "nope"], "nope", "candidates")
    assert_user_error(capsys, [*base, "--pipeline-stages", "3", "--split-points", "features.3"], "3 stages need 2")
    assert_user_error(capsys, [*base, "--microbatches", "2"], "for --pipeline-stages 2 or more")
    assert_user_error(capsys, ["train", "--gpus", "3", "--pipeline-stages", "2"], "--gpus 3 does not split")
    assert_user_error(capsys, [*base, "--pipeline-stages", "40"], "more stages than the model has layers to split at (14: features.0")
    assert_user_error(capsys, [*base, "--pipeline-stages", "2", "--pipeline-schedule", "zb"], "pipeline schedule")


def _averaged_gradients(rank, world, path):
    from gpuaccel.parallel import average_gradients

    torch.distributed.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world)
    filters = torch.nn.Parameter(torch.zeros(4, 3, 2, 2).to(memory_format=torch.channels_last))
    plain, frozen = torch.nn.Parameter(torch.zeros(5)), torch.nn.Parameter(torch.zeros(2))
    filters.grad = torch.arange(48.0).view(4, 3, 2, 2).contiguous(memory_format=torch.channels_last) * (rank + 1)
    plain.grad = torch.full((5,), float(rank))
    average_gradients([filters, frozen, plain])  # (frozen: no gradient)
    torch.distributed.destroy_process_group()
    torch.save({"filters": filters.grad, "plain": plain.grad, "frozen": frozen.grad}, f"{path}.{rank}")


def test_averaged_gradients_keep_their_layout_as_views_of_one_buffer(tmp_path):
    torch.multiprocessing.spawn(_averaged_gradients, args=(2, tmp_path / "group"), nprocs=2)
    for rank in range(2):
        grads = torch.load(f"{tmp_path / 'group'}.{rank}")
        assert grads["frozen"] is None
        assert torch.equal(grads["filters"], torch.arange(48.0).view(4, 3, 2, 2) * 1.5)
        assert grads["filters"].is_contiguous(memory_format=torch.channels_last)
        assert torch.equal(grads["plain"], torch.full((5,), 0.5))
        # one buffer: the channels-last gradient as it lay in memory, then the other
        assert grads["plain"].untyped_storage().data_ptr() == grads["filters"].untyped_storage().data_ptr()


def _verdicts(rank, world, path):
    from gpuaccel.parallel import Distributed

    torch.distributed.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world)
    ranks = Distributed(rank, world)
    first = ranks.start_any(rank == 1, torch.device("cpu"))  # one rank's clock passed
    second = ranks.start_any(False, torch.device("cpu"))
    torch.save([first.result(), second.result(), ranks.any(rank == 0, torch.device("cpu"))], f"{path}.{rank}")
    torch.distributed.destroy_process_group()


def test_every_rank_reads_the_same_verdict_of_any_ranks_clock(tmp_path):
    torch.multiprocessing.spawn(_verdicts, args=(2, tmp_path / "group"), nprocs=2)
    for rank in range(2):
        assert torch.load(f"{tmp_path / 'group'}.{rank}") == [True, False, True]


def _compiled_backward_passes(output: torch.Tensor) -> int:
    """How many compiled backward functions the autograd graph behind ``output`` holds."""
    seen, todo, count = set(), [output.grad_fn], 0
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        count += "CompiledFunction" in node.name()
        todo += [next_node for next_node, _ in node.next_functions]
    return count


def test_a_model_compiled_in_pieces_hands_its_gradients_back_piece_by_piece():
    """compile_module(split_bytes=...) cuts the model's graph by bytes of parameters: one
    compiled backward function per piece, so the last layers' gradients exist (and can be
    averaged) while the first layers' backward pass has yet to run. Same outputs and gradients."""
    from gpuaccel.compiling import compile_module

    with plain_models_importable():
        from plain_models import plain_cnn
    torch.manual_seed(0)
    model, x = plain_cnn(), torch.randn(4, 1, 8, 8)
    reference = model(x)
    reference.square().mean().backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    output = compile_module(model, "default", split_bytes=2048)(x)  # (the last layer's 1.3 kB: a piece)
    assert _compiled_backward_passes(output) >= 2
    output.square().mean().backward()
    torch.testing.assert_close(output, reference)
    for p, grad in zip(model.parameters(), expected):
        torch.testing.assert_close(p.grad, grad)


def test_overlap_gradients_gives_the_step_graphs_data_parallel_its_buckets():
    """--overlap-gradients (off by default) turns the captured step's one all-reduce into buckets
    of --ddp-bucket-mb; without a captured step it is DDP either way."""
    from types import SimpleNamespace

    from gpuaccel.parallel import DataParallel, GraphDataParallel
    from gpuaccel.runtime.strategy import training_strategy

    placement = SimpleNamespace(device=torch.device("cpu"), precision=SimpleNamespace(loss_scaling=False),
                                dist=SimpleNamespace(active=True, rank=0, world_size=2))
    default = training_strategy(TrainConfig(data="digits"), placement, captured_step=True, channels_last=False)
    overlap = training_strategy(TrainConfig(data="digits", overlap_gradients=True, ddp_bucket_mb=4), placement,
                                captured_step=True, channels_last=False)
    eager = training_strategy(TrainConfig(data="digits", overlap_gradients=True), placement, captured_step=False,
                              channels_last=False)
    assert isinstance(default, GraphDataParallel) and default.bucket_bytes is None
    assert isinstance(overlap, GraphDataParallel) and overlap.bucket_bytes == 4 * 2**20
    assert isinstance(eager, DataParallel)


def _descendants(pid: int) -> list[int]:
    """The processes below ``pid`` (Linux: read off /proc)."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = open(f"/proc/{entry}/stat").read()
            except OSError:
                continue
            parents.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _alive(pid: int) -> bool:
    try:
        state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_workers_stop_when_their_launcher_is_killed(tmp_path):
    """SIGKILL to torchrun cannot be passed on by torchrun: the workers ask the kernel for SIGTERM
    at their launcher's death, and stop (checkpointing) instead of training on, holding the lock."""
    import signal
    import time

    run = tmp_path / "run"
    with open(tmp_path / "log", "w") as log:
        launcher = torchrun("--device", "cpu", "--epochs", "1000", "--run-dir", str(run), "--no-monitor",
                            "--quiet", log=log)
        workers = []
        try:
            deadline = time.time() + 120
            while not (run / "metrics.jsonl").exists() or not (run / "metrics.jsonl").read_text().strip():
                assert launcher.poll() is None and time.time() < deadline, (tmp_path / "log").read_text()[-2000:]
                time.sleep(0.5)
            workers = _descendants(launcher.pid)
            assert len(workers) >= 2
            os.kill(launcher.pid, signal.SIGKILL)
            launcher.wait()
            # (they stop in about a second, checkpointing; without the signal they trained on for 1,000
            # epochs. A minute leaves room for a loaded 2-core machine: 20 s once fell short there)
            deadline = time.time() + 60
            while any(_alive(p) for p in workers) and time.time() < deadline:
                time.sleep(0.2)
            assert not any(_alive(p) for p in workers), (tmp_path / "log").read_text()[-2000:]
        finally:
            for pid in workers:
                if _alive(pid):
                    os.kill(pid, signal.SIGKILL)
    assert not (run / ".lock").exists()  # (released by the worker that held it, on its way out)
