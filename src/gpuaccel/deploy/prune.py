"""Pruning a trained model: magnitude (unstructured) or whole channels (structured).

Unstructured pruning zeroes the smallest weights of every convolution and linear layer
(one global threshold, ``torch.nn.utils.prune``): the file compresses better but dense
kernels run no faster. Structured pruning removes the least important channels with
torch-pruning, which follows the dependencies between layers (residual additions,
depthwise convolutions, batch norms), so the model really gets smaller and faster.

A channel-pruned model no longer matches its registry definition, so its checkpoint
carries ``structure``: the widths of every convolution, linear and batch-norm layer.
``models.structure.apply_structure`` reshapes a freshly created model to those widths
before its weights are loaded.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn as nn

from ..errors import GpuaccelError
from ..files import RunLock, make_directory, run_directory_lock
from ..models.structure import layer_structure

def _prunable_weights(model: nn.Module) -> list[tuple[nn.Module, str]]:
    return [(m, "weight") for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Linear)) and
            m.weight.requires_grad]


def prune_unstructured(model: nn.Module, sparsity: float) -> None:
    """Zeroes the ``sparsity`` share of conv/linear weights with the smallest magnitude (one
    threshold across all layers), permanently."""
    from torch.nn.utils import prune

    targets = _prunable_weights(model)
    prune.global_unstructured(targets, pruning_method=prune.L1Unstructured, amount=sparsity)
    for module, key in targets:
        prune.remove(module, key)


def prune_channels(model: nn.Module, sparsity: float, example: torch.Tensor) -> None:
    """Removes the ``sparsity`` share of output channels of every prunable layer (L2 magnitude of
    each channel group), keeping the classifier's outputs. Layer widths stay multiples of 8
    where they were, which suits vectorised CPU kernels and tensor cores."""
    try:
        import torch_pruning as tp
    except ImportError:
        raise GpuaccelError("structured pruning needs torch-pruning: pip install torch-pruning "
                            "(or gpuaccel[deploy])") from None
    layers = [m for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
    classifier = layers[-1]  # registry models define their classifier last
    frozen = [m for m in layers if not m.weight.requires_grad]  # e.g. a fixed whitening layer
    widths = [m.out_channels for m in layers if isinstance(m, nn.Conv2d)]
    round_to = 8 if widths and all(w % 8 == 0 for w in widths) else None
    try:
        pruner = tp.pruner.MetaPruner(model, example, importance=tp.importance.GroupMagnitudeImportance(p=2),
                                      pruning_ratio=sparsity, ignored_layers=[classifier, *frozen],
                                      round_to=round_to)
        pruner.step()
    except Exception as exc:  # torch-pruning raises many kinds on graphs it cannot follow
        raise GpuaccelError(f"torch-pruning cannot prune this model's channels ({type(exc).__name__}: "
                            f"{exc!s:.150}); try unstructured pruning (no --structured)") from None


def model_size(model: nn.Module, example: torch.Tensor) -> dict:
    """Parameters, non-zero parameters and forward FLOPs per image."""
    from torch.utils.flop_counter import FlopCounterMode

    was_training = model.training
    model.eval()
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(example)
    model.train(was_training)
    params = list(model.parameters())
    return {"parameters": sum(p.numel() for p in params),
            "nonzero_parameters": int(sum((p != 0).sum() for p in params)),
            "flops_per_image": counter.get_total_flops() / example.shape[0]}


def prune_trained(trained, data, *, sparsity: float, structured: bool, finetune_epochs: float = 0,
                  lr: float | None = None, out_dir=None, repeats: int = 100, quiet: bool = True) -> dict:
    """Prunes a trained model, optionally fine-tunes it with the training engine on its own data,
    saves it as a run directory (``model.pt`` with its structure) and reports parameters, FLOPs,
    file size, held-out accuracy and CPU latency before and after."""
    import copy
    from pathlib import Path

    from ..train import TrainConfig, Trainer, checkpoint
    from .artifact import Normalized

    if not 0 < sparsity < 1:
        raise GpuaccelError(f"--sparsity is the share to remove, in (0, 1), got {sparsity}")
    if finetune_epochs < 0:
        raise GpuaccelError(f"--finetune-epochs must be >= 0, got {finetune_epochs}")
    kind = "structured" if structured else "unstructured"
    out_dir = Path(out_dir or trained.source.parent / f"pruned-{kind}-{sparsity:g}")
    if (out_dir / "checkpoint.pt").exists() or (out_dir / "model.pt").exists():
        raise GpuaccelError(f"{out_dir} already holds a model; pick another --out")
    example = torch.rand(1, trained.in_channels, trained.image_size, trained.image_size)
    report = {"method": kind, "sparsity": sparsity, "source": str(trained.source),
              "before": _measure(trained.module, trained.source.stat().st_size, data, example, repeats)}

    model = copy.deepcopy(trained.module.model).eval()
    if structured:
        prune_channels(model, sparsity, example)
    else:
        prune_unstructured(model, sparsity)
    pruned = Normalized(model, trained.module.mean.flatten().tolist(), trained.module.std.flatten().tolist()).eval()
    report["pruned_accuracy"] = _accuracy(pruned, data)
    structure = layer_structure(model) if structured else None
    # (the trainer records how to rebuild the model: the registry's, reshaped to these widths)

    if finetune_epochs:
        config = TrainConfig.from_dict(trained.config).replace(
            epochs=finetune_epochs, lr=lr or TrainConfig.from_dict(trained.config).optimizer.lr / 2,
            run_dir=str(out_dir),
            target_acc=None, time_limit=None)
        trainer = Trainer(config, dataset=data, model=model, structure=structure or layer_structure(model),
                          data_init=False, quiet=quiet)
        if not structured:
            _keep_zeros(trainer.model, trainer.optimizer)
        summary = trainer.fit()
        report["finetune"] = {"epochs": finetune_epochs, "lr": config.optimizer.lr,
                              "train_seconds": summary["train_seconds"],
                              "device": summary["device_name"]}
        from .artifact import load_trained

        pruned = load_trained(out_dir).module
    else:
        make_directory(out_dir)
        with RunLock(out_dir):  # (a second prune into the same folder is one line, not a mix of files)
            if (out_dir / "model.pt").exists():
                raise GpuaccelError(f"{out_dir} already holds a model; pick another --out")
            checkpoint.write_json(out_dir / "config.json", trained.config)
            checkpoint.save(out_dir / "model.pt", {
                "model_name": trained.model_name, "model_args": trained.model_args, "classes": trained.classes,
                "mean": trained.module.mean.flatten().tolist(), "std": trained.module.std.flatten().tolist(),
                "config": trained.config, "model": {k: v.detach().cpu() for k, v in model.state_dict().items()},
                "ema_model": None, "accuracy": report["pruned_accuracy"], "structure": structure})
    report["after"] = _measure(pruned, (out_dir / "model.pt").stat().st_size, data, example, repeats)
    report["out"] = str(out_dir / "model.pt")
    before, after = report["before"], report["after"]
    speedup, times = _interleaved_speedup(trained.module, pruned, example, rounds=7, calls=max(5, repeats // 5))
    report.update(speedup)
    for side, took in zip((before, after), times):  # (the latencies of the same alternating rounds)
        side.update({f"latency_p{q}_ms": float(np.percentile(took, q)) for q in (50, 90, 99)})
    report["speedup_throughput"] = after["best_images_per_second"] / before["best_images_per_second"]
    report["accuracy_drop_points"] = 100 * (before["test_accuracy"] - after["test_accuracy"])
    with run_directory_lock(out_dir):
        checkpoint.write_json(out_dir / "prune.json", report)
    return report


def _keep_zeros(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Unstructured fine-tuning keeps pruned weights at zero: momentum and weight decay would move
    them, so the mask is applied again after every optimizer step (before the weight average)."""
    masked = [(m.weight, (m.weight != 0).to(m.weight.dtype)) for m, _ in _prunable_weights(model)]

    @torch.no_grad()
    def reapply(optimizer, args, kwargs):
        for weight, mask in masked:
            weight.mul_(mask)
    optimizer.register_step_post_hook(reapply)


def _accuracy(module: nn.Module, data) -> float:
    from .infer import predict, top1_accuracy
    from .runners import Runner, torch_runner

    runner = Runner(torch_runner(module, torch.device("cpu")), [], {"modality": "image"}, "pytorch")
    probs, _ = predict(runner, data.test_images)
    return top1_accuracy(probs, data.test_labels)


def _interleaved_speedup(before: nn.Module, after: nn.Module, example: torch.Tensor, *, rounds: int,
                         calls: int) -> tuple[dict, list[list[float]]]:
    """Batch-1 CPU speed-up of ``after`` over ``before``, timed in alternating rounds (so that a
    busy moment of the machine slows both, not one): the median ratio of the rounds' median
    latencies, with the lowest and highest ratio (a ratio inside that spread of 1 is no change);
    and every call's time of each model (ms), from which both models' latencies are reported, so
    that the latencies and the speed-up are one measurement."""
    import statistics

    from .bench import torch_call
    from ..bench.timing import host_times_ms

    x = torch.rand(1, *example.shape[1:])
    calls_of = [torch_call(m.eval(), torch.device("cpu")) for m in (before, after)]
    for call in calls_of:  # (first calls build the kernels' plans: warmed before any round is timed)
        host_times_ms(lambda: call(x), 1, warmup=10)
    ratios, times = [], [[], []]
    for _ in range(rounds):
        medians = []
        for k, call in enumerate(calls_of):
            took = host_times_ms(lambda: call(x), calls, warmup=3)
            times[k] += took
            medians.append(statistics.median(took))
        ratios.append(medians[0] / medians[1])
    return {"speedup_batch1": statistics.median(ratios), "speedup_batch1_min": min(ratios),
            "speedup_batch1_max": max(ratios), "speedup_batch1_rounds": rounds}, times


def _measure(module: nn.Module, file_bytes: int, data, example: torch.Tensor, repeats: int) -> dict:
    from ..bench.timing import measure
    from .bench import torch_call

    c, s = example.shape[1], example.shape[2]
    speed = measure(torch_call(module.eval(), torch.device("cpu")), lambda b: torch.rand(b, c, s, s),
                    repeats=repeats)  # (its batch-1 latencies are replaced by the alternating rounds')
    return {**model_size(module.model, example), "file_bytes": file_bytes,
            "test_accuracy": _accuracy(module, data), **speed}
