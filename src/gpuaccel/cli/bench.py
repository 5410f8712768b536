"""``gpuaccel bench`` (the ladder of optimisations), ``gpuaccel report`` and ``gpuaccel env``."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from .options import add_config_options, comma_list


def add_bench_parsers(sub) -> None:
    from ..bench.ladder import RUNG_NAMES, BenchOptions

    b = sub.add_parser(
        "bench", help="how much faster than the CPU, and why: a ladder of optimisations, measured",
        description="Train one model on one data set through a ladder of configurations, each adding one "
                    "optimisation to the one before: " + ", ".join(RUNG_NAMES) + ". For each rung: steady-state "
                    "throughput, data-wait share, peak GPU memory, MFU, speed-up over the CPU and over the "
                    "previous rung. Rungs this machine cannot run are listed as skipped, with the reason. Writes "
                    "results.json, gpu.jsonl and report.html into the run directory.",
        epilog="examples:\n"
               "  gpuaccel bench --quick                                  # LeNet-5 on the built-in digits\n"
               "  gpuaccel bench --data ~/cifar10 --model resnet18 --time-to-acc 0.9\n"
               "  gpuaccel bench --data ~/cifar10 --model resnet18 --only cpu,cuda-graphs,max-batch",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    # the settings a bench shares with training come from the training schema, with bench's defaults
    shared = ("data", "model", "batch_size", "lr", "crop_padding", "flip", "image_size", "val_split", "device",
              "workers", "run_dir")
    defaults = {f.name: f.default for f in dataclasses.fields(BenchOptions) if f.name in shared}
    add_config_options(b, names=shared, shown_defaults=defaults)
    b.add_argument("--precision", metavar="P", help="of the mixed-precision rungs: auto (default), bf16, fp16")
    b.add_argument("--only", metavar="RUNGS", type=comma_list,
                   help="comma-separated rungs to run (default all)")
    b.add_argument("--quick", action="store_true", help="shorter timing windows: a rough answer in less time")
    b.add_argument("--time-to-acc", type=float, metavar="F",
                   help="also train each GPU rung until held-out accuracy F and report the time")
    b.add_argument("--epochs", type=int, help="at most this many epochs for --time-to-acc (default 10)")
    b.add_argument("--json", action="store_true", help="print results.json on stdout")
    b.set_defaults(handler=_run_bench)

    env = sub.add_parser("env", help="this machine's hardware and software, and optionally measured GPU ceilings",
                         description="CPU, memory, every GPU (memory, compute capability, driver, clocks, power "
                                     "limit), torch/CUDA/cuDNN/NCCL versions and optional packages. --measure adds "
                                     "the GPU's measured ceilings: bf16/tf32/fp32 matrix-multiply TFLOP/s, device "
                                     "copy bandwidth and host-to-device bandwidth, pinned and pageable.")
    env.add_argument("--measure", action="store_true", help="measure the GPU's ceilings (takes seconds)")
    env.add_argument("--device", default="auto", help="the GPU to measure (default: auto)")
    env.add_argument("--json", action="store_true", help="print the report as JSON")
    env.set_defaults(handler=_run_env)
    r = sub.add_parser("report", help="write report.html (tables and charts) for a bench or training run",
                       description="Write RUN/report.html, one self-contained page with the tables and charts "
                                   "of a bench or training run (charts need matplotlib), and RUN/results.json.")
    r.add_argument("run_dir", metavar="RUN", help="a run directory of 'gpuaccel train' or 'gpuaccel bench'")
    r.set_defaults(handler=_run_report)


def _run_bench(args) -> int:
    from ..bench.ladder import BenchOptions, format_table, run_bench
    from ..bench.report import write_report

    fields = {f.name for f in dataclasses.fields(BenchOptions)} - {"command"}
    options = BenchOptions(**{k: v for k, v in vars(args).items() if k in fields and v is not None},
                           command=["gpuaccel", *sys.argv[1:]])
    log = (lambda line: None) if args.json else (lambda line: print(line, file=sys.stderr, flush=True))
    results = run_bench(options, log=log)
    page = write_report(results["run_dir"])
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        print(format_table(results))
        print(f"report: {page}")
    return 0


def _run_report(args) -> int:
    from ..bench.report import write_report

    print(write_report(args.run_dir))
    return 0


def _run_env(args) -> int:
    from ..bench.env import collect, format_report, measure_ceilings
    from ..device import resolve_device

    info = collect()
    if args.measure:
        info["ceilings"] = measure_ceilings(resolve_device(args.device))
    print(json.dumps(info, indent=2) if args.json else format_report(info))
    return 0
