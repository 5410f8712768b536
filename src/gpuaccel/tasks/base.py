"""What a kind of problem brings to training: the loss, the metrics, how a batch splits into
inputs and targets, and how evaluation runs the model.

The engine knows nothing else about the problem. A task is one object (timm's and
torchtitan's habit: the loss is a component, not a line inside the loop):

- ``split(batch)`` -> ``(inputs, targets)``;
- ``loss(outputs, targets)`` -> the scalar that training minimises (mean over the batch);
- ``metrics()`` -> ``{name: Metric}``, each accumulated on the device over an evaluation;
- ``eval_outputs(call, inputs)`` -> outputs at evaluation (image classification averages
  test-time augmentations here);
- ``predict(outputs)`` -> what inference reports; ``example_input(batch, shape)`` -> what an
  export is traced with;
- ``describe()`` -> what a checkpoint records of the task.

Metrics are reduced without a host synchronisation per batch: each evaluation batch adds
a few sums on the device, one all-reduce sums them over processes, one read ends it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from ..errors import GpuaccelError

TARGET_KEYS = ("target", "targets", "label", "labels", "y")


def _run(forward: Callable, inputs, **keywords):
    """The model's outputs on a batch's inputs: a tensor, a tuple (positional) or a dict (keywords)."""
    if isinstance(inputs, Mapping):
        return forward(**inputs, **keywords)
    if isinstance(inputs, (tuple, list)):
        return forward(*inputs, **keywords)
    return forward(inputs, **keywords)


def call_model(forward: Callable, inputs):
    """Runs the model on a batch's inputs: a tensor, a tuple (positional) or a dict (keywords).
    A model that returns its outputs in an object with ``logits`` (HuggingFace transformers'
    ``ModelOutput``, or a dict with that key) gives those logits."""
    return model_logits(_run(forward, inputs))


def takes_labels(model) -> bool:
    """Whether ``model``'s forward takes ``labels`` (as HuggingFace transformers' models do, which
    then return their own loss)."""
    import inspect

    try:
        return "labels" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


def training_loss(forward: Callable, inputs, targets, task: Task, labels_too: bool = False,
                  loss_fn: Callable | None = None) -> torch.Tensor:
    """The loss to minimise on a batch. With ``labels_too`` (a model whose forward takes
    ``labels``) the targets go in as ``labels=``, and a model that returns its own ``.loss``
    (HuggingFace's models do) is trained on it; otherwise it is the task's loss of the logits
    (``loss_fn``: the task's loss as the trainer runs it, e.g. compiled)."""
    loss_fn = loss_fn or task.loss
    if not labels_too:
        return loss_fn(call_model(forward, inputs), targets)
    outputs = _run(forward, inputs, labels=targets)
    own = outputs.get("loss") if isinstance(outputs, Mapping) else getattr(outputs, "loss", None)
    return own if own is not None else loss_fn(model_logits(outputs), targets)


def model_logits(outputs):
    """``outputs.logits`` (or ``outputs["logits"]``) where the model returned such an object;
    anything else as it is."""
    if isinstance(outputs, torch.Tensor):
        return outputs
    logits = getattr(outputs, "logits", None)
    if logits is None and isinstance(outputs, Mapping):
        logits = outputs.get("logits")
    return outputs if logits is None else logits


def leading_size(tree) -> int:
    """Samples in a batch: the first dimension of its first tensor."""
    if isinstance(tree, torch.Tensor):
        return int(tree.shape[0])
    values = tree.values() if isinstance(tree, Mapping) else tree
    for value in values:
        if isinstance(value, (torch.Tensor, Mapping, tuple, list)):
            return leading_size(value)
    raise GpuaccelError("a batch holds no tensor")


def _on_device(value: float, like: torch.Tensor) -> torch.Tensor:
    """A host number as a 0-d float tensor beside ``like``, filled by a kernel: torch.tensor(x,
    device=...) would copy it from pageable host memory, once per batch and metric."""
    return torch.full((), float(value), device=like.device)


class Metric:
    """A metric summed on the device over an evaluation: ``sums`` gives a batch's
    contribution (a 1-D float tensor), ``finish`` turns the totals into the value."""

    higher_is_better = True
    width = 2  # how many sums
    uses_generated = False  # scored on what the task's ``generate`` made (decoded text), not on the outputs

    def sums(self, outputs, targets) -> torch.Tensor:
        raise NotImplementedError

    def finish(self, totals: list[float]) -> float:
        return totals[0] / max(totals[1], 1e-12)

    def reset(self) -> None:
        """Forgets what an evaluation gathered (for metrics that keep state beyond their sums)."""


class Accuracy(Metric):
    """Top-1 accuracy: the share of samples (or positions) whose arg-max output is the target.
    ``class_dim``: where the classes are (1 for (N, C, ...) logits; -1 for a language model's
    (N, T, V))."""

    def __init__(self, class_dim: int = 1):
        self.class_dim = class_dim

    def sums(self, outputs, targets):
        correct = (outputs.argmax(self.class_dim) == targets).sum()
        return torch.stack([correct.float(), _on_device(targets.numel(), targets)])


class MeanSquaredError(Metric):
    higher_is_better = False

    def __init__(self, root: bool = False):
        self.root = root

    def sums(self, outputs, targets):
        outputs, targets = _matched(outputs, targets)
        return torch.stack([(outputs - targets).square().sum(), _on_device(targets.numel(), targets)])

    def finish(self, totals):
        mean = super().finish(totals)
        return mean ** 0.5 if self.root else mean


class MeanAbsoluteError(Metric):
    higher_is_better = False

    def sums(self, outputs, targets):
        outputs, targets = _matched(outputs, targets)
        return torch.stack([(outputs - targets).abs().sum(), _on_device(targets.numel(), targets)])


class BatchMean(Metric):
    """A user's ``fn(outputs, targets) -> scalar``, averaged over the evaluation set (each batch
    weighted by its number of samples)."""

    def __init__(self, fn: Callable, higher_is_better: bool = True):
        self.fn, self.higher_is_better = fn, higher_is_better

    def sums(self, outputs, targets):
        value = torch.as_tensor(self.fn(outputs, targets), dtype=torch.float32)
        if value.numel() != 1:
            raise GpuaccelError(f"metric {getattr(self.fn, '__name__', self.fn)!r} returned a tensor of shape "
                                f"{tuple(value.shape)}; a metric returns one number per batch")
        n = leading_size(targets)
        like = targets if isinstance(targets, torch.Tensor) else value
        return torch.stack([value.to(like.device).reshape(()) * n, _on_device(n, like)])


class TorchMetric(Metric):
    """A torchmetrics metric (anything with ``update``, ``compute`` and ``reset``): it keeps its
    own state and synchronises itself across processes in ``compute``."""

    width = 0

    def __init__(self, metric, higher_is_better: bool | None = None):
        self.metric = metric
        declared = getattr(metric, "higher_is_better", None)
        self.higher_is_better = bool(declared if higher_is_better is None and declared is not None
                                     else True if higher_is_better is None else higher_is_better)

    def to(self, device):
        if hasattr(self.metric, "to"):
            self.metric = self.metric.to(device)
        return self

    def sums(self, outputs, targets):
        self.metric.update(outputs, targets)
        return None

    def finish(self, totals):
        value = self.metric.compute()
        self.metric.reset()
        return float(value)


def as_metric(value) -> Metric:
    """A Metric from what a user passes: a Metric, a torchmetrics metric, or a callable."""
    if isinstance(value, Metric):
        return value
    if all(hasattr(value, name) for name in ("update", "compute", "reset")):
        return TorchMetric(value)
    if callable(value):
        return BatchMean(value)
    raise GpuaccelError(f"a metric is a torchmetrics metric or a callable (outputs, targets) -> number, "
                        f"not {type(value).__name__}")


def _matched(outputs: torch.Tensor, targets: torch.Tensor):
    """Float outputs shaped like the targets ((N, 1) outputs against (N,) targets)."""
    outputs, targets = outputs.float(), targets.float()
    if outputs.shape != targets.shape and outputs.numel() == targets.numel():
        outputs = outputs.reshape(targets.shape)
    return outputs, targets


class Task:
    """The base: a batch is ``(inputs, targets)`` (or ``(*inputs, targets)``, or a dict with a
    target key), the model's output is what the loss and metrics take."""

    name = "task"
    default_target: str | None = None  # the metric a bare --target-acc style goal refers to
    # the loss is plain tensor code of fixed shapes that torch.compile fuses into a few kernels
    # (with compile on, the trainer compiles it beside the model): worth it where the loss makes
    # many passes over large outputs, such as a per-pixel loss
    compile_loss = False

    def split(self, batch):
        if isinstance(batch, Mapping):
            key = next((k for k in TARGET_KEYS if k in batch), None)
            if key is None:
                raise GpuaccelError(f"a dict batch needs a target under one of the keys {', '.join(TARGET_KEYS)}; "
                                    f"this one has {', '.join(map(str, batch))}")
            inputs = {k: v for k, v in batch.items() if k != key}
            return (next(iter(inputs.values())) if len(inputs) == 1 else inputs), batch[key]
        if isinstance(batch, (tuple, list)):
            if len(batch) < 2:
                raise GpuaccelError("a batch is (inputs, targets) or a dict with a target; this one has one part")
            return (batch[0] if len(batch) == 2 else tuple(batch[:-1])), batch[-1]
        raise GpuaccelError(f"a batch is a tuple or dict of tensors, not {type(batch).__name__}")

    def loss(self, outputs, targets) -> torch.Tensor:
        raise NotImplementedError

    def eval_loss_sum(self, outputs, targets) -> torch.Tensor:
        """The loss summed over the batch's samples (evaluation reports its mean)."""
        return self.loss(outputs, targets).float() * leading_size(targets)

    def metrics(self) -> dict[str, Metric]:
        """The task's own metrics."""
        return {}

    # metrics a user may ask for by name (metrics={"mae": "mae"}), beyond the task's own
    NAMED_METRICS: dict[str, Callable[[], Metric]] = {}

    def with_metrics(self, metrics: Mapping) -> "Task":
        """This task, also reporting ``metrics`` ({name: torchmetrics metric, callable, or the
        name of a metric the task knows})."""
        added = {}
        for name, metric in metrics.items():
            if isinstance(metric, str):
                if metric not in self.NAMED_METRICS:
                    known = ", ".join(sorted(self.NAMED_METRICS)) or "none"
                    raise GpuaccelError(f"task {self.name} cannot compute metric {metric!r}; by name it knows: "
                                        f"{known} (or pass a callable or a torchmetrics metric)")
                metric = self.NAMED_METRICS[metric]()
            added[name] = as_metric(metric)
        self.extra_metrics = {**getattr(self, "extra_metrics", {}), **added}
        return self

    def all_metrics(self) -> dict[str, Metric]:
        return {**self.metrics(), **getattr(self, "extra_metrics", {})}

    def eval_outputs(self, call: Callable, inputs):
        """The outputs evaluation scores; ``call(inputs)`` runs the model once."""
        return call(inputs)

    def generate(self, model: torch.nn.Module, inputs):
        """What the model makes of the inputs over several calls, for the metrics that score it
        (``Metric.uses_generated``: translation decodes sentences); None for tasks that score the
        outputs of one call only. ``model`` is the plain module (or its weight average)."""
        return None

    def predict(self, outputs: torch.Tensor) -> torch.Tensor:
        """What inference reports for a model's outputs (classification: class probabilities)."""
        return outputs.float()

    def deployed(self, module: torch.nn.Module) -> torch.nn.Module:
        """What an export (and inference from a checkpoint) runs: the model, or the model with the
        decoding a deployed model should carry (detection: its boxes)."""
        return module

    def report(self, deployed_outputs: torch.Tensor) -> torch.Tensor:
        """What inference reports from the deployed model's outputs."""
        return self.predict(deployed_outputs)

    def example_input(self, batch: int, sample_shape) -> torch.Tensor:
        """Inputs to trace a model with for export: ``batch`` samples of ``sample_shape``, as the
        exported model receives them."""
        return torch.rand(batch, *sample_shape)

    def check_batch(self, outputs, targets) -> None:
        """Raises GpuaccelError, before training starts, where the model's outputs on the first
        batch and that batch's targets do not fit this task (a task checks what it can)."""

    def check_target(self, metric: str) -> None:
        known = ["loss", *self.all_metrics()]
        if metric not in known:
            raise GpuaccelError(f"--target names metric {metric!r}, which task {self.name} does not compute; "
                                f"it computes: {', '.join(known)}")

    def higher_is_better(self, metric: str) -> bool:
        return False if metric == "loss" else self.all_metrics()[metric].higher_is_better

    def describe(self) -> dict:
        return {"name": self.name}


# metrics a user may name beside a loss function of their own (metrics={"accuracy": "accuracy"})
NAMED_METRICS: dict[str, Callable[[], Metric]] = {
    "accuracy": Accuracy, "rmse": lambda: MeanSquaredError(root=True), "mse": MeanSquaredError,
    "mae": MeanAbsoluteError}


class CustomTask(Task):
    """A task from a user's ``loss_fn(outputs, targets)`` and ``metrics={name: metric}`` (a
    metric, a torchmetrics metric, a callable, or the name of a built-in: accuracy, rmse, mse, mae)."""

    name = "custom"

    def __init__(self, loss_fn: Callable, metrics: Mapping | None = None):
        if not callable(loss_fn):
            raise GpuaccelError(f"loss_fn must be a callable (outputs, targets) -> scalar, not {type(loss_fn).__name__}")
        self.loss_fn = loss_fn
        unknown = [m for m in (metrics or {}).values() if isinstance(m, str) and m not in NAMED_METRICS]
        if unknown:
            raise GpuaccelError(f"no built-in metric named {unknown[0]!r}; by name: {', '.join(NAMED_METRICS)} (or "
                                f"pass a callable or a torchmetrics metric)")
        self._metrics = {name: NAMED_METRICS[m]() if isinstance(m, str) else as_metric(m)
                         for name, m in (metrics or {}).items()}
        self.default_target = next(iter(self._metrics), None)

    def loss(self, outputs, targets):
        return self.loss_fn(outputs, targets)

    def metrics(self):
        return self._metrics

    def describe(self):
        return {"name": self.name, "loss_fn": getattr(self.loss_fn, "__qualname__", type(self.loss_fn).__name__),
                "metrics": list(self._metrics)}


class MetricTracker:
    """The evaluation loss and a task's metrics over one evaluation, summed on the device."""

    def __init__(self, task: Task, device: torch.device):
        self.task, self.device = task, device
        self.metrics = task.all_metrics()
        for metric in self.metrics.values():
            if isinstance(metric, TorchMetric):
                metric.to(device)
        self.reset()

    def reset(self) -> None:
        self.loss_sum = torch.zeros((), device=self.device)
        self.count = torch.zeros((), device=self.device)
        self.sums = {name: None for name in self.metrics}
        for metric in self.metrics.values():
            metric.reset()

    def update(self, outputs, targets, generated=None) -> None:
        self.loss_sum += self.task.eval_loss_sum(outputs, targets).float()
        self.count += leading_size(targets)
        for name, metric in self.metrics.items():
            if metric.uses_generated and generated is None:
                continue
            part = metric.sums(generated if metric.uses_generated else outputs, targets)
            if part is not None:
                self.sums[name] = part.float() if self.sums[name] is None else self.sums[name] + part

    def compute(self, all_reduce_sum: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, float]:
        """{"loss": mean loss, name: value, ...}; ``all_reduce_sum`` sums a tensor over processes."""
        names = [n for n, m in self.metrics.items() if m.width]
        parts = [torch.stack([self.loss_sum, self.count])]
        for name in names:
            parts.append(self.sums[name] if self.sums[name] is not None
                         else torch.zeros(self.metrics[name].width, device=self.device))
        flat = all_reduce_sum(torch.cat(parts).float()).tolist()  # the one host read
        result = {"loss": flat[0] / max(flat[1], 1e-12)}
        offset = 2
        for name in names:
            width = self.metrics[name].width
            result[name] = self.metrics[name].finish(flat[offset:offset + width])
            offset += width
        for name, metric in self.metrics.items():
            if not metric.width:
                result[name] = metric.finish([])
        self.reset()
        return result
