"""Each runtime decision made once, for both doors: whether a step can be captured, the
autocast policy, the strategy (pipelines included), and the GPU sampler and data-wait meter
that the Trainer reads through its Accelerator."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import gpuaccel
from gpuaccel import GpuaccelError, TrainConfig
from gpuaccel.device import Precision, capturable_region, resolve_precision
from gpuaccel.parallel import PipelineParallel
from gpuaccel.runtime.capture import CapturedStep, capture_obstacle
from gpuaccel.runtime.strategy import choose_strategy, training_strategy
from gpuaccel.train.checks import whole_step_obstacle

GPU = torch.device("cuda")  # (a device object only: nothing runs on it)
BF16 = Precision("bf16", torch.bfloat16, loss_scaling=False)


@pytest.mark.parametrize("flags, cause", [
    (dict(shard=True), "FSDP"), (dict(sync_bn=True), "SyncBatchNorm"),
    (dict(activation_checkpointing=True), "activation checkpointing"),
    (dict(pipeline_stages=2, batch_size=64), "pipeline stages")])
def test_the_trainer_and_the_accelerator_give_one_reason_from_one_check(flags, cause):
    config = TrainConfig(data="digits", compile=True, compile_mode="reduce-overhead", **flags)
    said_by_trainer = whole_step_obstacle(config, GPU, BF16)
    said_by_check = capture_obstacle(GPU, BF16, sharded=config.parallel.shard,
                                     pipelined=config.parallel.pipeline_stages > 1,
                                     sync_batchnorm=config.parallel.sync_bn,
                                     checkpointed=config.model.activation_checkpointing)
    assert said_by_trainer == said_by_check and said_by_check.startswith(cause)
    assert whole_step_obstacle(TrainConfig(data="digits", compile=True, compile_mode="reduce-overhead"), GPU,
                               BF16) is None


def test_the_accelerator_finds_sync_batchnorm_and_checkpointed_blocks_in_what_it_prepared(monkeypatch):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(4, 4)

        def forward(self, x):
            return self.linear(x)

    for model, cause in ((nn.Sequential(nn.Linear(4, 4), nn.SyncBatchNorm(4)), "SyncBatchNorm"),
                         (nn.Sequential(checkpoint_wrapper(Block())), "activation checkpointing")):
        acc = gpuaccel.Accelerator(device="cpu", monitor=False)
        acc.prepare(model)
        monkeypatch.setattr(acc, "device", GPU)  # (as on a GPU, where the device is no obstacle)
        assert acc._capture_obstacle().startswith(cause)
        with pytest.raises(GpuaccelError, match=f"capture\\(\\): {cause}"):
            acc.capture(lambda: None, strict=True)


def test_autocast_keeps_its_cache_except_in_a_captured_steps_calls():
    cpu = torch.device("cpu")
    precision = resolve_precision("bf16", cpu)
    with precision.autocast(cpu):
        assert torch.is_autocast_enabled("cpu") and torch.is_autocast_cache_enabled()
    with capturable_region(), precision.autocast(cpu):
        assert torch.is_autocast_enabled("cpu") and not torch.is_autocast_cache_enabled()


@pytest.mark.gpu
def test_a_captured_step_sees_one_autocast_setting_in_its_warm_up_and_its_recording():
    """torch.compile guards on the autocast cache: the warm-up calls and the recording must see
    the same setting (off), else the model is compiled again inside the recording."""
    seen = []
    weight = torch.ones(4, device=GPU, requires_grad=True)
    optimizer = torch.optim.SGD([weight], lr=0.1)

    def step(x):
        with BF16.autocast(GPU):
            seen.append(torch.is_autocast_cache_enabled())
            loss = (weight * x).sum()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    captured = CapturedStep(step, [optimizer], GPU, warmup=2)
    for _ in range(5):
        captured(torch.ones(4, device=GPU))
    assert captured.captured and seen == [False, False, False]  # two warm-up calls, the recording
    with BF16.autocast(GPU):
        assert torch.is_autocast_cache_enabled()


def test_one_strategy_chooser_builds_pipelines_and_refuses_fp16_for_them():
    dist = SimpleNamespace(active=True, rank=0, world_size=2)
    fp32 = SimpleNamespace(device=torch.device("cpu"), dist=dist,
                           precision=SimpleNamespace(loss_scaling=False, autocast_dtype=None,
                                                     autocast=lambda device: None))
    config = TrainConfig(data="digits", pipeline_stages=2, batch_size=64)
    strategy = training_strategy(config, fp32, captured_step=False, channels_last=False)
    assert isinstance(strategy, PipelineParallel) and strategy.stages == 2
    assert strategy.options["microbatches"] == config.pipeline_microbatches
    fp16 = SimpleNamespace(**{**vars(fp32), "precision": SimpleNamespace(loss_scaling=True, autocast_dtype=None)})
    with pytest.raises(GpuaccelError, match="pipeline.stages trains in bf16 or fp32; fp16 loss scaling"):
        choose_strategy(fp16, pipeline=dict(stages=2))


def test_timed_counts_the_wait_of_an_iterable_of_batches():
    acc = gpuaccel.Accelerator(device="cpu", monitor=False)

    def slow_batches():
        for _ in range(4):
            time.sleep(0.02)
            yield torch.ones(2)

    for _ in acc.timed(slow_batches()):
        pass
    assert acc.stats()["data_wait_share"] > 0.5


def test_the_trainers_records_carry_its_accelerators_measurements(tmp_path, monkeypatch):
    """The Trainer has no meters of its own: each evaluation's data wait (and GPU utilisation)
    is its accelerator's stats() since the previous evaluation."""
    calls = []

    def stats(self):
        calls.append(self)
        return {"seconds": 1.0, "data_wait_share": 0.4321, "gpu_util": 55.0, "gpu_mem_used_mib": None,
                "gpu_power_w": None, "gpu_monitor": "nvml"}

    monkeypatch.setattr(gpuaccel.Accelerator, "stats", stats)
    monkeypatch.setattr(gpuaccel.Accelerator, "monitor", lambda self, path=None, origin=None: SimpleNamespace(stop=lambda: None))
    x = torch.randn(128, 6)
    y = (x[:, 0] > 0).long()
    config = TrainConfig(batch_size=32, epochs=2, device="cpu", run_dir=str(tmp_path / "run"))
    trainer = gpuaccel.Trainer(config, model=nn.Linear(6, 2), train_data=(x, y), eval_data=(x[:32], y[:32]),
                               loss_fn=F.cross_entropy, quiet=True)
    trainer.fit()
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 2 and all(r["data_wait"] == 0.4321 and r["gpu_util"] == 55.0 for r in records)
    assert calls and all(acc is trainer.acc for acc in calls)


def test_the_trainers_optimizer_kernels_are_decided_where_a_users_are(monkeypatch):
    """The config's optimizer section says which parameters take which rate; whether the update is
    fused or capturable is Accelerator.prepare_optimizer's to decide, for both doors."""
    prepared = []
    real = gpuaccel.Accelerator.prepare_optimizer
    monkeypatch.setattr(gpuaccel.Accelerator, "prepare_optimizer",
                        lambda self, optimizer: prepared.append(optimizer) or real(self, optimizer))
    model = nn.Linear(4, 2)
    for name in ("adamw", "sgd"):
        built = TrainConfig(optimizer=name).optimizer.build(model)
        assert not any(group.get("fused") or group.get("capturable") for group in built.param_groups)
    x = torch.randn(64, 4)
    trainer = gpuaccel.Trainer(TrainConfig(batch_size=32, epochs=1, device="cpu", optimizer="adamw", run_dir=None,
                                           monitor=False), model=model, train_data=(x, (x[:, 0] > 0).long()),
                               loss_fn=F.cross_entropy, quiet=True)
    assert prepared == [trainer.optimizer]
