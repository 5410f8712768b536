"""--compile-background: a short run on a machine that has not compiled its model trains
uncompiled while a background process compiles for the runs after it (train/precompile.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch

from gpuaccel.compiling import (
    CompiledNote,
    compiling_in_background,
    start_background_compile,
)
from gpuaccel.train import TrainConfig, Trainer, precompile, warmup


@pytest.fixture
def compiled_calls(monkeypatch, tmp_path):
    """torch.compile stood in for (Inductor on this CPU takes minutes): each module it was asked
    to compile is noted; compile caches under tmp_path."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    calls = []

    def compiled(self, module, split_bytes=None):
        if self._compile_mode is not None:
            calls.append(module)
        return module
    monkeypatch.setattr(Trainer, "_compiled", compiled)
    return calls


def _deferred_trainer(tmp_path, **settings) -> Trainer:
    config = TrainConfig(data="digits", model="mlp", device="cpu", compile=True, monitor=False,
                         run_dir=str(tmp_path / "run"), **settings)
    trainer = Trainer(config, quiet=True)
    assert trainer.compile_plan == "now"  # (on a CPU the step is no CUDA graph: the run compiles itself)
    trainer.compile_plan = "deferred"  # as on a GPU with the whole step one CUDA graph
    trainer._make_forwards()
    return trainer


def test_a_short_run_not_compiled_before_trains_uncompiled_and_leaves_the_compile(tmp_path, compiled_calls,
                                                                                 monkeypatch):
    started = []
    monkeypatch.setattr(warmup, "compile_model_in_background", lambda trainer, note: started.append(note) or True)
    trainer = _deferred_trainer(tmp_path, epochs=1)
    compiled_calls.clear()
    trainer.warm_up()
    assert trainer.compile_plan == "background" and compiled_calls == [] and len(started) == 1
    assert not started[0].compiled_before and not started[0].path.exists()  # (this run noted nothing)
    assert "deciding where to compile" in " ".join(trainer.times.warmup_phases)
    summary = trainer.fit()
    assert summary["compile_plan"] == "background" and summary["metrics"]["accuracy"] > 0.5


def test_a_run_compiles_itself_when_compiled_before_long_or_alone(tmp_path, compiled_calls, monkeypatch):
    monkeypatch.setattr(warmup, "compile_model_in_background", lambda trainer, note: True)
    monkeypatch.setattr(warmup, "UNCOMPILED_SECONDS", 0.0)  # any run is long
    long = _deferred_trainer(tmp_path)
    compiled_calls.clear()
    long.warm_up()
    assert long.compile_plan == "now" and compiled_calls and long.compiled_note(*_first(long)).path.exists()

    compiled_calls.clear()
    monkeypatch.setattr(warmup, "UNCOMPILED_SECONDS", 1e9)
    again = _deferred_trainer(tmp_path)  # the same graphs, noted as compiled by the run before
    compiled_calls.clear()
    again.warm_up()
    assert again.compile_plan == "now" and compiled_calls

    monkeypatch.setattr(warmup, "compile_model_in_background", lambda trainer, note: False)  # (no room for it)
    alone = _deferred_trainer(tmp_path, epochs=2)
    alone.warm_up()
    assert alone.compile_plan == "now"


def _first(trainer):
    return trainer.task.split(next(iter(trainer.train_loader.batches(0))))


def test_the_background_process_compiles_the_graphs_the_run_would(tmp_path, compiled_calls):
    """``precompile.main`` rebuilds the run from its settings (run directory and this setting
    aside, which do not change the graphs) and notes the same graphs as compiled; it removes
    its lock and settings as it ends."""
    trainer = _deferred_trainer(tmp_path, epochs=1)
    compiled_calls.clear()
    note = trainer.compiled_note(*_first(trainer))
    assert note.claim()
    note.path.with_suffix(".json").write_text(json.dumps(trainer.config.to_dict()))
    precompile.main([str(note.path)])
    assert note.path.exists() and compiled_calls
    assert not note.lock.exists() and not note.path.with_suffix(".json").exists()
    assert trainer.compiled_note(*_first(trainer)).compiled_before


def test_the_background_process_starts_from_the_run_settings_and_ends_by_removing_its_lock(tmp_path, monkeypatch):
    """The process itself (here a run with nothing to compile, on the CPU): started detached from
    the settings, it writes its log and removes its settings and its lock as it ends."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.setenv("GPUACCEL_CACHE_DIR", str(tmp_path / "cache"))
    config = TrainConfig(data="digits", model="mlp", device="cpu", epochs=1, monitor=False)
    note = CompiledNote({"model": "spawned"})
    assert start_background_compile(note, "gpuaccel.train.precompile", config.to_dict())
    assert compiling_in_background(tmp_path / "inductor") == [note.lock]
    deadline = time.time() + 240
    while note.lock.exists() and time.time() < deadline:
        time.sleep(0.2)
    log = note.path.with_suffix(".log").read_text()
    assert not note.lock.exists() and "compiled in" in log, log[-2000:]
    assert not note.path.with_suffix(".json").exists()


@pytest.mark.gpu
def test_on_a_gpu_the_first_run_trains_uncompiled_and_the_next_loads_the_compile(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
    env["GPUACCEL_CACHE_DIR"] = str(tmp_path / "cache")
    command = [sys.executable, "-m", "gpuaccel", "train", "--data", "digits", "--model", "mlp", "--epochs", "2",
               "--compile", "--compile-mode", "reduce-overhead", "--no-monitor", "--json"]

    def run(name):
        done = subprocess.run(command + ["--run-dir", str(tmp_path / name)], env=env, capture_output=True,
                              text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout[done.stdout.index("{"):])

    first = run("first")
    assert first["compile_plan"] == "background" and first["step_graph"]
    folder = tmp_path / "cache" / "inductor"
    deadline = time.time() + 300
    while compiling_in_background(folder) and time.time() < deadline:
        time.sleep(0.5)
    assert not compiling_in_background(folder), "the background compile did not end"
    logs = list((folder / "gpuaccel-compiled").glob("*.log"))
    assert len(logs) == 1 and "compiled in" in logs[0].read_text(), [p.read_text()[-2000:] for p in logs]
    second = run("second")
    assert second["compile_plan"] == "now" and second["step_graph"]
    assert second["metrics"]["accuracy"] > 0.8 and torch.cuda.is_available()
