"""The ``gpuaccel`` command: a thin layer over the Python API.

A :class:`GpuaccelError` becomes one line on stderr and exit status 2; Ctrl-C during
training saves a checkpoint and exits with 130; anything else is a bug and keeps
its traceback.
"""

from __future__ import annotations

import argparse
import atexit
import dataclasses
import json
import os
import sys
import threading
import warnings
from pathlib import Path


from .caches import use_bytecode_cache, use_compile_cache
from .errors import GpuaccelError, speaking_to_the_command_line

EXIT_USER_ERROR = 2
EXIT_INTERRUPTED = 130


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad option is one line (plus where to find help), exit status 2."""

    def error(self, message):
        raise GpuaccelError(f"{message} (see '{self.prog} --help')")


def _comma_list(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


def _keywords(text: str) -> dict:
    """'layers=6,width=384,activation=gelu' -> {'layers': 6, 'width': 384, 'activation': 'gelu'}
    (values read as YAML scalars: numbers, booleans, null, else strings)."""
    import yaml

    result = {}
    for item in _comma_list(text):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {item!r}")
        try:
            result[key.strip()] = yaml.safe_load(value.strip())
        except yaml.YAMLError:
            result[key.strip()] = value.strip()
    return result


def _train_parser(sub) -> None:
    p = sub.add_parser(
        "train", help="train a model (image classification from the command line; any task from Python)",
        description="Train a model on the best device present (a CUDA GPU if there is one, else the "
                    "CPU). Every option has a sensible default: 'gpuaccel train' alone trains LeNet-5 on the "
                    "built-in 8x8 digits with the digits recipe (what 'make demo' runs; with any training option the plain defaults apply instead). The run directory receives config.json, metrics.jsonl, summary.json, "
                    "checkpoint.pt (to resume) and model.pt (the trained model).",
        epilog="examples:\n"
               "  gpuaccel train                                   # LeNet-5 on the built-in digits\n"
               "  gpuaccel train --data ~/mnist --model lenet5 --epochs 5\n"
               "  gpuaccel train --data imagefolder:~/photos --val-split 0.1 --model resnet18 --image-size 64\n"
               "  gpuaccel train --data cifar10:~/cifar-10-batches-py --model resnet18 --target accuracy=0.9\n"
               "  gpuaccel train --resume runs/mnist-lenet5-20260101-120000   # continue a stopped run",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_config_options(p)
    m = p.add_argument_group("processes")
    m.add_argument("--gpus", type=int, metavar="N",
                   help="train with N processes on N GPUs of this machine (data parallel, through "
                        "torch.distributed.run); --batch-size is per process")
    m.add_argument("--max-restarts", type=int, default=0, metavar="K",
                   help="with --gpus: restart the processes up to K times after a failure; they resume from "
                        "the last checkpoint")
    s = p.add_argument_group("recipes, resuming and output")
    s.add_argument("--recipe", metavar="NAME|FILE",
                   help="start from a recipe: a shipped one (" + ", ".join(_shipped_recipes()) + ") or your own "
                        "YAML file of settings (flat, or nested by section); options given here override it")
    s.add_argument("--print-config", action="store_true",
                   help="print the resolved settings as a recipe (YAML, by section) and exit without training")
    s.add_argument("--resume", metavar="RUN", help="continue the run saved in the directory RUN from its last checkpoint")
    s.add_argument("--quiet", action="store_true", help="print only the summary")
    s.add_argument("--json", action="store_true", help="print the summary as JSON on stdout")
    p.set_defaults(handler=_run_train)


def _shipped_recipes() -> list[str]:
    from .train.recipes import list_recipes

    return list_recipes()


def _add_config_options(parser, names=None, shown_defaults: dict | None = None) -> None:
    """TrainConfig's settings (all, or those in ``names``) as options, one group per section,
    made from the schema (train/config.py): type, help, valid values and default declared
    there once. Every option defaults to None here, so that what the user typed is known."""
    import typing

    from .train.config import TrainConfig

    hints = typing.get_type_hints(TrainConfig)
    groups: dict[str, argparse._ArgumentGroup] = {}
    for f in dataclasses.fields(TrainConfig):
        meta = f.metadata
        if not meta["cli"] or (names is not None and f.name not in names):
            continue
        group = groups.get(meta["section"]) or groups.setdefault(
            meta["section"], parser.add_argument_group(meta["section"] + " settings"))
        kind = next((t for t in typing.get_args(hints[f.name]) if t is not type(None)), hints[f.name])
        default = (shown_defaults or {}).get(f.name, f.default if f.default is not dataclasses.MISSING
                                             else f.default_factory())
        text = meta["help"]
        if meta["choices"] and not all(c in text for c in meta["choices"]):
            text += f"; one of: {', '.join(meta['choices'])}"
        if default not in (None, False, "default") and "default" not in text:
            text += f" (default {default:g})" if isinstance(default, float) else f" (default {default})"
        options = dict(help=text.replace("%", "%%"), default=None)
        if kind is bool:
            options["action"] = argparse.BooleanOptionalAction
        else:
            parse = {list: _comma_list, dict: _keywords}.get(typing.get_origin(kind) or kind, kind)
            options.update(type=parse,
                           metavar=meta["metavar"] or f.name.upper())
        group.add_argument("--" + f.name.replace("_", "-"), **options)


def _section(name: str) -> str:
    from .train import TrainConfig

    return next(f.metadata["section"] for f in dataclasses.fields(TrainConfig) if f.name == name)


def _explicit_options(args: argparse.Namespace) -> dict:
    """The TrainConfig fields the user set on the command line (every option defaults to None)."""
    from .train import TrainConfig

    names = {f.name for f in dataclasses.fields(TrainConfig)}
    return {k: v for k, v in vars(args).items() if k in names and v is not None}


def _run_train(args) -> int:
    from .parallel import Distributed

    code = _train(args)
    if Distributed.from_env().active:
        # One of torchrun's processes ends here without finalising the interpreter: gloo's
        # threads may still hold the last collectives' tensors, and releasing one then takes
        # the GIL of a dying interpreter ("terminate called without an active exception",
        # SIGABRT: torchrun reports the finished run as failed; about 1 in 40 sharded resumes
        # on two busy cores; pytorch/pytorch#179291). Files are closed by now.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _train(args) -> int:
    import torch

    from .train import TrainConfig, Trainer
    from .train.recipes import load_recipe

    options = _explicit_options(args)
    if args.gpus is not None and "RANK" not in os.environ:  # the launcher, not yet one of its processes
        from .parallel.launch import launch

        return launch(args.argv, args.gpus, args.max_restarts, options.get("run_dir"), options.get("model", "run"),
                      pipeline_stages=options.get("pipeline_stages") or 1)
    from .parallel import Distributed

    restarted = Distributed.from_env().restart > 0
    if restarted and not args.resume and options.get("run_dir") and (Path(options["run_dir"]) / "checkpoint.pt").exists():
        args.resume = options.pop("run_dir")  # the elastic launcher restarted the group: continue the run
        args.recipe = None
    if args.resume and args.recipe:
        raise GpuaccelError("--resume continues a run with its own settings; drop --recipe")
    if not args.resume and not args.recipe and all(_section(k) == "logging" for k in options):
        # `gpuaccel train` alone is the demo: the built-in data set with its own recipe. Any training
        # setting given means the user chose: then the plain defaults apply, with no recipe underneath
        args.recipe = "digits"
    if args.recipe:
        options = {**load_recipe(args.recipe), **options}
    if args.print_config:
        return _print_config(args.resume, options)
    if args.resume:
        trainer = Trainer.resume(args.resume, overrides=options, quiet=args.quiet or args.json)
    else:
        trainer = Trainer(TrainConfig(**options), quiet=args.quiet or args.json)
    try:
        summary = trainer.fit()
        trainer.dist.barrier()  # no rank tears the process group down while another still uses it
    except torch.OutOfMemoryError as exc:
        detail = str(exc).split(". ")[0]
        raise GpuaccelError(f"out of GPU memory ({detail}); try a smaller --batch-size, --activation-checkpointing, "
                            f"--shard (with several GPUs) or --shard --offload cpu") from None
    except KeyboardInterrupt:
        print(f"gpuaccel: interrupted; checkpoint saved. Continue with: gpuaccel train --resume {trainer.run_dir}",
              file=sys.stderr)
        return EXIT_INTERRUPTED
    finally:
        Distributed.from_env().close()
    if not Distributed.from_env().is_main:
        return 0  # one summary per run, from rank 0
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        _print_summary(summary)
    return 0


def _print_config(resume: str | None, options: dict) -> int:
    """The settings a train command would use, as a recipe nested by section."""
    import yaml

    from .train import TrainConfig

    if resume:
        saved = Path(resume) / "config.json"
        if not saved.is_file():
            raise GpuaccelError(f"{resume} holds no config.json")
        config = TrainConfig.from_dict(json.loads(saved.read_text())).replace(**options)
    else:
        config = TrainConfig(**options)
    print(yaml.safe_dump(config.validate().to_sections(), sort_keys=False, default_flow_style=False), end="")
    return 0


def _metric_text(name: str, value) -> str:
    if value is None:
        return "n/a"
    return f"{100 * value:.2f}%" if name == "accuracy" else f"{value:.4g}"


def _print_summary(s: dict) -> None:
    unit = s.get("sample_unit") or ("images" if "images_per_second" in s else "samples")
    rows = [
        ("device", f"{s['device_name']} [{s['device']}]"),
        ("precision", s["precision"] + (", channels_last" if s["channels_last"] else "") +
         (", compiled" if s["compile"] else "")),
        ("model", f"{s['model']} ({s['parameters']:,} parameters)"),
        ("task", s["task"]),
        ("data", f"{s['data']}: {s['train_samples']} train / {s['test_samples']} test {unit}" +
         (f", {s['skipped_samples']} bad skipped" if s["skipped_samples"] else "")),
        ("epochs", f"{s['epochs']:g} ({s['steps']} steps, stopped by {s['stopped_by']})"),
        ("time", f"training {s['train_seconds']:.2f} s" + (" (all segments of the run)" if s["restarts"] or
                                                             s.get("resumed") else "") +
         f"; this process: set-up {s['setup_seconds']:.2f} s, warm-up {s['warmup_seconds']:.2f} s, "
         f"loop {s['wall_seconds']:.2f} s (training, evaluation, saving)"),
        ("phases", ", ".join(f"{name} {seconds:.2f} s" for name, seconds in s.get("phases", {}).items())),
        ("throughput", f"{s['samples_per_second']:,.0f} {unit}/s" +
         (f" ({s['tokens_per_second']:,.0f} tokens/s)" if s.get("tokens_per_second") else "")),
    ]
    for name, value in s["metrics"].items():
        if name != "loss" or len(s["metrics"]) == 1 or s.get("main_metric") == "loss":
            best = s["best_metrics"].get(name)
            rows.append((f"test {name}", _metric_text(name, value) +
                         (f" (best {_metric_text(name, best)})" if best is not None else "")))
    if not s["metrics"]:
        rows.append(("test metrics", "n/a (no evaluation finished)"))
    if s["target"] is not None:
        reached = "not reached" if s["time_to_target"] is None else f"reached in {s['time_to_target']:.2f} s"
        rows.append(("time to target", f"{s['target']} {reached}"))
    rows.append(("saved to", s["run_dir"]))
    width = max(len(k) for k, _ in rows)
    print("\n".join(f"{k:<{width}}  {v}" for k, v in rows))


def _run_models(args) -> int:
    from .models import list_models

    print("\n".join(list_models() + ["package.module:factory  (your own)", "timm:<name>  (needs timm)"]))
    return 0


def _deploy_parsers(sub) -> None:
    e = sub.add_parser("export", help="export a trained model (ONNX, torch.export, TorchScript) and verify it",
                       description="Export a trained model and verify the export: the original and the exported "
                                   "model run on real held-out images of the run's data set; the command fails "
                                   "(exit 1) if their top-1 predictions agree on fewer than 99.9% of them. The "
                                   "exported model takes float32 images in [0, 1] (normalisation is inside it); "
                                   "class names and input shape are written to <artefact>.json beside it. A text "
                                   "classifier exports as onnx or pt2 (token ids in, any batch and length), its "
                                   "tokeniser in the .json, verified on held-out sentences.")
    e.add_argument("checkpoint", metavar="RUN", help="a run directory, or its model.pt / checkpoint.pt")
    e.add_argument("--format", default="onnx", help="onnx (default), pt2 (torch.export) or torchscript")
    e.add_argument("--out", metavar="PATH", help="where to write (default: next to the checkpoint)")
    e.add_argument("--static-batch", type=int, metavar="N",
                   help="fix the batch size at N, for runtimes that need static shapes (default: any batch size)")
    e.add_argument("--dynamic-batch", action="store_true", help=argparse.SUPPRESS)  # the default; kept for scripts
    e.add_argument("--opset", type=int, metavar="N", help="ONNX opset version (default: the exporter's)")
    e.add_argument("--data", metavar="SPEC", help="verify on this data set's held-out split (default: the run's)")
    e.add_argument("--verify-images", type=int, default=1000, metavar="N", help="held-out images (sentences, recordings) to compare (1000)")
    e.add_argument("--json", action="store_true", help="print the verification as JSON")
    e.set_defaults(handler=_run_export)

    i = sub.add_parser("infer", help="predict classes for images (sentences, recordings) with a trained or exported "
                                     "model",
                       description="Predict classes for image files, a folder of images, or a data set's held-out "
                                   "split, with a checkpoint (PyTorch), an .onnx file (ONNX Runtime), a .pt2 or a "
                                   ".ts file; or, with a run of a text classifier, for text files (a sentence per "
                                   "line) or a labelled .tsv/.csv/.jsonl (scored); with a run of an audio classifier, for WAV files "
                                   "and folders of them. Writes CSV (input, class_1, "
                                   "prob_1, ...) and prints latency statistics.")
    i.add_argument("model", metavar="MODEL", help="run directory, model.pt, .onnx, .pt2 or .ts")
    i.add_argument("inputs", nargs="+", metavar="INPUTS",
                   help="image files, a folder of images, or a data set spec; for a text classifier, text files or "
                        "a labelled sentences file or folder; for an audio classifier, WAV files or folders")
    i.add_argument("--device", default="auto",
                   help="auto (default: a CUDA GPU when there is one and the model's runtime can use it), cpu, "
                        "cuda or cuda:N")
    i.add_argument("--batch-size", "--batch", type=int, default=256, help="images per batch (default 256)")
    i.add_argument("--top-k", type=int, default=1, metavar="K", help="classes per image in the CSV (default 1)")
    i.add_argument("--out", metavar="CSV", help="write predictions here (default: standard output)")
    i.add_argument("--threads", type=int, metavar="N", help="CPU threads (default: every core)")
    i.add_argument("--runtime", default="onnxruntime",
                   help="what runs .onnx files: onnxruntime (default) or openvino (CPU only; needs gpuaccel[openvino])")
    i.set_defaults(handler=_run_infer)

    g = sub.add_parser("generate", help="sample text from a trained language model",
                       description="Continue a prompt with a language model trained by 'gpuaccel train' on text "
                                   "(a key/value cache makes each new token one position's work); prints the "
                                   "text, and the speed in tokens per second on standard error.")
    g.add_argument("run", metavar="RUN", help="a run directory, or its model.pt / checkpoint.pt")
    g.add_argument("--prompt", default="\n", metavar="TEXT", help="the text to continue (default: a new line)")
    g.add_argument("--tokens", type=int, default=500, metavar="N", help="tokens to generate (default 500)")
    g.add_argument("--temperature", type=float, default=0.8, metavar="T",
                   help="sampling temperature; 0 takes the most likely token (default 0.8)")
    g.add_argument("--top-k", type=int, default=200, metavar="K",
                   help="sample among the K most likely tokens (default 200; 0: all)")
    g.add_argument("--samples", type=int, default=1, metavar="S", help="independent continuations (default 1)")
    g.add_argument("--seed", type=int, default=0, help="seeds the sampling (default 0)")
    g.add_argument("--device", default="auto", help="auto (default), cpu, cuda or cuda:N")
    g.add_argument("--no-cache", action="store_true",
                   help="recompute the whole context for every token (for comparison; slower)")
    g.add_argument("--json", action="store_true", help="print the texts and the speed as JSON")
    g.set_defaults(handler=_run_generate)

    r = sub.add_parser("recommend", help="the items a trained rating model predicts a user will rate highest",
                       description="Score every item the user has not rated in the run's training data with a "
                                   "model trained by 'gpuaccel train' on ratings; print the best, with titles "
                                   "where the data has them (MovieLens' u.item, movies.dat or movies.csv).")
    r.add_argument("run", metavar="RUN", help="a run directory, or its model.pt / checkpoint.pt")
    r.add_argument("--user", required=True, help="the user's id, as in the ratings file")
    r.add_argument("--top", type=int, default=10, metavar="K", help="how many items (default 10)")
    r.add_argument("--include-rated", action="store_true", help="also rank the items the user rated in training")
    r.add_argument("--device", default="auto", help="auto (default), cpu, cuda or cuda:N")
    r.add_argument("--json", action="store_true", help="print the list as JSON")
    r.set_defaults(handler=_run_recommend)

    q = sub.add_parser("quantize", help="int8 (calibrated, ONNX Runtime) or fp16 ONNX models, with a report",
                       description="Quantise a trained model (a checkpoint, or an .onnx made by 'gpuaccel export'): "
                                   "--int8 with ONNX Runtime's static quantisation, calibrated on N real training "
                                   "images, or --fp16 for GPU runtimes; reports size, held-out accuracy and "
                                   "latency before and after (on the GPU for --fp16 where onnxruntime-gpu can use one).")
    q.add_argument("model", metavar="RUN|MODEL.onnx", help="a run directory (or its model.pt), or an .onnx file "
                                                           "made by 'gpuaccel export'")
    q.add_argument("--int8", action="store_true", help="weights int8, activations uint8 (QDQ), for CPUs")
    q.add_argument("--fp16", action="store_true",
                   help="weights and compute in fp16, inputs and outputs float32, for GPU runtimes")
    q.add_argument("--calib", type=int, default=512, metavar="N", help="calibration images (default 512)")
    q.add_argument("--per-channel", action="store_true", help="one weight scale per output channel")
    q.add_argument("--data", metavar="SPEC", help="the data set (default: the run's)")
    q.add_argument("--out", metavar="PATH", help="default: model.int8.onnx or model.fp16.onnx beside the checkpoint")
    q.add_argument("--device", metavar="DEV", help="where to evaluate and time the models: cpu or cuda[:N] (default: "
                                                   "cuda for --fp16 where onnxruntime-gpu and a GPU are present, else cpu)")
    q.add_argument("--runtime", default="onnxruntime",
                   help="what evaluates and times the models: onnxruntime (default) or openvino (CPU only)")
    q.add_argument("--json", action="store_true", help="print the report as JSON")
    q.set_defaults(handler=_run_quantize)

    p = sub.add_parser("prune", help="prune a trained model (weights or whole channels), fine-tune, report",
                       description="Prune a trained model: --structured removes whole channels with torch-pruning "
                                   "(the model gets smaller and faster), otherwise the smallest weights are zeroed. "
                                   "Optionally fine-tunes with the training engine on the run's data. Writes a run "
                                   "directory (model.pt, prune.json) usable by export, quantize, infer; reports "
                                   "parameters, FLOPs, file size, held-out accuracy and CPU latency before and after.")
    p.add_argument("checkpoint", metavar="RUN", help="a run directory, or its model.pt / checkpoint.pt")
    p.add_argument("--sparsity", type=float, default=0.5,
                   help="share of weights (or, with --structured, of each layer's channels) to remove (default 0.5)")
    p.add_argument("--structured", action="store_true", help="remove whole channels (needs torch-pruning)")
    p.add_argument("--finetune-epochs", type=int, default=0, metavar="E", help="train E epochs after pruning")
    p.add_argument("--lr", type=float, help="fine-tuning peak learning rate (default: half the run's)")
    p.add_argument("--data", metavar="SPEC", help="the data set (default: the run's)")
    p.add_argument("--out", metavar="DIR", help="default: pruned-<method>-<sparsity>/ beside the checkpoint")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(handler=_run_prune)

    b = sub.add_parser("bench-infer", help="inference latency and throughput on every backend available",
                       description="Batch-1 latency (p50/p90/p99) and best-batch throughput of a trained model: "
                                   "PyTorch eager on the CPU, ONNX Runtime (and, where installed, OpenVINO) fp32 and "
                                   "int8 on the CPU, and on a GPU "
                                   "PyTorch fp32, bf16 and bf16 compiled with CUDA graphs, and (with onnxruntime-gpu) "
                                   "ONNX Runtime fp32, fp16 and fp16 with CUDA graphs.")
    b.add_argument("model", metavar="RUN", help="a run directory, or its model.pt / checkpoint.pt")
    b.add_argument("--data", metavar="SPEC", help="calibration data for the int8 row (default: the run's)")
    b.add_argument("--repeats", type=int, default=200, help="timed batch-1 calls (default 200)")
    b.add_argument("--threads", type=int, metavar="N",
                   help="CPU threads of the CPU backends (default: every core); small models at batch 1 are "
                        "often fastest on a few")
    b.add_argument("--json", action="store_true", help="print the results as JSON")
    b.set_defaults(handler=_run_bench_infer)


def _run_quantize(args) -> int:
    import tempfile

    from .deploy.artifact import load_trained
    from .deploy.export import export
    from .deploy.quantize import calibration_sample, compare, convert_fp16, evaluation_device, quantize_int8
    from .deploy.runners import check_runtime, load_runner, metadata_path

    if args.int8 == args.fp16:
        raise GpuaccelError("say what to quantise to: --int8 (CPU) or --fp16 (GPU runtimes), one of them")
    kind = "int8" if args.int8 else "fp16"
    check_runtime(args.runtime)
    source = Path(args.model)
    tmp = tempfile.TemporaryDirectory()
    if source.suffix == ".onnx":
        if not source.exists():
            raise GpuaccelError(f"model file {source} does not exist")
        meta = json.loads(metadata_path(source).read_text()) if metadata_path(source).exists() else {}
        if "source" not in meta:
            raise GpuaccelError(f"{source} has no {metadata_path(source).name} naming its checkpoint; "
                                f"export it with 'gpuaccel export'")
        load_runner(source)  # a corrupt file fails here, with a clear message
        trained = load_trained(meta["source"])
    else:
        trained = load_trained(source)
    # the data first: a run without calibration data stops before any work is done
    data = trained.load_data(args.data, "no data to calibrate and evaluate with")
    fp32 = source if source.suffix == ".onnx" else export(trained, "onnx", Path(tmp.name) / "model.onnx",
                                                          dynamic_batch=True)
    out = Path(args.out) if args.out else trained.source.with_name(f"model.{kind}.onnx")
    extra = {}
    if kind == "int8":
        calibration = calibration_sample(data.train_images, args.calib)
        quantize_int8(fp32, out, calibration, per_channel=args.per_channel)
        extra = {"calibration_images": len(calibration), "per_channel": args.per_channel}
    else:
        convert_fp16(fp32, out)
    metadata_path(out).write_text(json.dumps({**json.loads(metadata_path(fp32).read_text()),
                                              "format": f"onnx-{kind}", **extra}, indent=2) + "\n")
    device = evaluation_device(kind, args.device, args.runtime)
    report = {"artifact": str(out), "device": device, "runtime": args.runtime, **extra,
              **compare({"fp32": fp32, kind: out}, data.test_images, data.test_labels, device, args.runtime)}
    tmp.cleanup()
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for name in ("fp32", kind):
            r = report[name]
            print(f"{name}: {r['size_bytes'] / 1e6:.2f} MB, test accuracy {100 * r['test_accuracy']:.2f}%, "
                  f"batch-1 latency in {args.runtime} on {device} {r['latency_p50_ms']:.3f} ms, "
                  f"{r['best_images_per_second']:,.0f} images/s")
        if kind == "fp16" and device == "cpu":
            print("fp16 is for GPU runtimes (onnxruntime-gpu, TensorRT); ONNX Runtime's CPU kernels are fp32 at heart")
        print(f"saved {out}")
    return 0


def _run_prune(args) -> int:
    from .deploy.artifact import load_trained
    from .deploy.prune import prune_trained

    trained = load_trained(args.checkpoint)
    data = trained.load_data(args.data, "no data to evaluate and fine-tune the pruned model with")
    report = prune_trained(trained, data, sparsity=args.sparsity, structured=args.structured,
                           finetune_epochs=args.finetune_epochs, lr=args.lr, out_dir=args.out, quiet=args.json)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    for name in ("before", "after"):
        r = report[name]
        print(f"{name:6s}: {r['parameters']:,} parameters ({r['nonzero_parameters']:,} non-zero), "
              f"{r['flops_per_image'] / 1e6:,.1f} MFLOP/image, {r['file_bytes'] / 1e6:.2f} MB, "
              f"test accuracy {100 * r['test_accuracy']:.2f}%, CPU batch-1 {r['latency_p50_ms']:.3f} ms, "
              f"{r['best_images_per_second']:,.0f} images/s")
    print(f"{report['method']} pruning at {report['sparsity']:g}: accuracy {100 * report['pruned_accuracy']:.2f}% "
          f"before fine-tuning; CPU batch-1 speed {report['speedup_batch1']:.2f}x the original "
          f"({report['speedup_batch1_min']:.2f}-{report['speedup_batch1_max']:.2f} over "
          f"{report['speedup_batch1_rounds']} alternating rounds), throughput {report['speedup_throughput']:.2f}x; "
          f"saved {report['out']}")
    return 0


def _run_bench_infer(args) -> int:
    from .deploy.artifact import load_trained
    from .deploy.bench import bench_inference
    from .deploy.quantize import calibration_sample

    trained = load_trained(args.model)
    calibration = None
    try:
        calibration = calibration_sample(trained.load_data(args.data, "no calibration data").train_images, 256)
    except GpuaccelError as exc:
        print(f"gpuaccel: note: no int8 row ({exc})", file=sys.stderr)
    if args.threads is not None and args.threads < 1:
        raise GpuaccelError("--threads must be at least 1")
    result = bench_inference(trained, calibration, repeats=args.repeats, threads=args.threads)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"{trained.model_name}, {trained.image_size} px; CPU {result['cpu']} ({result['cpu_threads']} threads)"
          + (f"; GPU {result['gpu']}" if result["gpu"] else ""))
    width = max(len(r["backend"]) for r in result["rows"])
    print(f"{'backend':{width}s} {'p50 ms':>8s} {'p90 ms':>8s} {'p99 ms':>8s} {'best img/s':>12s}")
    for r in result["rows"]:
        if "error" in r:
            print(f"{r['backend']:{width}s} failed: {r['error']}")
        else:
            print(f"{r['backend']:{width}s} {r['latency_p50_ms']:8.3f} {r['latency_p90_ms']:8.3f} "
                  f"{r['latency_p99_ms']:8.3f} {r['best_images_per_second']:12,.0f}")
    return 0


def _run_export(args) -> int:

    from .deploy.artifact import load_trained, run_kind
    from .deploy.export import FORMAT_SUFFIX, FORMATS, export, verify
    from .errors import choice_error

    kind = run_kind(args.checkpoint)
    if kind == "text":
        from .deploy.text import export_text_classifier

        report = export_text_classifier(args.checkpoint, args.format, args.out, data=args.data,
                                        verify_sentences=args.verify_images, opset=args.opset)
        return _export_report(args, report, "held-out sentences", report["sentences"])
    if kind == "audio":
        from .deploy.audio import export_audio_classifier

        report = export_audio_classifier(args.checkpoint, args.format, args.out, data=args.data,
                                         verify_recordings=args.verify_images, opset=args.opset)
        return _export_report(args, report, "held-out recordings", report["recordings"])
    if args.format not in FORMATS:
        raise choice_error("export format", args.format, FORMATS)
    trained = load_trained(args.checkpoint)
    out = Path(args.out) if args.out else trained.source.with_name(f"model{FORMAT_SUFFIX[args.format]}")
    data = trained.load_data(args.data, "cannot load held-out images to verify the export")
    static = args.static_batch is not None
    if static and args.dynamic_batch:
        raise GpuaccelError("--static-batch and --dynamic-batch disagree; give one")
    path = export(trained, args.format, out, dynamic_batch=not static, static_batch=args.static_batch or 2,
                  opset=args.opset)
    report = verify(trained, path, data.test_images[: args.verify_images], dynamic_batch=not static,
                    static_batch=args.static_batch or 2)
    report.update(artifact=str(path), format=args.format, size_bytes=path.stat().st_size)
    return _export_report(args, report, "held-out images", report["images"])


def _export_report(args, report: dict, what: str, count: int) -> int:
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"exported {report['artifact']} ({report['size_bytes'] / 1e6:.2f} MB); on {count} {what}: "
              f"top-1 agreement {100 * report['top1_agreement']:.2f}%, max |diff| {report['max_abs_diff']:.2e}, "
              f"mean |diff| {report['mean_abs_diff']:.2e}")
    if not report["passed"]:
        print("gpuaccel: export verification FAILED: top-1 agreement under 99.9%", file=sys.stderr)
        return 1
    return 0


def _run_generate(args) -> int:
    from .deploy.text import generate

    result = generate(args.run, args.prompt, args.tokens, temperature=args.temperature, top_k=args.top_k or None,
                      samples=args.samples, device=args.device, seed=args.seed, use_cache=not args.no_cache)
    speed = (f"{result.new_tokens} tokens x {len(result.texts)} sample(s) in {result.seconds:.2f} s on "
             f"{result.device}: {result.tokens_per_second:,.0f} tokens/s")
    if args.json:
        print(json.dumps({"texts": result.texts, "new_tokens": result.new_tokens, "seconds": round(result.seconds, 4),
                          "tokens_per_second": round(result.tokens_per_second, 1), "device": result.device}))
    else:
        print("\n---\n".join(result.texts))
        print(f"gpuaccel: {speed}", file=sys.stderr)
    return 0


def _run_recommend(args) -> int:
    from dataclasses import asdict

    from .deploy.recommend import recommend

    items = recommend(args.run, args.user, args.top, device=args.device, include_rated=args.include_rated)
    if args.json:
        print(json.dumps([asdict(i) for i in items], indent=1))
    else:
        for rank, item in enumerate(items, 1):
            print(f"{rank:3d}. {item.title or item.item}  (item {item.item}, score {item.score:.2f})")
    return 0


def _run_infer(args) -> int:
    from .deploy.infer import fit_to_model, gather_inputs, predict, predictions_csv, top1_accuracy
    from .deploy.artifact import run_kind
    from .deploy.runners import load_runner

    if args.batch_size < 1 or args.top_k < 1:
        raise GpuaccelError("--batch-size and --top-k must be at least 1")
    kind = run_kind(args.model)
    if kind == "text":
        return _infer_sentences(args)
    if kind == "audio":
        return _infer_recordings(args)
    if args.threads is not None:
        import torch

        if args.threads < 1:
            raise GpuaccelError("--threads must be at least 1")
        torch.set_num_threads(args.threads)
    if args.device == "auto":
        from .deploy.runners import onnx_has_cuda
        from .device import resolve_device

        gpu = resolve_device("auto").type == "cuda"
        usable = not str(args.model).endswith(".onnx") or (args.runtime == "onnxruntime" and onnx_has_cuda())
        args.device = "cuda" if gpu and usable else "cpu"
    runner = load_runner(args.model, args.device, threads=args.threads, runtime=args.runtime)
    names, images, labels = gather_inputs(args.inputs)
    images = fit_to_model(images, runner.in_channels, runner.image_size)
    probs, stats = predict(runner, images, args.batch_size)
    # a file name that is not valid UTF-8 is written with its odd bytes escaped (\udcXX), not refused
    _write_predictions(args.out, predictions_csv(names, probs, runner.classes, args.top_k))
    line = (f"{len(names)} images with {runner.kind} on {args.device}: {stats['images_per_second']:,.0f} images/s, "
            f"batch latency median {stats['latency_median_ms']:.2f} ms, p90 {stats['latency_p90_ms']:.2f} ms")
    if labels is not None:
        line += f"; accuracy {100 * top1_accuracy(probs, labels):.2f}%"
    print(line, file=sys.stderr)
    return 0


def _write_predictions(out: str | None, text: str) -> None:
    """The CSV to ``out`` (a new file replaces the old one only once it is whole) or standard
    output; a name that is not valid UTF-8 is written with its odd bytes escaped (\\udcXX)."""
    text = text.encode("utf-8", "backslashreplace").decode()
    if out:
        from .files import atomic_write

        atomic_write(out, lambda f: f.write(text.encode()))
    else:
        sys.stdout.write(text)


def _infer_sentences(args) -> int:
    """``gpuaccel infer`` with a text classifier: one sentence per line of each file, or a
    labelled file or folder scored against its labels."""
    from .deploy.infer import predictions_csv
    from .deploy.text import classify_sentences

    result = classify_sentences(args.model, args.inputs, device=args.device, batch_size=args.batch_size)
    _write_predictions(args.out, predictions_csv(result.texts, result.probabilities, result.classes, args.top_k))
    line = (f"{len(result.texts)} sentences on {result.device}: "
            f"{len(result.texts) / max(result.seconds, 1e-9):,.0f} sentences/s")
    if result.accuracy is not None:
        line += f"; accuracy {100 * result.accuracy:.2f}%"
    print(line, file=sys.stderr)
    return 0


def _infer_recordings(args) -> int:
    """``gpuaccel infer`` with an audio classifier: WAV files and folders of them."""
    from .deploy.audio import classify_recordings
    from .deploy.infer import predictions_csv

    result = classify_recordings(args.model, args.inputs, device=args.device, batch_size=args.batch_size)
    _write_predictions(args.out, predictions_csv(result.names, result.probabilities, result.classes, args.top_k))
    for note in result.notes[:5]:
        print(f"gpuaccel: {note}", file=sys.stderr)
    print(f"{len(result.names)} recordings on {result.device}: "
          f"{len(result.names) / max(result.seconds, 1e-9):,.0f} recordings/s", file=sys.stderr)
    return 0


def _run_env(args) -> int:
    from .bench.env import collect, format_report, measure_ceilings
    from .device import resolve_device

    info = collect()
    if args.measure:
        info["ceilings"] = measure_ceilings(resolve_device(args.device))
    print(json.dumps(info, indent=2) if args.json else format_report(info))
    return 0


def _bench_parsers(sub) -> None:
    from .bench.ladder import RUNG_NAMES, BenchOptions

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
    _add_config_options(b, names=shared, shown_defaults=defaults)
    b.add_argument("--precision", metavar="P", help="of the mixed-precision rungs: auto (default), bf16, fp16")
    b.add_argument("--only", metavar="RUNGS", type=_comma_list,
                   help="comma-separated rungs to run (default all)")
    b.add_argument("--quick", action="store_true", help="shorter timing windows: a rough answer in less time")
    b.add_argument("--time-to-acc", type=float, metavar="F",
                   help="also train each GPU rung until held-out accuracy F and report the time")
    b.add_argument("--epochs", type=int, help="at most this many epochs for --time-to-acc (default 10)")
    b.add_argument("--json", action="store_true", help="print results.json on stdout")
    b.set_defaults(handler=_run_bench)

    r = sub.add_parser("report", help="write report.html (tables and charts) for a bench or training run",
                       description="Write RUN/report.html, one self-contained page with the tables and charts "
                                   "of a bench or training run (charts need matplotlib), and RUN/results.json.")
    r.add_argument("run_dir", metavar="RUN", help="a run directory of 'gpuaccel train' or 'gpuaccel bench'")
    r.set_defaults(handler=_run_report)


def _run_bench(args) -> int:
    from .bench.ladder import BenchOptions, format_table, run_bench
    from .bench.report import write_report

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
    from .bench.report import write_report

    print(write_report(args.run_dir))
    return 0


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = _Parser(prog="gpuaccel", description="Fast deep-learning training and inference on NVIDIA GPUs; "
                                                  "the same code runs on a CPU.")
    parser.add_argument("--version", action="version", version=f"gpuaccel {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    _train_parser(sub)
    sub.add_parser("models", help="list the model names create_model accepts").set_defaults(handler=_run_models)
    _deploy_parsers(sub)
    _bench_parsers(sub)
    env = sub.add_parser("env", help="this machine's hardware and software, and optionally measured GPU ceilings",
                         description="CPU, memory, every GPU (memory, compute capability, driver, clocks, power "
                                     "limit), torch/CUDA/cuDNN/NCCL versions and optional packages. --measure adds "
                                     "the GPU's measured ceilings: bf16/tf32/fp32 matrix-multiply TFLOP/s, device "
                                     "copy bandwidth and host-to-device bandwidth, pinned and pageable.")
    env.add_argument("--measure", action="store_true", help="measure the GPU's ceilings (takes seconds)")
    env.add_argument("--device", default="auto", help="the GPU to measure (default: auto)")
    env.add_argument("--json", action="store_true", help="print the report as JSON")
    env.set_defaults(handler=_run_env)
    return parser


def _format_warning(message, category, filename, lineno, line=None):
    return f"gpuaccel: warning: {message}\n"


def set_up_process() -> None:
    """What the command does first, before torch is imported: its caches (caches.py), for itself
    and its child processes. Importing gpuaccel as a library does none of it."""
    use_bytecode_cache()
    use_compile_cache()


def run() -> None:
    """The ``gpuaccel`` command (and ``python -m gpuaccel``): :func:`main`, then the process ends
    as the interpreter would end it, less the interpreter's own finalisation.

    Why: after a run on a GPU, finalising the interpreter (tearing down every module and the
    CUDA state it holds) took 1.1-1.7 s of a 12 s ``gpuaccel train --recipe cifar10-fast`` on an
    H200, and did nothing a user sees: every file gpuaccel writes is closed by then. The exit
    does what CPython's does before that finalisation, in its order: :func:`_end_threads`, then
    the exit handlers (compile workers, loader processes and logging are shut down there)."""
    set_up_process()
    code = main()
    _end_threads()
    atexit._run_exitfuncs()  # (CPython's own exit path calls the same, after the threads end)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _end_threads() -> None:
    """What the interpreter does first at exit (``threading._shutdown``): the threading module's
    exit hooks, then a wait for every non-daemon thread. The hooks matter: a thread pool's
    workers (``concurrent.futures``, which a cold torch.compile starts) wait for work until
    the pool's hook tells them to stop; joining them without it never returned."""
    shutdown = getattr(threading, "_shutdown", None)
    if shutdown is not None:
        shutdown()
        return
    for thread in threading.enumerate():  # (an interpreter without the hook: join what is left)
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()


def main(argv=None) -> int:
    warnings.formatwarning = _format_warning
    speaking_to_the_command_line(True)
    try:
        argv = list(sys.argv[1:] if argv is None else argv)
        args = build_parser().parse_args(argv)
        args.argv = argv[1:]  # after the command name: what a launcher passes on
        if not getattr(args, "handler", None):
            build_parser().print_help()
            return EXIT_USER_ERROR
        return args.handler(args)
    except GpuaccelError as exc:
        print(f"gpuaccel: error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print("gpuaccel: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    finally:
        speaking_to_the_command_line(False)  # (main may be called from Python, e.g. by tests)
