"""``gpuaccel bench``: one model and data set through a ladder of configurations.

Each rung adds one optimisation to the rung before it, so the table answers both "how
much faster than my CPU?" and "what made it faster?":

    cpu            CPU, fp32, all cores, data in memory (the baseline)
    gpu-fp32       GPU, fp32, eager, a standard multi-worker CPU DataLoader
    amp            + bf16 (or fp16) autocast
    channels-last  + NHWC memory layout
    gpu-data       + the data set resident in GPU memory, augmented there
    compile        + torch.compile
    cuda-graphs    + CUDA graphs (compile mode reduce-overhead)
    max-batch      + the largest batch that fits (powers of two up to a cap; lr scaled by sqrt)
    multi-gpu      + every GPU of the machine (data parallel, `gpuaccel train --gpus N`)

Every rung runs the real training engine (:class:`~gpuaccel.train.Trainer`): after its
warm-up (compilation, cuDNN autotuning), timed windows of whole optimizer steps are
measured between device synchronisations, and the median window gives the throughput.
The split into waiting for data and computing comes from events on the GPU's own
timeline (:class:`~gpuaccel.monitor.DataWaitMeter`).
"""

from __future__ import annotations

import gc
import importlib.util
import itertools
import json
import math
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.nn.functional as F

from .. import __version__
from ..data import load_dataset
from ..device import resolve_device, resolve_precision, synchronize
from ..errors import GpuaccelError, choice_error
from ..models import create_model
from ..monitor import DataWaitMeter, GpuSampler
from ..train import TrainConfig, Trainer
from ..files import RunLock, make_directory, new_directory, write_json
from .env import collect
from .timing import matmul_tflops


@dataclass(frozen=True)
class Rung:
    name: str
    adds: str
    settings: dict  # TrainConfig fields this rung sets, on top of the rungs before it


RUNGS = (
    Rung("cpu", "CPU fp32 on all cores (baseline)",
         {"device": "cpu", "precision": "fp32", "channels_last": False, "loader": "auto", "compile": False}),
    Rung("gpu-fp32", "GPU fp32 eager, multi-worker CPU DataLoader",
         {"device": "cuda", "precision": "fp32", "channels_last": False, "loader": "cpu", "compile": False}),
    Rung("amp", "+ mixed precision autocast", {"precision": "auto"}),
    Rung("channels-last", "+ channels_last memory layout", {"channels_last": True}),
    Rung("gpu-data", "+ data set resident on the GPU, augmented there", {"loader": "gpu"}),
    Rung("compile", "+ torch.compile", {"compile": True, "compile_mode": "default"}),
    Rung("cuda-graphs", "+ CUDA graphs (compile mode reduce-overhead)", {"compile_mode": "reduce-overhead"}),
    Rung("max-batch", "+ largest batch that fits (lr x sqrt of the batch ratio)", {}),
    Rung("multi-gpu", "+ all GPUs of this machine", {}),
)
RUNG_NAMES = tuple(r.name for r in RUNGS)
MAX_BATCH_CAP = 8192


@dataclass
class BenchOptions:
    data: str = "digits"
    model: str = "lenet5"
    batch_size: int = 128
    lr: float = 0.05
    crop_padding: int = 4
    flip: str = "random"
    image_size: int | None = None
    val_split: float | None = None
    precision: str = "auto"  # of the mixed-precision rungs: auto, bf16 or fp16
    device: str = "auto"  # the GPU to use; cpu skips every GPU rung
    only: list[str] | None = None
    quick: bool = False
    time_to_acc: float | None = None
    epochs: int = 10  # at most, for --time-to-acc
    workers: int | None = None
    run_dir: str | None = None
    command: list[str] = field(default_factory=lambda: list(sys.argv))

    def validate(self) -> "BenchOptions":
        for name in self.only or []:
            if name not in RUNG_NAMES:
                raise choice_error("rung", name, RUNG_NAMES)
        if self.only is not None and not self.only:
            raise GpuaccelError("--only needs at least one rung")
        if self.precision not in ("auto", "bf16", "fp16"):
            raise GpuaccelError(f"--precision picks the mixed-precision rungs' dtype: auto, bf16 or fp16, "
                                f"not {self.precision!r}")
        device = resolve_device(self.device)
        if self.precision == "fp16" and device.type != "cuda":
            raise GpuaccelError("--precision fp16 needs a CUDA GPU: fp16 autocast cannot run on the CPU")
        if self.time_to_acc is not None and not 0 < self.time_to_acc <= 1:
            raise GpuaccelError(f"--time-to-acc is a fraction in (0, 1] (e.g. 0.9), got {self.time_to_acc}")
        for name in ("batch_size", "epochs"):
            if getattr(self, name) < 1:
                raise GpuaccelError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        return self


def skip_reason(rung: Rung, device: torch.device) -> str | None:
    """Why a rung cannot run here, or None."""
    if rung.name == "cpu":
        return None
    if device.type != "cuda":
        return "no CUDA GPU here" if not torch.cuda.is_available() else "--device cpu"
    if rung.name in ("compile", "cuda-graphs") and importlib.util.find_spec("triton") is None:
        return "torch.compile on a GPU needs triton, which is not installed"
    if rung.name == "multi-gpu" and torch.cuda.device_count() < 2:
        return "one GPU here"
    return None


def training_flops_per_image(model_name: str, model_args: dict) -> float:
    """Forward plus backward FLOPs of one image (PyTorch's FLOP counter, on the CPU)."""
    from torch.utils.flop_counter import FlopCounterMode

    model = create_model(model_name, **model_args)
    x = torch.randn(2, model_args["in_channels"], model_args["image_size"], model_args["image_size"])
    with FlopCounterMode(display=False) as counter:
        model(x).float().sum().backward()
    return counter.get_total_flops() / 2


class PeakFlops:
    """Measured matrix-multiply peaks, per (device, dtype), each measured once.

    fp32 training on a GPU is compared against the TF32 peak because cuDNN runs fp32
    convolutions in TF32 by default (``torch.backends.cudnn.allow_tf32``)."""

    def __init__(self):
        self.measured: dict[str, float] = {}

    def tflops(self, device: torch.device, precision: str) -> float:
        key = f"{device.type}-{precision}"
        if key not in self.measured:
            if device.type == "cpu":
                self.measured[key] = matmul_tflops(device, torch.float32, 2048, repeats=5)
            else:
                dtype = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16,
                         "fp16": torch.float16}[precision]
                self.measured[key] = matmul_tflops(device, dtype, 8192, tf32=precision in ("fp32", "tf32"))
        return self.measured[key]


def _endless(loader):
    for epoch in itertools.count():
        yield from loader.batches(epoch)


def measure_throughput(trainer: Trainer, quick: bool) -> dict:
    """Throughput of whole optimizer steps after warm-up: the median over timed windows."""
    windows, window_seconds = (3, 0.3) if quick else (7, 1.0)
    device = trainer.device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)  # the peak includes warm-up: compilation, autotuning
    warmup_seconds = trainer.warm_up(evaluate=False)
    batches = _endless(trainer.train_loader)

    def run(steps: int, meter: DataWaitMeter | None = None):
        chunk = itertools.islice(batches, steps)
        for images, labels in (meter.timed(chunk) if meter else chunk):
            trainer.train_step(images, labels)

    run(2)  # the loader's own first batches (worker start-up) are not steady state
    synchronize(device)
    start = time.perf_counter()
    run(3)
    synchronize(device)
    step_seconds = (time.perf_counter() - start) / 3
    steps = max(2, min(1000, math.ceil(window_seconds / step_seconds)))
    meter = DataWaitMeter(device)
    timed_from = time.perf_counter()
    rates, shares = [], []
    for _ in range(windows):
        synchronize(device)
        start = time.perf_counter()
        run(steps, meter)
        synchronize(device)
        elapsed = time.perf_counter() - start
        rates.append(steps * trainer.config.loop.batch_size / elapsed)
        shares.append(meter.read()["data_share"])
    result = {"images_per_second": statistics.median(rates), "images_per_second_min": min(rates),
              "images_per_second_max": max(rates), "step_ms": 1000 * trainer.config.loop.batch_size /
              statistics.median(rates), "data_wait_share": statistics.median(shares),
              "windows": windows, "steps_per_window": steps, "warmup_seconds": round(warmup_seconds, 3),
              "timed_from": timed_from, "timed_to": time.perf_counter()}
    if device.type == "cuda":
        result["peak_memory_mib"] = round(torch.cuda.max_memory_allocated(device) / 2**20)
    return result


def find_max_batch(config: TrainConfig, model_args: dict, cap: int) -> tuple[int, list[int]]:
    """The largest power-of-two multiple of the batch size (up to ``cap``) whose training step
    fits in GPU memory, probed with eager steps on random data. Returns it and the sizes tried."""
    device = resolve_device(config.runtime.device)
    precision = resolve_precision(config.runtime.precision, device)
    layout = torch.channels_last if config.runtime.channels_last else torch.contiguous_format
    best, tried, batch = config.loop.batch_size, [], config.loop.batch_size * 2
    while batch <= cap:
        tried.append(batch)
        model = create_model(config.model.name, **model_args).to(device, memory_format=layout)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        try:
            x = torch.randn(batch, model_args["in_channels"], model_args["image_size"], model_args["image_size"],
                            device=device, dtype=precision.input_dtype).contiguous(memory_format=layout)
            y = torch.randint(0, model_args["num_classes"], (batch,), device=device)
            for _ in range(2):
                with precision.autocast(device):
                    loss = F.cross_entropy(model(x), y)
                loss.backward()
                optimizer.step()
            synchronize(device)
            best = batch
        except torch.OutOfMemoryError:
            break
        finally:
            del model, optimizer
            gc.collect()
            torch.cuda.empty_cache()
        batch *= 2
    return best, tried


def _release() -> None:
    """Frees what the last rung left on the GPU (call after dropping its trainer)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    torch.compiler.reset()  # each rung compiles afresh; do not run into the recompilation limit


def run_bench(options: BenchOptions, log=print) -> dict:
    """Runs the selected rungs, writes ``results.json`` (and ``gpu.jsonl``) to the run
    directory and returns the results. The directory is this benchmark's alone: a new one
    (``~2``, ``~3`` ... where another started in the same second), or ``--run-dir``, locked
    while the benchmark runs and refused where it holds another benchmark's results."""
    options.validate()
    if options.run_dir:
        run_dir = make_directory(options.run_dir)
    else:
        run_dir = new_directory(Path(f"runs/bench-{options.model.replace(':', '_')}-"
                                     f"{datetime.now().strftime('%Y%m%d-%H%M%S')}"))
    with RunLock(run_dir):
        if (run_dir / "results.json").exists():
            raise GpuaccelError(f"{run_dir} holds a benchmark's results already; pick another --run-dir")
        return _run_bench(options, run_dir, log)


def _run_bench(options: BenchOptions, run_dir: Path, log) -> dict:
    gpu = resolve_device(options.device)
    dataset = load_dataset(options.data, val_split=options.val_split, image_size=options.image_size)  # Pillow, as train
    model_args = {"num_classes": dataset.num_classes, "in_channels": dataset.in_channels,
                  "image_size": dataset.image_size}
    base = TrainConfig(data=options.data, model=options.model, batch_size=options.batch_size, lr=options.lr,
                       crop_padding=options.crop_padding, flip=options.flip, workers=options.workers,
                       monitor=False, epochs=options.epochs).validate()
    flops = training_flops_per_image(options.model, model_args)
    peaks = PeakFlops()
    selected = set(options.only or RUNG_NAMES)
    log(f"{dataset.describe()}; model {options.model}, {flops / 1e6:,.2f} MFLOP per training image; "
        f"run dir {run_dir}")

    origin = time.perf_counter()
    sampler = GpuSampler(run_dir / "gpu.jsonl", [gpu.index or 0] if gpu.type == "cuda" else [], origin=origin)
    sampler.start()
    rows: list[dict] = []
    settings: dict = {}
    try:
        for rung in RUNGS:
            settings.update(rung.settings)
            if rung.name not in selected:
                continue
            reason = skip_reason(rung, gpu)
            if reason:
                rows.append({"rung": rung.name, "adds": rung.adds, "skipped": reason})
                log(f"{rung.name:14s} skipped: {reason}")
                continue
            config = base.replace(**settings)
            if config.runtime.device == "cuda":
                config = config.replace(device=str(gpu),
                                        precision=options.precision if config.runtime.precision == "auto" else "fp32")
            extra = {}
            if rung.name == "max-batch":
                batch, tried = find_max_batch(config, model_args, min(MAX_BATCH_CAP, len(dataset.train_labels) // 4))
                config = config.replace(batch_size=batch,
                                        lr=base.optimizer.lr * math.sqrt(batch / base.loop.batch_size))
                settings.update(batch_size=config.loop.batch_size,
                                lr=config.optimizer.lr)  # the next rung keeps the batch
                extra["batch_sizes_tried"] = tried
            if rung.name == "multi-gpu":
                rows.append(_measure_data_parallel(rung, config, options, flops, peaks, run_dir, log))
                continue
            rows.append({**_measure_rung(rung, config, dataset, options, flops, peaks, sampler, origin, run_dir,
                                         log), **extra})
    finally:
        sampler.stop()

    _add_speedups(rows)
    results = {"kind": "bench", "run_dir": str(run_dir), "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
               "command": options.command, "gpuaccel": __version__, "env": collect(),
               "data": dataset.name, "train_images": len(dataset.train_labels), "model": options.model,
               "model_args": model_args, "training_flops_per_image": flops,
               "peak_tflops": peaks.measured, "gpu_monitor": sampler.unavailable or "gpu.jsonl",
               "options": {k: v for k, v in vars(options).items() if k != "command"}, "rungs": rows}
    measured = [r for r in rows if "images_per_second" in r]
    if measured:
        results["best"] = best_rung(measured, options.time_to_acc)
    write_json(run_dir / "results.json", results)
    return results


def best_rung(measured: list[dict], target: float | None) -> dict:
    """The headline rung: with a target accuracy, the one that reached it soonest (a rung that
    never reached it cannot win on throughput alone); otherwise the highest throughput."""
    reached = [r for r in measured if r.get("time_to_acc") is not None]
    if target is not None and reached:
        best, ranked_by = min(reached, key=lambda r: r["time_to_acc"]), f"time to {100 * target:g}% accuracy"
    else:
        best, ranked_by = max(measured, key=lambda r: r["images_per_second"]), "throughput"
    return {"rung": best["rung"], "ranked_by": ranked_by, "images_per_second": best["images_per_second"],
            "speedup_vs_cpu": best.get("speedup_vs_cpu"), "time_to_acc": best.get("time_to_acc"),
            "final_accuracy": best.get("final_accuracy"), "unreached": target is not None and not reached}


def _measure_rung(rung, config, dataset, options, flops, peaks, sampler, origin, run_dir, log) -> dict:
    trainer = None
    row = {"rung": rung.name, "adds": rung.adds}
    try:
        trainer = Trainer(config, dataset=dataset, quiet=True)
        row.update({"device": str(trainer.device), "precision": trainer.precision.name,
               "channels_last": trainer.channels_last, "loader": type(trainer.train_loader).__name__,
               "compile": config.runtime.compile and config.runtime.compile_mode, "batch_size": config.loop.batch_size,
               "lr": config.optimizer.lr})
        row.update(measure_throughput(trainer, options.quick))
        # the timed windows on the clock of the GPU samples, to match the two
        row.update(t_start=round(row.pop("timed_from") - origin, 3), t_end=round(row.pop("timed_to") - origin, 3))
        achieved = flops * row["images_per_second"] / 1e12
        row.update(model_tflops=achieved, mfu=achieved / peaks.tflops(trainer.device, trainer.precision.name))
        if trainer.device.type == "cuda":
            row["gpu_util"] = sampler.mean("util", since=row["t_start"], until=row["t_end"])
        log(_format_row(row))
        if options.time_to_acc is not None and trainer.device.type == "cuda":
            trainer = None
            _release()
            trainer = Trainer(config.replace(target_acc=options.time_to_acc,
                                             run_dir=str(run_dir / "rungs" / row_name(config))),
                              dataset=dataset, quiet=True)
            summary = trainer.fit()
            row.update(time_to_acc=summary["time_to_target"], final_accuracy=summary["metrics"].get("accuracy"),
                       epochs_trained=summary["epochs"], train_dir=str(Path(summary["run_dir"]).relative_to(run_dir)))
            reached = f"{summary['time_to_target']:.2f} s" if summary["time_to_target"] is not None else \
                f"not reached in {summary['epochs']:g} epochs ({100 * (summary['metrics'].get('accuracy') or 0):.2f}%)"
            log(f"{'':14s} time to {100 * options.time_to_acc:.1f}%: {reached}")
        return row
    except torch.OutOfMemoryError:
        return {"rung": rung.name, "adds": rung.adds, "skipped": f"out of GPU memory at batch {config.loop.batch_size}"}
    finally:
        trainer = None
        _release()


def _measure_data_parallel(rung, config: TrainConfig, options, flops, peaks, run_dir: Path, log) -> dict:
    """The previous rung's settings on every GPU of the machine: ``gpuaccel train --gpus N``
    (torch.distributed.run, DDP), each process with the rung's batch. It trains for as long as
    a single-GPU rung is timed; its throughput is the run's images over its training time
    (warm-up and the final evaluation excluded), not a median over windows."""
    gpus = torch.cuda.device_count()
    rung_dir = run_dir / "rungs" / f"multi-gpu-{gpus}"
    seconds = 0.9 if options.quick else 7.0
    settings = config.replace(device="auto", epochs=100_000, time_limit=seconds, eval_every=10**9, monitor=True,
                              target=None, target_acc=None).flat()
    settings.pop("run_dir")
    recipe = run_dir / "rungs" / f"multi-gpu-{gpus}.yaml"
    recipe.parent.mkdir(parents=True, exist_ok=True)
    recipe.write_text(json.dumps(settings, indent=1) + "\n")  # JSON is YAML
    command = [sys.executable, "-m", "gpuaccel", "train", "--gpus", str(gpus), "--recipe", str(recipe),
               "--run-dir", str(rung_dir), "--quiet"]
    row = {"rung": rung.name, "adds": f"+ all {gpus} GPUs of this machine (data parallel)",
           "command": " ".join(command[1:])}
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        errors = [line for line in done.stderr.splitlines() if line.startswith("gpuaccel: error:")]
        row["skipped"] = f"gpuaccel train --gpus {gpus} failed: " + (
            errors[-1][len("gpuaccel: error: "):] if errors else done.stderr.strip().splitlines()[-1][:300])
        log(f"{rung.name:14s} skipped: {row['skipped']}")
        return row
    summary = json.loads((rung_dir / "summary.json").read_text())
    record = [json.loads(line) for line in (rung_dir / "metrics.jsonl").read_text().splitlines()][-1]
    speed = summary["samples_per_second"]
    achieved = flops * speed / 1e12
    row.update(device=f"{gpus} x cuda", precision=summary["precision"], channels_last=summary["channels_last"],
               loader="resident" if config.data.loader == "gpu" else config.data.loader,
               compile=config.runtime.compile and config.runtime.compile_mode, batch_size=config.loop.batch_size,
               lr=config.optimizer.lr, gpus=gpus,
               global_batch_size=summary["global_batch_size"], images_per_second=speed,
               images_per_second_min=speed, images_per_second_max=speed,
               step_ms=1000 * config.loop.batch_size * gpus / speed,
               data_wait_share=record["data_wait"], train_seconds=summary["train_seconds"],
               warmup_seconds=summary["warmup_seconds"], model_tflops=achieved,
               mfu=achieved / (gpus * peaks.tflops(torch.device("cuda"), summary["precision"])),
               gpu_util=record.get("gpu_util"), rung_run_dir=str(rung_dir.relative_to(run_dir)))
    if summary.get("peak_gpu_memory_gib") is not None:
        row["peak_memory_mib"] = round(summary["peak_gpu_memory_gib"] * 1024)
    log(_format_row(row) + f" ({gpus} GPUs, GPU 0's memory and busy share)")
    return row


def row_name(config: TrainConfig) -> str:
    parts = [config.runtime.device.split(":")[0], config.runtime.precision,
             "nhwc" if config.runtime.channels_last else "nchw",
             f"loader-{config.data.loader}",
             f"compile-{config.runtime.compile_mode}" if config.runtime.compile else "eager",
             f"b{config.loop.batch_size}"]
    return "_".join(parts)


def _add_speedups(rows: list[dict]) -> None:
    cpu = next((r["images_per_second"] for r in rows if r["rung"] == "cpu" and "images_per_second" in r), None)
    previous = None
    for row in rows:
        if "images_per_second" not in row:
            continue
        if cpu:
            row["speedup_vs_cpu"] = row["images_per_second"] / cpu
        if previous:
            row["speedup_vs_previous"] = row["images_per_second"] / previous
        previous = row["images_per_second"]


def _format_row(row: dict) -> str:
    memory = f", peak {row['peak_memory_mib']:,} MiB" if "peak_memory_mib" in row else ""
    util = f", GPU busy {row['gpu_util']:.0f}%" if row.get("gpu_util") is not None else ""
    return (f"{row['rung']:14s} {row['images_per_second']:>11,.0f} img/s (batch {row['batch_size']}), "
            f"data wait {100 * row['data_wait_share']:.1f}%, MFU {100 * row['mfu']:.1f}%{memory}{util}")


def format_table(results: dict) -> str:
    """The ladder as a plain-text table."""
    head = f"{'rung':14s} {'img/s':>11s} {'x CPU':>8s} {'x prev':>7s} {'data wait':>9s} {'MFU':>6s} " \
           f"{'peak MiB':>9s}  adds"
    lines = [head, "-" * len(head)]
    for r in results["rungs"]:
        if "skipped" in r:
            lines.append(f"{r['rung']:14s} {'skipped: ' + r['skipped']}")
            continue
        lines.append(f"{r['rung']:14s} {r['images_per_second']:>11,.0f} {_x(r.get('speedup_vs_cpu')):>8s} "
                     f"{_x(r.get('speedup_vs_previous')):>7s} {100 * r['data_wait_share']:>8.1f}% "
                     f"{100 * r['mfu']:>5.1f}% {r.get('peak_memory_mib', '-'):>9}  {r['adds']}")
    return "\n".join(lines)


def _x(value) -> str:
    return "-" if value is None else f"{value:,.1f}x"
