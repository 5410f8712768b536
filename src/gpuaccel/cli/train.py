"""``gpuaccel train`` (and ``gpuaccel models``): options from the training schema, the run, its
summary printed. What settings a command means (recipes, the demo, an elastic restart) is the
training API's (train/recipes.py, train/resume.py)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from ..errors import GpuaccelError
from .options import add_config_options, explicit_options

EXIT_INTERRUPTED = 130


def add_train_parser(sub) -> None:
    p = sub.add_parser(
        "train", help="train a model on images, text, sentence pairs, recordings, ratings, or detection and "
                      "segmentation scenes (any data and task from Python)",
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
    add_config_options(p)
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
    sub.add_parser("models", help="list the model names create_model accepts").set_defaults(handler=_run_models)


def _shipped_recipes() -> list[str]:
    from ..train.recipes import list_recipes

    return list_recipes()


def _run_train(args) -> int:
    from ..parallel import Distributed

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

    from ..parallel import Distributed
    from ..train import TrainConfig, Trainer
    from ..train.recipes import compile_where_it_pays, training_settings
    from ..train.resume import run_to_continue

    options = explicit_options(args)
    if args.gpus is not None and "RANK" not in os.environ:  # the launcher, not yet one of its processes
        from ..parallel.launch import launch

        return launch(args.argv, args.gpus, args.max_restarts, options.get("run_dir"), options.get("model", "run"),
                      pipeline_stages=options.get("pipeline_stages") or 1)
    resume = run_to_continue(args.resume, options.get("run_dir"))  # (after an elastic restart: the run so far)
    if resume and not args.resume:
        options.pop("run_dir")
        args.recipe = None
    explicit = dict(options)
    options = training_settings(options, args.recipe, resume)
    gpu = options.get("device", "auto") != "cpu" and torch.cuda.is_available()
    note = None if resume else compile_where_it_pays(options, explicit, args.recipe, gpu)
    if note and not (args.quiet or args.json):
        print(f"gpuaccel: note: {note}", file=sys.stderr)
    if args.print_config:
        return _print_config(resume, options)
    if resume:
        trainer = Trainer.resume(resume, overrides=options, quiet=args.quiet or args.json)
    else:
        trainer = Trainer(TrainConfig(**options), quiet=args.quiet or args.json)
    finished = False
    try:
        summary = trainer.fit()
        trainer.dist.barrier()  # no rank tears the process group down while another still uses it
        finished = True
    except torch.OutOfMemoryError as exc:
        detail = str(exc).split(". ")[0]
        raise GpuaccelError(f"out of GPU memory ({detail}); try a smaller --batch-size, --activation-checkpointing, "
                            f"--shard (with several GPUs) or --shard --offload cpu") from None
    except KeyboardInterrupt:
        print(f"gpuaccel: interrupted; checkpoint saved. Continue with: gpuaccel train --resume {trainer.run_dir}",
              file=sys.stderr)
        return EXIT_INTERRUPTED
    finally:
        # a rank that failed leaves the others inside a collective: tearing the group down would
        # wait for them (NCCL) before its error is printed; its exit makes the launcher stop them
        if finished:
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

    from ..train import TrainConfig

    if resume:
        saved = Path(resume) / "config.json"
        if not saved.is_file():
            raise GpuaccelError(f"{resume} holds no config.json")
        config = TrainConfig.from_dict(json.loads(saved.read_text())).replace(**options)
    else:
        config = TrainConfig(**options)
    print(yaml.safe_dump(config.validate().to_dict(), sort_keys=False, default_flow_style=False), end="")
    return 0


def _metric_text(name: str, value) -> str:
    if value is None:
        return "n/a"
    return f"{100 * value:.2f}%" if name == "accuracy" else f"{value:.4g}"


def _seconds_each(parts: dict) -> str:
    return ", ".join(f"{name} {seconds:.2f} s" for name, seconds in parts.items())


def _print_summary(s: dict) -> None:
    unit = s.get("sample_unit") or "samples"
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
        ("phases", _seconds_each(s.get("phases", {}))),
        *([("warm-up", _seconds_each(s["warmup_phases"]))] if s.get("warmup_phases") else []),
        ("throughput", f"{s['samples_per_second']:,.0f} {unit}/s" +
         (f" ({s['tokens_per_second']:,.0f} tokens/s)" if s.get("tokens_per_second") else "")),
    ]
    for name, value in s["metrics"].items():
        if name != "loss" or len(s["metrics"]) == 1 or s.get("main_metric") == "loss":
            best = s["best_metrics"].get(name)
            signature = (s.get("metric_signatures") or {}).get(name)  # (sacreBLEU's: which BLEU this is)
            rows.append((f"test {name}", _metric_text(name, value) +
                         (f" (best {_metric_text(name, best)})" if best is not None else "") +
                         (f"  {signature}" if signature else "")))
    if not s["metrics"]:
        rows.append(("test metrics", "n/a (no evaluation finished)"))
    if s["target"] is not None:
        reached = "not reached" if s["time_to_target"] is None else f"reached in {s['time_to_target']:.2f} s"
        rows.append(("time to target", f"{s['target']} {reached}"))
    best = s.get("best_model")
    if best and best["file"] != "model.pt":  # (else model.pt, the last weights, is the best)
        rows.append(("best model", f"{best['file']}, step {best['step']} ({best['metric']} "
                                   f"{_metric_text(best['metric'], best['value'])}); model.pt: the last weights"))
    rows.append(("saved to", s["run_dir"]))
    width = max(len(k) for k, _ in rows)
    print("\n".join(f"{k:<{width}}  {v}" for k, v in rows))


def _run_models(args) -> int:
    from ..models import list_models

    print("\n".join(list_models() + ["package.module:factory  (your own)", "timm:<name>  (needs timm)"]))
    return 0
