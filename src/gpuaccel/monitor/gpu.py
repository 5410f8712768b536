"""A background sampler of GPU telemetry through NVML (nvidia-ml-py).

Every ``interval`` seconds a daemon thread reads, for each watched GPU, utilisation,
memory used, power, temperature and SM clock, and appends one JSON line per GPU to a
file (``gpu.jsonl`` in a run directory). NVML calls take microseconds and do not touch
the CUDA context, so sampling costs the training nothing measurable. Without NVML or
without a GPU the sampler does nothing and says why in ``unavailable``.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

from ..background import stop_at_exit

FIELDS = ("util", "mem_util", "mem_used_mib", "power_w", "temp_c", "sm_mhz")


def _nvml_handles(cuda_indices: list[int]):
    """NVML handles for CUDA device indices, matched by UUID so CUDA_VISIBLE_DEVICES is respected."""
    import pynvml
    import torch

    handles = []
    for index in cuda_indices:
        uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
        try:
            handle = pynvml.nvmlDeviceGetHandleByUUID(f"GPU-{uuid}") if uuid is not None else None
        except pynvml.NVMLError:
            handle = None
        handles.append(handle or pynvml.nvmlDeviceGetHandleByIndex(index))
    return handles


def _read(pynvml, handle) -> dict:
    util = pynvml.nvmlDeviceGetUtilizationRates(handle)
    memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
    return {"util": util.gpu, "mem_util": util.memory, "mem_used_mib": round(memory.used / 2**20),
            "power_w": round(pynvml.nvmlDeviceGetPowerUsage(handle) / 1000, 1),
            "temp_c": pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU),
            "sm_mhz": pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM)}


class GpuSampler:
    """``with GpuSampler(path, [0]) as sampler: ...``; ``sampler.mean('util', since=t)`` summarises.

    Times ``t`` are seconds since ``origin`` (a ``time.perf_counter()`` value; default: start).
    """

    def __init__(self, path: Path | None, cuda_indices: list[int], interval: float = 0.1,
                 origin: float | None = None):
        self.path, self.cuda_indices, self.interval = path, cuda_indices, interval
        self.origin = origin
        self.samples: list[dict] = []
        self.unavailable: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        if not cuda_indices:
            self.unavailable = "no GPU in use"
            return
        try:
            import pynvml

            pynvml.nvmlInit()
            self._pynvml, self._handles = pynvml, _nvml_handles(cuda_indices)
        except ImportError:
            self.unavailable = "nvidia-ml-py is not installed (pip install nvidia-ml-py)"
        except Exception as exc:  # pynvml.NVMLError and its many subclasses; also a missing driver library
            self.unavailable = f"NVML cannot be used: {exc}"

    def __enter__(self) -> "GpuSampler":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        if self.unavailable or self._thread is not None:
            return
        self.origin = time.perf_counter() if self.origin is None else self.origin
        self._thread = threading.Thread(target=self._run, name="gpuaccel-gpu-sampler", daemon=True)
        self._thread.start()
        stop_at_exit(self, GpuSampler.stop)

    def stop(self) -> None:
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._thread = None

    def _run(self) -> None:
        out = open(self.path, "a") if self.path is not None else None
        last_flush = time.perf_counter()
        try:
            while not self._stop.is_set():
                now = time.perf_counter()
                rows = []
                for index, handle in zip(self.cuda_indices, self._handles):
                    try:
                        rows.append({"t": round(now - self.origin, 3), "gpu": index, **_read(self._pynvml, handle)})
                    except self._pynvml.NVMLError:
                        continue  # a field this GPU does not report this time; the next sample tries again
                with self._lock:
                    self.samples.extend(rows)
                if out is not None:
                    out.writelines(json.dumps(r) + "\n" for r in rows)
                    if now - last_flush > 1.0:
                        out.flush()
                        last_flush = now
                self._stop.wait(self.interval)
        finally:
            if out is not None:
                out.close()

    def mean(self, field: str, since: float = 0.0, until: float = float("inf")) -> float | None:
        """The mean of ``field`` over samples taken from ``since`` to ``until`` (None without samples)."""
        with self._lock:
            values = [s[field] for s in self.samples if since <= s["t"] <= until]
        return sum(values) / len(values) if values else None

    def peak(self, field: str) -> float | None:
        with self._lock:
            return max((s[field] for s in self.samples), default=None)


def read_samples(path: Path) -> list[dict]:
    """The samples a sampler wrote (a torn last line, from a killed run, is ignored)."""
    rows = []
    if Path(path).exists():
        for line in Path(path).read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return rows
