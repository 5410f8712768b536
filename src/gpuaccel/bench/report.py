"""``gpuaccel report RUN_DIR``: one self-contained ``report.html`` (plus ``results.json``)
for a bench run or a training run.

Charts are drawn with matplotlib (the ``report`` extra) and embedded as inline SVG, so
the page needs no network, no script and no file beside it. Without matplotlib the page
still has every table, and says how to get the charts.
"""

from __future__ import annotations

import html
import io
import json
from datetime import datetime, timezone
from pathlib import Path

from ..errors import GpuaccelError
from ..monitor.gpu import read_samples
from ..files import MetricsFile, atomic_write, write_json

_CSS = """
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; margin: 2em auto; max-width: 1100px;
       color: #1d1d1f; padding: 0 1em; }
h1 { font-size: 1.6em; margin-bottom: .2em; } h2 { font-size: 1.2em; margin-top: 2em; }
table { border-collapse: collapse; margin: .5em 0; font-size: 13px; }
#ladder td.text:nth-child(2) { min-width: 16em; }
th, td { padding: .3em .7em; border-bottom: 1px solid #ddd; text-align: right; white-space: nowrap; }
th { background: #f2f2f5; } td.text, th.text { text-align: left; white-space: normal; }
tr.skipped td { color: #888; }
.meta { color: #555; } .meta code { background: #f2f2f5; padding: 0 .3em; }
figure { margin: 1em 0; } figure svg { max-width: 100%; height: auto; }
.note { background: #fff7e0; border-left: 4px solid #f0b400; padding: .5em 1em; }
"""


def write_report(run_dir) -> Path:
    """Writes ``report.html`` and ``results.json`` into ``run_dir``; returns the page's path."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise GpuaccelError(f"{run_dir} is not a directory; give the run directory of 'gpuaccel bench' or 'train'")
    results_path, summary_path = run_dir / "results.json", run_dir / "summary.json"
    try:
        if results_path.exists() and json.loads(results_path.read_text()).get("kind") == "bench":
            results = json.loads(results_path.read_text())
            body = _bench_body(results, run_dir)
        elif summary_path.exists():
            results = _train_results(run_dir)
            body = _train_body(results, run_dir)
        else:
            raise GpuaccelError(f"{run_dir} holds no gpuaccel run (neither results.json of a bench run nor "
                                f"summary.json of a training run)")
    except (OSError, json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise GpuaccelError(f"cannot read the run in {run_dir}: {exc}") from None
    title = results.get("title", "gpuaccel report")
    page = (f"<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
            f"<title>{html.escape(title)}</title><link rel=\"icon\" href=\"data:,\"><style>{_CSS}</style></head>"
            f"<body>{body}<p class=\"meta\">written {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC by "
            f"gpuaccel report</p></body></html>\n")
    out = run_dir / "report.html"
    try:
        if results.get("kind") != "bench":
            write_json(results_path, results)  # (only once the page could be made)
        atomic_write(out, lambda f: f.write(page.encode("utf-8")))  # a kill leaves the previous report whole
    except PermissionError as exc:
        raise GpuaccelError(f"cannot write the report into {run_dir} ({exc.strerror}); copy the run to a folder "
                            f"you can write") from None
    except OSError as exc:
        raise GpuaccelError(f"cannot write the report into {run_dir} ({exc.strerror or exc}); copy the run to a "
                            f"folder you can write") from None
    return out


# ---------------------------------------------------------------------- bench runs

def _bench_body(results: dict, run_dir: Path) -> str:
    env = results["env"]
    gpus = ", ".join(g["name"] for g in env.get("gpus", [])) or "none"
    results["title"] = f"gpuaccel bench: {results['model']} on {results['data']}"
    parts = [f"<h1>{html.escape(results['title'])}</h1>",
             _meta([("date", results["date"]), ("GPU", gpus),
                    ("CPU", f"{env['cpu']['model']}, {env['cpu']['cores']} cores"),
                    ("torch", f"{env['torch']} (CUDA {env.get('cuda') or 'none'})"),
                    ("training FLOPs per image", f"{results['training_flops_per_image'] / 1e6:,.2f} M"),
                    ("command", " ".join(results["command"]))])]
    best = results.get("best")
    if best and best.get("speedup_vs_cpu"):
        reached = f", {best['time_to_acc']:.2f} s to the target accuracy" if best.get("time_to_acc") else ""
        caveat = " No rung reached the target accuracy." if best.get("unreached") else ""
        parts.append(f"<p><b>Best rung by {html.escape(best.get('ranked_by', 'throughput'))}: "
                     f"{html.escape(best['rung'])}, {best['images_per_second']:,.0f} images/s{reached}, "
                     f"{best['speedup_vs_cpu']:,.1f}&times; the CPU.</b>{caveat}</p>")
    parts += ["<h2>The ladder</h2>", _ladder_table(results["rungs"]),
              "<p class=\"meta\">Throughput: median of timed windows of whole optimizer steps after warm-up, "
              "synchronised at window edges (range in brackets). Data wait: share of step time the GPU spent "
              "preparing or waiting for the batch (CUDA events). MFU: model FLOPs (PyTorch's FLOP counter) "
              "per second over the measured matrix-multiply peak of the rung's precision "
              "(TF32 for fp32 on a GPU).</p>"]
    measured = [r for r in results["rungs"] if "images_per_second" in r]
    charts = _charts()
    if charts is None:
        parts.append(_no_charts_note())
    elif measured:
        parts += ["<h2>Throughput and speed-up</h2>", charts.rung_bars(measured)]
        curves = _rung_curves(measured, run_dir)
        if curves:
            parts += ["<h2>Accuracy against training time</h2>", charts.curves(
                [(name, records, "accuracy") for name, records in curves.items()], "test accuracy")]
        samples = read_samples(run_dir / "gpu.jsonl")
        if samples:
            spans = [(r["rung"], r["t_start"], r["t_end"]) for r in measured if "t_start" in r]
            parts += ["<h2>GPU utilisation, memory and power</h2>", charts.gpu_timeline(samples, spans)]
    return "".join(parts)


def _ladder_table(rows: list[dict]) -> str:
    head = ["rung", "adds", "batch", "images/s", "&times; CPU", "&times; previous", "data wait", "MFU",
            "peak memory", "GPU busy", "time to accuracy"]
    out = ["<table id=\"ladder\"><thead><tr>" + "".join(
        f"<th{' class=text' if h in ('rung', 'adds') else ''}>{h}</th>" for h in head) + "</tr></thead><tbody>"]
    for r in rows:
        if "skipped" in r:
            out.append(f"<tr class=\"skipped\"><td class=\"text\">{html.escape(r['rung'])}</td>"
                       f"<td class=\"text\">{html.escape(r.get('adds', ''))}</td>"
                       f"<td class=\"text\" colspan=\"9\">skipped: {html.escape(r['skipped'])}</td></tr>")
            continue
        tta = r.get("time_to_acc")
        tta_text = "-" if "time_to_acc" not in r else (f"{tta:.2f} s" if tta is not None else
                                                       f"not reached ({100 * r['final_accuracy']:.1f}%)")
        cells = [r["batch_size"],
                 f"{r['images_per_second']:,.0f} [{r['images_per_second_min']:,.0f}&ndash;"
                 f"{r['images_per_second_max']:,.0f}]",
                 _times(r.get("speedup_vs_cpu")), _times(r.get("speedup_vs_previous")),
                 f"{100 * r['data_wait_share']:.1f}%", f"{100 * r['mfu']:.1f}%",
                 f"{r['peak_memory_mib']:,} MiB" if "peak_memory_mib" in r else "-",
                 f"{r['gpu_util']:.0f}%" if r.get("gpu_util") is not None else "-", tta_text]
        out.append(f"<tr><td class=\"text\">{html.escape(r['rung'])}</td>"
                   f"<td class=\"text\">{html.escape(r['adds'])}</td>" +
                   "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    return "".join(out) + "</tbody></table>"


def _rung_curves(rows: list[dict], run_dir: Path) -> dict[str, list[dict]]:
    curves = {}
    for r in rows:
        if r.get("train_dir"):
            records = MetricsFile(run_dir / r["train_dir"] / "metrics.jsonl").read()
            if records:
                curves[r["rung"]] = records
    return curves


# ---------------------------------------------------------------------- training runs

def _train_results(run_dir: Path) -> dict:
    summary = json.loads((run_dir / "summary.json").read_text())
    config = json.loads((run_dir / "config.json").read_text()) if (run_dir / "config.json").exists() else {}
    return {"kind": "train", "summary": summary, "config": config,
            "metrics": MetricsFile(run_dir / "metrics.jsonl").read()}


def _train_body(results: dict, run_dir: Path) -> str:
    """A training run of any task: its summary, every evaluation's record, and curves of the
    task's main metric and the loss against training time."""
    s = results["summary"]
    results["title"] = f"gpuaccel train: {s['model']} on {s['data']}"
    unit = s.get("sample_unit") or "samples"
    rate = s.get("samples_per_second") or 0.0
    best = s.get("best_metrics", {})
    rows = [("device", f"{s['device_name']} [{s['device']}], {s['precision']}"
                       f"{', channels_last' if s.get('channels_last') else ''}"
                       f"{', compiled' if s.get('compile') else ''}"),
            ("model", f"{s['model']}, {s['parameters']:,} parameters; task {s.get('task', 'classification')}"),
            ("data", f"{s['data']}: {_count(s.get('train_samples'))} train / {_count(s.get('test_samples'))} test "
                     f"{unit}"),
            ("stopped", f"after {s['epochs']:g} epochs ({s['steps']} steps) by {s['stopped_by']}"),
            ("time", f"training {s['train_seconds']:.2f} s, wall {s['wall_seconds']:.2f} s, set-up "
                     f"{s['setup_seconds']:.2f} s, warm-up {s['warmup_seconds']:.2f} s"),
            ("throughput", f"{rate:,.0f} {unit}/s" + (f" ({s['tokens_per_second']:,.0f} tokens/s)"
                                                      if s.get("tokens_per_second") else ""))]
    rows += [(f"test {name}", _metric(name, value) + (f" (best {_metric(name, best[name])})" if name in best else ""))
             for name, value in s.get("metrics", {}).items()]
    rows.append(("torch", s["torch"]))
    if s.get("time_to_target") is not None:
        rows.append(("time to target", f"{s['time_to_target']:.2f} s to {s.get('target') or ''}"))
    parts = [f"<h1>{html.escape(results['title'])}</h1>", "<h2>Summary</h2>", _meta(rows, table_id="summary")]
    metrics = results["metrics"]
    names = [n for n in s.get("metrics", {}) if n != "loss"]
    if metrics:
        parts += ["<h2>Evaluations</h2>", _metrics_table(metrics, names)]
    charts = _charts()
    if charts is None:
        parts.append(_no_charts_note())
    else:
        main = s.get("main_metric") if s.get("main_metric") in names else (names[0] if names else None)
        if metrics and main:
            parts += [f"<h2>{html.escape(main.replace('_', ' '))} and loss against training time</h2>",
                      charts.curves([("test", metrics, main)], f"test {main.replace('_', ' ')}")]
        if metrics:
            parts.append(charts.curves([("train", metrics, "train_loss"), ("test", metrics, "loss")], "loss"))
        samples = read_samples(run_dir / "gpu.jsonl")
        if samples:
            parts += ["<h2>GPU utilisation, memory and power</h2>", charts.gpu_timeline(samples, [])]
    return "".join(parts)


def _count(value) -> str:
    return "?" if value is None else f"{value:,}"


def _metric(name: str, value) -> str:
    if value is None:
        return "n/a"
    return f"{100 * value:.2f}%" if name == "accuracy" else f"{value:.4g}"


def _metrics_table(records: list[dict], metric_names: list[str]) -> str:
    rates = ("images_per_second", "tokens_per_second", "samples_per_second")
    rate = next((k for k in rates if any(k in r for r in records)), None)  # one rate column, the data's own
    cols = [("epoch", "{:g}"), ("step", "{}"), ("train_loss", "{:.4f}"), ("loss", "{:.4f}")]
    cols += [(name, "{:.2%}" if name == "accuracy" else "{:.4g}") for name in metric_names]
    cols += [(rate, "{:,.0f}")] if rate else []
    cols += [("data_wait", "{:.1%}"), ("gpu_util", "{:.0f}%"), ("elapsed", "{:.2f} s")]
    cols = [(k, f) for k, f in cols if any(k in r for r in records)]
    out = ["<table id=\"evaluations\"><thead><tr>" + "".join(f"<th>{html.escape(k.replace('_', ' '))}</th>"
                                                            for k, _ in cols) + "</tr></thead><tbody>"]
    for r in records:
        out.append("<tr>" + "".join(f"<td>{f.format(r[k]) if r.get(k) is not None else '-'}</td>"
                                    for k, f in cols) + "</tr>")
    return "".join(out) + "</tbody></table>"


# ---------------------------------------------------------------------- shared pieces

def _meta(rows, table_id: str = "meta") -> str:
    return f"<table id=\"{table_id}\" class=\"meta\">" + "".join(
        f"<tr><th class=\"text\">{html.escape(k)}</th><td class=\"text\"><code>{html.escape(str(v))}</code></td></tr>"
        for k, v in rows) + "</table>"


def _times(value) -> str:
    return "-" if value is None else f"{value:,.1f}&times;"


def _no_charts_note() -> str:
    return ("<p class=\"note\">Charts need matplotlib: <code>pip install matplotlib</code> (or gpuaccel[report]), "
            "then run <code>gpuaccel report RUN_DIR</code> again.</p>")


def _charts():
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    return _Charts()


class _Charts:
    def __init__(self):
        import matplotlib.pyplot as plt

        self.plt = plt

    def _svg(self, fig, alt: str) -> str:
        buffer = io.StringIO()
        fig.savefig(buffer, format="svg", bbox_inches="tight")
        self.plt.close(fig)
        svg = buffer.getvalue()
        svg = svg[svg.index("<svg"):]  # drop the XML prologue: the SVG lives inside HTML
        return f"<figure role=\"img\" aria-label=\"{html.escape(alt)}\">{svg}</figure>"

    def rung_bars(self, rows: list[dict]) -> str:
        names = [r["rung"] for r in rows]
        fig, (left, right) = self.plt.subplots(1, 2, figsize=(11, 0.45 * len(rows) + 1.5))
        rates = [r["images_per_second"] for r in rows]
        left.barh(names, rates, color="#3b7dd8")
        left.set_xscale("log")
        left.set_xlabel("training images/s (log scale)")
        left.invert_yaxis()
        for y, rate in enumerate(rates):
            left.annotate(f"{rate:,.0f}", (rate, y), xytext=(3, 0), textcoords="offset points", va="center",
                          fontsize=8)
        speedups = [r.get("speedup_vs_cpu") or 0 for r in rows]
        right.barh(names, speedups, color="#2a9d5b")
        right.set_xscale("log" if max(speedups) > 20 else "linear")
        right.set_xlabel("speed-up over the CPU rung")
        right.invert_yaxis()
        right.set_yticklabels([])
        for y, value in enumerate(speedups):
            if value:
                right.annotate(f"{value:,.1f}x", (value, y), xytext=(3, 0), textcoords="offset points",
                               va="center", fontsize=8)
        fig.tight_layout()
        return self._svg(fig, "throughput and speed-up per rung")

    def curves(self, series: list[tuple[str, list[dict], str]], ylabel: str) -> str:
        """One line per (label, metrics records, key), against training time."""
        fig, ax = self.plt.subplots(figsize=(9, 3.6))
        for label, records, key in series:
            points = [(r["elapsed"], r[key]) for r in records if r.get(key) is not None]
            if points:
                ax.plot(*zip(*points), marker="o", markersize=3, label=label)
        ax.set_xlabel("training time (s)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        return self._svg(fig, f"{ylabel} against training time")

    def gpu_timeline(self, samples: list[dict], spans: list[tuple[str, float, float]]) -> str:
        fig, axes = self.plt.subplots(3, 1, figsize=(11, 6.5), sharex=True)
        for gpu in sorted({s["gpu"] for s in samples}):
            rows = [s for s in samples if s["gpu"] == gpu]
            t = [s["t"] for s in rows]
            for ax, key, label in zip(axes, ("util", "mem_used_mib", "power_w"),
                                      ("GPU busy (%)", "memory used (MiB)", "power (W)")):
                ax.plot(t, [s[key] for s in rows], linewidth=0.8, label=f"GPU {gpu}")
                ax.set_ylabel(label)
                ax.grid(alpha=0.3)
        for i, (name, start, end) in enumerate(spans):
            for ax in axes:
                ax.axvspan(start, end, color="#ffd166" if i % 2 else "#bde0fe", alpha=0.35, linewidth=0)
            axes[0].annotate(name, ((start + end) / 2, 1.02), xycoords=("data", "axes fraction"), ha="center",
                             fontsize=7, rotation=30)
        axes[0].set_ylim(0, 105)
        axes[-1].set_xlabel("seconds since start (shaded: the timed windows of each rung)")
        fig.tight_layout()
        return self._svg(fig, "GPU utilisation, memory and power over time")
