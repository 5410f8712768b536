"""What a run reports: its first lines, the line it prints per evaluation, and the summary
``fit`` returns (and writes to summary.json)."""

from __future__ import annotations

import torch

from ..device import device_name
from .evaluation import best_model_metric


def start_lines(trainer) -> list[str]:
    """The run's first lines: the data, task, model, device, precision and run directory; how it
    trains (strategy, step graph, JPEG decoding); which class index is which."""
    lines = []
    cfg = trainer.config
    lines.append(f"{trainer.inputs.description}; task {trainer.task.name}; model {cfg.model.name} "
                 f"({trainer.parameter_count:,} parameters) on {device_name(trainer.device)} [{trainer.device}], "
                 f"{trainer.precision.name}; run dir {trainer.run_dir}"
                 + (f"; {trainer.strategy.describe()}" if trainer.strategy.describe() else "")
                 + (f", {trainer.batch_per_process} samples each per step" if trainer.data_ranks > 1 else "")
                 + (f" (the global batch of {cfg.loop.batch_size} kept: strong scaling)"
                    if trainer.data_ranks > 1 and cfg.loop.global_batch else "")
                 + ("; each training step one CUDA graph (inductor's kernels inside it)"
                    if trainer.step_graph_off is None else "")
                 + (f"; no whole-step CUDA graph: {trainer.step_graph_off}"
                    if trainer.step_graph_off is not None and trainer.torch_compile_graphs else "")
                 + (f"; JPEG decoding: {trainer.jpeg_decoder}" if trainer.jpeg_decoder else ""))
    if trainer.inputs.classes:  # folder names sort as strings: "10" before "2"; say which index is which
        shown = [f"{i}={name}" for i, name in enumerate(trainer.inputs.classes[:20])]
        more = len(trainer.inputs.classes) - len(shown)
        lines.append("classes (index=name): " + ", ".join(shown) + (f", ... ({more} more)" if more else ""))
    return lines


def summarise(trainer, stopped_by: str, wall_seconds: float) -> dict:
    """The run's summary: where and how it trained, on what, for how long, how fast and how well."""
    config, inputs = trainer.config, trainer.inputs
    rate = round(trainer.state.samples_seen / trainer.state.train_seconds if trainer.state.train_seconds > 0 else 0.0,
                 1)
    target = config.loop.target_metric
    summary = {
        "device": str(trainer.device), "device_name": device_name(trainer.device),
        "precision": trainer.precision.name, "channels_last": trainer.channels_last, "compile": config.runtime.compile,
        "compile_plan": trainer.compile_plan,  # (None, "now", or "background": this run uncompiled)
        "step_graph": trainer.step_graph_off is None, "step_graph_off": trainer.step_graph_off,
        "model": config.model.name, "parameters": trainer.parameter_count, "task": trainer.task.name,
        "data": inputs.name, "train_samples": inputs.train_samples, "test_samples": inputs.test_samples,
        "skipped_samples": inputs.skipped, "epochs": round(trainer.epochs_done, 4), "steps": trainer.state.global_step,
        "stopped_by": stopped_by, "resumed": trainer.state.resumed, "setup_seconds": round(trainer.times.setup_seconds, 3),
        "warmup_seconds": round(trainer.times.warmup_seconds, 3), "warmup_phases": dict(trainer.times.warmup_phases),
        "wall_seconds": round(wall_seconds, 3),
        "train_seconds": round(trainer.state.train_seconds, 3), "samples_per_second": rate, "sample_unit": inputs.unit,
        "tokens_per_second": round(rate * inputs.tokens_per_sample) if inputs.tokens_per_sample else None,
        "main_metric": trainer.task.default_target,
        # how a metric was computed where a library names it (translation: sacreBLEU's signatures)
        "metric_signatures": dict(getattr(trainer.task, "signatures", None) or {}) or None,
        "metrics": dict(trainer.state.last_eval), "best_metrics": dict(trainer.state.best_metrics),
        "best_model": best_model(trainer),
        "target": config.loop.target, "target_metric": target[0] if target else None,
        "time_to_target": None if trainer.state.time_to_target is None else round(trainer.state.time_to_target, 3),
        "run_dir": str(trainer.run_dir), "torch": torch.__version__, "gpuaccel": trainer.version,
        "peak_gpu_memory_gib": round(torch.cuda.max_memory_allocated(trainer.device) / 2**30, 2)
        if trainer.device.type == "cuda" else None,
        "jpeg_decoder": trainer.jpeg_decoder,
        "processes": trainer.dist.world_size, "strategy": trainer.strategy.describe() or None,
        "global_batch_size": trainer.batch_per_process * trainer.data_ranks * config.optimizer.grad_accum,
        "samples_seen": trainer.state.samples_seen, "restarts": trainer.dist.restart,
        "phases": trainer.times.phases.table(),  # this process's wall-clock time, phase by phase, until now
        # with several processes: each one's phases until the warm-up (the slowest holds the rest there)
        "setup_phases_by_process": list(trainer.times.setup_by_process) or None,
    }
    return summary


def format_record(record: dict, epochs: float, metric_names, unit: str = "samples") -> str:
    """One evaluation's line: position, losses, metrics, throughput (of ``unit``, e.g. images),
    time, data wait, GPU use."""
    shown = "".join(f", test {name} " + (f"{100 * record[name]:.2f}%" if name == "accuracy" else f"{record[name]:.4g}")
                    for name in metric_names if name in record)
    train = "n/a" if record["train_loss"] is None else f"{record['train_loss']:.4f}"
    rate = f"{record['tokens_per_second']:,.0f} tokens/s" if "tokens_per_second" in record \
        else f"{record['samples_per_second']:,.0f} {unit}/s"
    return (f"epoch {record['epoch']:.2f}/{epochs:g} step {record['step']}: train loss {train}, "
            f"test loss {record['loss']:.4f}{shown}, {rate}, {record['elapsed']:.1f} s, "
            f"data wait {100 * record['data_wait']:.0f}%"
            + (f", GPU busy {record['gpu_util']:.0f}%" if "gpu_util" in record else ""))


def best_model(trainer) -> dict | None:
    """Which file holds the best evaluation's weights: model.pt where the last evaluation was the
    best, else best.pt; with its step and the metric that ranked it. None before any evaluation."""
    if trainer.state.best_step is None:
        return None
    metric = best_model_metric(trainer)
    last = trainer.state.best_step == trainer.state.evaluated_at == trainer.state.global_step
    return {"file": "model.pt" if last else "best.pt", "step": trainer.state.best_step, "metric": metric,
            "value": trainer.state.best_metrics.get(metric)}
