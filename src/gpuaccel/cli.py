"""The ``gpuaccel`` command: a thin layer over the Python API.

A :class:`GpuaccelError` becomes one line on stderr and exit status 2; Ctrl-C during
training saves a checkpoint and exits with 130; anything else is a bug and keeps
its traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import warnings

from .errors import GpuaccelError

EXIT_USER_ERROR = 2
EXIT_INTERRUPTED = 130


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad option is one line (plus where to find help), exit status 2."""

    def error(self, message):
        raise GpuaccelError(f"{message} (see '{self.prog} --help')")


def _train_parser(sub) -> None:
    p = sub.add_parser(
        "train", help="train an image classifier",
        description="Train an image classifier on the best device present (a CUDA GPU if there is one, else the "
                    "CPU). Every option has a sensible default: 'gpuaccel train' alone trains LeNet-5 on the "
                    "built-in 8x8 digits. The run directory receives config.json, metrics.jsonl, summary.json, "
                    "checkpoint.pt (to resume) and model.pt (the trained model).",
        epilog="examples:\n"
               "  gpuaccel train                                   # LeNet-5 on the built-in digits\n"
               "  gpuaccel train --data ~/mnist --model lenet5 --epochs 5\n"
               "  gpuaccel train --data imagefolder:~/photos --val-split 0.1 --model resnet18 --image-size 64\n"
               "  gpuaccel train --data cifar10:~/cifar-10-batches-py --model resnet18 --target-acc 0.9\n"
               "  gpuaccel train --resume runs/mnist-lenet5-20260101-120000   # continue a stopped run",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    d = p.add_argument_group("data")
    d.add_argument("--data", metavar="SPEC",
                   help="'digits' (built in, the default); a path: MNIST IDX directory, CIFAR-10/100 pickle "
                        "directory, image folder (train/<class>/*.jpg [test/<class>/...] or <class>/*.jpg), "
                        ".tar/.tar.gz of such a folder, or .npz; or KIND:PATH with KIND one of "
                        "cifar10, cifar100, digits, fashion-mnist, idx, imagefolder, mnist, npz, tar")
    d.add_argument("--val-split", type=float, metavar="F",
                   help="hold out fraction F of the training images for evaluation, for data without a test split "
                        "(default 0.1; 0.2 for digits)")
    d.add_argument("--image-size", type=int, metavar="N",
                   help="resize every image to NxN (default: keep; mixed sizes go to the most common size)")
    d.add_argument("--skip-bad", action="store_true", default=None,
                   help="skip images that cannot be decoded (they are counted) instead of stopping")
    d.add_argument("--cache-dir", metavar="DIR", help="where decoded images are cached (default ~/.cache/gpuaccel)")
    d.add_argument("--loader", metavar="WHERE", help="auto (GPU memory when the data fits), gpu, or cpu")
    d.add_argument("--crop-padding", type=int, metavar="P", help="random translation by up to P pixels (default 0)")
    d.add_argument("--flip", metavar="MODE", help="horizontal flips: none (default), random, alternate")
    d.add_argument("--cutout", type=int, metavar="S", help="zero a random SxS square in each image (default 0)")

    m = p.add_argument_group("model and hardware")
    m.add_argument("--model", metavar="NAME",
                   help="lenet5 (default), mlp, resnet18, resnet34, resnet50, mobilenet_v2, "
                        "package.module:factory for your own, or timm:NAME when timm is installed")
    m.add_argument("--device", metavar="DEV", help="auto (default), cpu, cuda or cuda:N")
    m.add_argument("--precision", metavar="P",
                   help="auto (default: bf16 on GPUs that have it, fp16 on older GPUs, fp32 on the CPU), "
                        "fp32, bf16 or fp16")
    m.add_argument("--channels-last", action=argparse.BooleanOptionalAction, default=None,
                   help="NHWC memory layout (default: on for GPUs)")
    m.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="torch.compile the model (slower start, faster steps; compiled kernels are cached on disk)")
    m.add_argument("--compile-mode", metavar="MODE",
                   help="torch.compile mode: default, reduce-overhead (CUDA graphs), max-autotune, "
                        "max-autotune-no-cudagraphs")

    o = p.add_argument_group("optimisation")
    o.add_argument("--optimizer", metavar="NAME", help="sgd (default, Nesterov momentum) or adamw")
    o.add_argument("--lr", type=float, help="peak learning rate (default 0.05)")
    o.add_argument("--momentum", type=float, help="SGD momentum or AdamW beta1 (default 0.9)")
    o.add_argument("--nesterov", action=argparse.BooleanOptionalAction, default=None, help="Nesterov momentum")
    o.add_argument("--weight-decay", type=float, help="on weights, not on biases or norms (default 5e-4)")
    o.add_argument("--schedule", metavar="NAME", help="onecycle (default), cosine (with warm-up) or constant")
    o.add_argument("--warmup-epochs", type=float, help="length of the rising part of the schedule (default 1)")
    o.add_argument("--bias-lr-scale", type=float, metavar="X",
                   help="learning-rate multiplier for biases and norm parameters (default 1)")
    o.add_argument("--label-smoothing", type=float, help="(default 0)")
    o.add_argument("--ema", type=float, metavar="DECAY",
                   help="evaluate an exponential moving average of the weights (e.g. 0.99 per step)")
    o.add_argument("--tta", type=int, metavar="LEVEL",
                   help="test-time augmentation: 0 none (default), 1 flip, 2 flip and one-pixel translations")
    o.add_argument("--grad-accum", type=int, metavar="K",
                   help="accumulate K batches per optimizer step (effective batch = K x batch size)")
    o.add_argument("--grad-clip", type=float, metavar="NORM", help="clip the gradient norm to NORM")
    o.add_argument("--batch-size", type=int, help="images per step (default 128)")
    o.add_argument("--eval-batch-size", type=int, help="(default 1024)")
    o.add_argument("--seed", type=int, help="seeds model init, data order and augmentation (default 0)")

    s = p.add_argument_group("stopping and output")
    s.add_argument("--epochs", type=int, help="passes over the training set (default 10)")
    s.add_argument("--time-limit", type=float, metavar="SECONDS", help="stop after this much training time")
    s.add_argument("--target-acc", type=float, metavar="F",
                   help="stop as soon as held-out accuracy reaches F (e.g. 0.99); records time-to-accuracy")
    s.add_argument("--eval-every", type=int, metavar="STEPS", help="evaluate every STEPS steps (default: each epoch)")
    s.add_argument("--checkpoint-every", type=int, metavar="STEPS",
                   help="also checkpoint every STEPS steps (always at each epoch's end and every 5 minutes)")
    s.add_argument("--run-dir", metavar="DIR", help="where to save the run (default runs/<data>-<model>-<time>)")
    s.add_argument("--recipe", metavar="NAME|FILE",
                   help="start from a recipe: a shipped one (digits) or your own YAML file of settings; "
                        "options given here override it")
    s.add_argument("--resume", metavar="RUN_DIR", help="continue the run saved in RUN_DIR from its last checkpoint")
    s.add_argument("--quiet", action="store_true", help="print only the summary")
    s.add_argument("--json", action="store_true", help="print the summary as JSON on stdout")
    p.set_defaults(handler=_run_train)


def _explicit_options(args: argparse.Namespace) -> dict:
    """The TrainConfig fields the user set on the command line (every option defaults to None)."""
    from .train import TrainConfig

    names = {f.name for f in dataclasses.fields(TrainConfig)}
    return {k: v for k, v in vars(args).items() if k in names and v is not None}


def _run_train(args) -> int:
    from .train import TrainConfig, Trainer
    from .train.recipes import load_recipe

    options = _explicit_options(args)
    if args.resume and args.recipe:
        raise GpuaccelError("--resume continues a run with its own settings; drop --recipe")
    if args.recipe:
        options = {**load_recipe(args.recipe), **options}
        options = {k: v for k, v in TrainConfig.from_dict(options).to_dict().items() if k in options}
    if args.resume:
        trainer = Trainer.resume(args.resume, overrides=options, quiet=args.quiet or args.json)
    else:
        trainer = Trainer(TrainConfig(**options), quiet=args.quiet or args.json)
    try:
        summary = trainer.fit()
    except KeyboardInterrupt:
        print(f"gpuaccel: interrupted; checkpoint saved. Continue with: gpuaccel train --resume {trainer.run_dir}",
              file=sys.stderr)
        return EXIT_INTERRUPTED
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        _print_summary(summary)
    return 0


def _print_summary(s: dict) -> None:
    acc = "n/a" if s["test_accuracy"] is None else f"{100 * s['test_accuracy']:.2f}%"
    rows = [
        ("device", f"{s['device_name']} [{s['device']}]"),
        ("precision", s["precision"] + (", channels_last" if s["channels_last"] else "") +
         (", compiled" if s["compile"] else "")),
        ("model", f"{s['model']} ({s['parameters']:,} parameters)"),
        ("data", f"{s['data']}: {s['train_images']} train / {s['test_images']} test images" +
         (f", {s['skipped_images']} bad skipped" if s["skipped_images"] else "")),
        ("epochs", f"{s['epochs']:g} ({s['steps']} steps, stopped by {s['stopped_by']})"),
        ("wall time", f"{s['wall_seconds']:.2f} s (training {s['train_seconds']:.2f} s, set-up {s['setup_seconds']:.2f} s)"),
        ("throughput", f"{s['images_per_second']:,.0f} images/s"),
        ("test accuracy", acc + (f" (best {100 * s['best_accuracy']:.2f}%)" if s["best_accuracy"] else "")),
    ]
    if s["target_acc"] is not None:
        reached = "not reached" if s["time_to_target"] is None else f"reached in {s['time_to_target']:.2f} s"
        rows.append(("time to accuracy", f"{100 * s['target_acc']:.2f}% {reached}"))
    rows.append(("saved to", s["run_dir"]))
    width = max(len(k) for k, _ in rows)
    print("\n".join(f"{k:<{width}}  {v}" for k, v in rows))


def _run_models(args) -> int:
    from .models import list_models

    print("\n".join(list_models() + ["package.module:factory  (your own)", "timm:<name>  (needs timm)"]))
    return 0


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = _Parser(prog="gpuaccel", description="Fast deep-learning training and inference on NVIDIA GPUs; "
                                                  "the same code runs on a CPU.")
    parser.add_argument("--version", action="version", version=f"gpuaccel {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    _train_parser(sub)
    sub.add_parser("models", help="list the model names create_model accepts").set_defaults(handler=_run_models)
    return parser


def _format_warning(message, category, filename, lineno, line=None):
    return f"gpuaccel: warning: {message}\n"


def main(argv=None) -> int:
    warnings.formatwarning = _format_warning
    try:
        args = build_parser().parse_args(argv)
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
