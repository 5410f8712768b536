"""What this machine is (``collect``) and what it can do, measured (``measure_ceilings``).

The ceilings follow the method for timing GPU work: CUDA events around the region, a
warm-up first, the median of repeated runs on random (never zero) data, and sizes far
larger than the L2 cache.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import subprocess

import torch

from ..device import cpu_name
from .timing import matmul_tflops, median_ms

OPTIONAL_PACKAGES = ("torchvision", "timm", "onnx", "onnxruntime", "onnxscript", "nvidia-ml-py", "triton",
                     "matplotlib", "torch-pruning", "tqdm", "scikit-learn", "pillow")


def _memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _nvml_details(index: int) -> dict:
    """Clocks and power limit from NVML (nvidia-ml-py) when it is installed."""
    try:
        import pynvml
    except ImportError:
        return {}
    try:
        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        return {"driver": pynvml.nvmlSystemGetDriverVersion(),
                "sm_clock_max_mhz": pynvml.nvmlDeviceGetMaxClockInfo(handle, pynvml.NVML_CLOCK_SM),
                "memory_clock_max_mhz": pynvml.nvmlDeviceGetMaxClockInfo(handle, pynvml.NVML_CLOCK_MEM),
                "power_limit_w": pynvml.nvmlDeviceGetPowerManagementLimit(handle) / 1000.0}
    except pynvml.NVMLError as exc:
        return {"nvml_error": str(exc)}


def _driver_from_smi() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, subprocess.TimeoutExpired, IndexError):
        return None


def collect() -> dict:
    gpus = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            gpu = {"index": i, "name": p.name, "memory_bytes": p.total_memory,
                   "compute_capability": f"{p.major}.{p.minor}", "multiprocessors": p.multi_processor_count}
            gpu.update(_nvml_details(i))
            gpu.setdefault("driver", _driver_from_smi())
            gpus.append(gpu)
    packages = {}
    for name in OPTIONAL_PACKAGES:
        try:
            packages[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            packages[name] = None
    return {
        "cpu": {"model": cpu_name(), "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                "memory_bytes": _memory_bytes()},
        "os": platform.platform(), "python": platform.python_version(),
        "torch": torch.__version__, "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None,
        "gpus": gpus, "packages": packages,
    }


def measure_ceilings(device: torch.device, matmul_size: int = 8192, copy_bytes: int = 2 << 30) -> dict:
    """Matrix-multiply TFLOP/s (bf16, fp32 and tf32), device-to-device copy bandwidth (bytes
    read plus written), host-to-device bandwidth from pinned and from pageable memory."""
    if device.type != "cuda":
        return {"skipped": "no CUDA GPU: the ceilings are GPU measurements"}
    n = matmul_size
    result = {}
    for label, dtype, tf32 in (("bf16", torch.bfloat16, False), ("fp32", torch.float32, False),
                               ("tf32", torch.float32, True)):
        result[f"matmul_{label}_tflops"] = matmul_tflops(device, dtype, n, tf32)
    src = torch.randint(0, 255, (copy_bytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    result["d2d_copy_gb_per_s"] = 2 * copy_bytes / (median_ms(lambda: dst.copy_(src), device) / 1000) / 1e9
    del src, dst
    host_bytes = copy_bytes // 4
    gpu = torch.empty(host_bytes, dtype=torch.uint8, device=device)
    for label, pinned in (("pinned", True), ("pageable", False)):
        host = torch.randint(0, 255, (host_bytes,), dtype=torch.uint8)
        if pinned:
            host = host.pin_memory()
        ms = median_ms(lambda: gpu.copy_(host, non_blocking=pinned), device, repeats=10)
        result[f"h2d_{label}_gb_per_s"] = host_bytes / (ms / 1000) / 1e9
    result.update(matmul_size=n, copy_bytes=copy_bytes, host_copy_bytes=host_bytes)
    return result


def format_report(info: dict) -> str:
    gib = 1024 ** 3
    lines = [f"CPU      {info['cpu']['model']}, {info['cpu']['cores']} cores "
             f"({info['cpu']['torch_threads']} torch threads)" +
             (f", {info['cpu']['memory_bytes'] / gib:.1f} GiB RAM" if info['cpu']['memory_bytes'] else ""),
             f"system   {info['os']}, Python {info['python']}",
             f"torch    {info['torch']}; CUDA {info['cuda'] or 'none'}; cuDNN {info['cudnn'] or 'none'}; "
             f"NCCL {info['nccl'] or 'none'}"]
    if not info["gpus"]:
        lines.append("GPU      none visible to PyTorch")
    for g in info["gpus"]:
        extra = ", ".join(f"{k} {g[k]}" for k in ("driver", "sm_clock_max_mhz", "memory_clock_max_mhz",
                                                   "power_limit_w") if g.get(k) is not None)
        lines.append(f"GPU {g['index']}    {g['name']}, {g['memory_bytes'] / gib:.1f} GiB, compute capability "
                     f"{g['compute_capability']}, {g['multiprocessors']} SMs" + (f"; {extra}" if extra else ""))
    found = [f"{k} {v}" for k, v in info["packages"].items() if v]
    missing = [k for k, v in info["packages"].items() if not v]
    lines.append("packages " + ", ".join(found) + (f"; not installed: {', '.join(missing)}" if missing else ""))
    ceilings = info.get("ceilings")
    if ceilings:
        if "skipped" in ceilings:
            lines.append(f"measured skipped: {ceilings['skipped']}")
        else:
            lines.append(f"measured matmul {ceilings['matmul_bf16_tflops']:.0f} TFLOP/s bf16, "
                         f"{ceilings['matmul_tf32_tflops']:.0f} tf32, {ceilings['matmul_fp32_tflops']:.1f} fp32 "
                         f"({ceilings['matmul_size']}^3); device copy {ceilings['d2d_copy_gb_per_s']:,.0f} GB/s; "
                         f"host to device {ceilings['h2d_pinned_gb_per_s']:.1f} GB/s pinned, "
                         f"{ceilings['h2d_pageable_gb_per_s']:.1f} GB/s pageable")
    return "\n".join(lines)
