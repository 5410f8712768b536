"""Evaluation: the model (or its weight average) on the held-out split, the task's metrics
computed on the device with one host synchronisation at the end, and what a run keeps of
each evaluation (the record, the best values, the time to the target)."""

from __future__ import annotations

import math
import warnings

import torch
from torch.utils._pytree import tree_flatten, tree_map

from ..errors import GpuaccelError
from ..tasks import call_model


def _call(trainer, net, inputs) -> torch.Tensor:
    """One forward pass. Under CUDA graphs an output lives in memory the next replay
    overwrites, so outputs that are kept are cloned."""
    if not trainer.torch_compile_graphs:
        return call_model(net, inputs)
    torch.compiler.cudagraph_mark_step_begin()
    return tree_map(torch.clone, call_model(net, inputs))

@torch.no_grad()
def evaluate(trainer, each_shape: bool = False) -> dict:
    """The loss and the task's metrics on the held-out split (one host synchronisation at
    the end), with the weight average when there is one: {"loss": ..., metric: ...}.

    ``each_shape`` (the warm-up's pass, whose metrics are thrown away): in a single process,
    only the batches of an input shape not yet seen twice, which is what compiling and
    recording CUDA graphs need; the rest of the held-out split would only cost time."""
    net = trainer.eval_forward
    plain = trainer.ema.module if trainer.ema is not None else trainer.model  # (what decoding runs)
    was_training = trainer.model.training
    trainer.model.eval()
    tracker = trainer.metric_tracker
    seen: dict[tuple, int] = {}
    blanks = trainer.strategy.blank_evaluation_passes(len(trainer.eval_loader))
    for batch in trainer.eval_loader.batches():
        inputs, targets = trainer.task.split(batch)
        if each_shape and not trainer.dist.active:
            shapes = tuple(tuple(t.shape) for t in tree_flatten(inputs)[0] if torch.is_tensor(t))
            seen[shapes] = seen.get(shapes, 0) + 1
            if seen[shapes] > 2:
                continue
        with trainer.precision.autocast(trainer.device):
            outputs = trainer.task.eval_outputs(lambda x: _call(trainer, net, x), inputs)
            # (not in the warm-up's pass: decoding is eager, nothing in it is compiled or recorded)
            generated = None if each_shape else trainer.task.generate(plain, inputs)
        if trainer.strategy.counts_metrics:  # (a pipeline stage before the last took part; the last has the outputs)
            tracker.update(outputs, targets, generated)
    for _ in range(blanks):  # (where the forward pass is a collective: as many as the process with the most)
        _blank_pass(trainer, net)
    trainer.model.train(was_training)
    return tracker.compute(trainer.dist.all_reduce_sum)  # every rank has a shard

def _blank_pass(trainer, net) -> None:
    """One evaluation forward pass on a blank sample (for strategies whose forward pass is a
    collective, on processes with fewer evaluation batches)."""
    with trainer.precision.autocast(trainer.device):
        trainer.task.eval_outputs(lambda x: _call(trainer, net, x), tree_map(torch.zeros_like, trainer._example_inputs))

def evaluate_and_record(trainer, loss_sum: torch.Tensor, samples: int, seconds: float, wall: float) -> dict:
    """Evaluates and returns the evaluation's record (metrics.jsonl's line): the training loss
    since the last one (``loss_sum`` over ``samples`` in ``seconds`` of training), the held-out
    metrics, the best so far and the time to the target updated."""
    totals = trainer.dist.all_reduce_sum(torch.stack([loss_sum.float(), torch.tensor(
        float(samples), device=loss_sum.device)]))  # over all processes
    samples = int(totals[1].item())
    train_loss = totals[0].item() / samples if samples else None  # (none after a resume's redone evaluation)
    state = trainer.state
    if train_loss is not None and not math.isfinite(train_loss):
        raise GpuaccelError(f"the training loss is {train_loss} at step {state.global_step}: training diverged "
                            f"(no checkpoint of it was saved); try a lower --lr (this run: "
                            f"{trainer.config.optimizer.lr:g}), --grad-clip, or --precision fp32")
    result = trainer.evaluate()  # (the method: a subclass may evaluate otherwise)
    broken = sorted(name for name, value in result.items() if not math.isfinite(value))
    if broken:
        loss = "None" if train_loss is None else f"{train_loss:.4g}"
        warnings.warn(f"the held-out {', '.join(broken)} {'is' if len(broken) == 1 else 'are'} not finite at step "
                      f"{state.global_step} while training's loss is {loss}: the evaluation data hold NaN or "
                      f"infinite values, or the model overflows on them", stacklevel=2)
    if state.evaluated(result, best_model_metric(trainer), trainer.task.higher_is_better,
                       reached_target(trainer, result)):
        trainer.keep_best()
    rate = round(samples / max(seconds, 1e-9), 1)
    return {"step": state.global_step, "epoch": round(trainer.epochs_done, 4),
            "train_loss": None if train_loss is None else round(train_loss, 6),
            **{name: round(value, 6) for name, value in result.items()},
            "lr": trainer.scheduler.get_last_lr()[0], "samples_per_second": rate,
            **({"tokens_per_second": round(rate * trainer.inputs.tokens_per_sample)}
               if trainer.inputs.tokens_per_sample else {}),
            "elapsed": round(state.train_seconds, 4), "wall": round(wall, 4)}

def best_model_metric(trainer) -> str:
    """What "best" means for best.pt: the target's metric where there is a target, else the
    task's main one."""
    target = trainer.config.loop.target_metric
    return target[0] if target else trainer.task.default_target


def reached_target(trainer, result: dict) -> bool:
    if trainer.config.loop.target_metric is None:
        return False
    metric, goal = trainer.config.loop.target_metric
    value = result.get(metric)
    if value is None:
        return False
    return value >= goal if trainer.task.higher_is_better(metric) else value <= goal
