"""Opt-in views of a run: a torch.profiler trace of a few steps, TensorBoard scalars."""

from __future__ import annotations

from pathlib import Path

import torch

from ..errors import GpuaccelError
from ..files import atomic_write, replaced_atomically


class StepProfiler:
    """Profiles training steps ``first`` .. ``last`` (counted from 1; up to two steps before them
    run under the profiler untraced, as its warm-up) and writes a Chrome/Perfetto trace
    (``profile/trace.json``, open it in https://ui.perfetto.dev or chrome://tracing) and a table
    of the most expensive operators (``profile/ops.txt``)."""

    def __init__(self, run_dir: Path, device: torch.device, first: int = 8, last: int = 12):
        from torch.profiler import ProfilerActivity, profile, schedule

        warmup = min(2, first - 1)
        skip, active = first - 1 - warmup, last - first + 1

        self.out = Path(run_dir) / "profile"
        self.out.mkdir(parents=True, exist_ok=True)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        self.sort_by = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
        self.done = False
        self._profile = profile(activities=activities, record_shapes=True,
                                schedule=schedule(skip_first=skip, wait=0, warmup=warmup, active=active, repeat=1),
                                on_trace_ready=self._write)
        self._profile.start()

    def _write(self, prof) -> None:
        with replaced_atomically(self.out / "trace.json") as tmp:  # a kill leaves no torn trace
            prof.export_chrome_trace(str(tmp))
        table = prof.key_averages().table(sort_by=self.sort_by, row_limit=30)
        atomic_write(self.out / "ops.txt", lambda f: f.write(table.encode()))
        self.done = True

    def step(self) -> None:
        if not self.done:
            self._profile.step()

    def close(self) -> None:
        self._profile.stop()


class ScalarLog:
    """TensorBoard event files under ``run_dir/tensorboard`` (``tensorboard --logdir runs``)."""

    def __init__(self, run_dir: Path):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise GpuaccelError("--tensorboard needs the tensorboard package (pip install tensorboard)") from None
        self.writer = SummaryWriter(str(Path(run_dir) / "tensorboard"))

    def add(self, record: dict, step: int) -> None:
        for key, value in record.items():
            if isinstance(value, (int, float)) and value is not None and key != "step":
                self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
