"""Tasks: what a kind of problem brings to training (loss, metrics, evaluation).

``Classification``, ``MultiLabel``, ``Regression``, ``LanguageModelling``, ``Ranking``, ``Detection``,
``Segmentation`` and ``Translation`` are built in; ``CustomTask(loss_fn, metrics)`` wraps
a user's own. ``create_task(name, **settings)`` builds one by name (the ``task`` setting); ``resolve_task`` one from
what a user gave.
"""

from ..errors import GpuaccelError, choice_error
from .base import Accuracy, BatchMean, CustomTask, Metric, MetricTracker, Task, as_metric, call_model
from .classification import Classification
from .detection import Detection
from .language import LanguageModelling
from .multilabel import MultiLabel
from .ranking import Ranking
from .regression import Regression
from .segmentation import Segmentation
from .translation import Translation

TASKS = {"classification": Classification, "regression": Regression,
         "language_modelling": LanguageModelling, "ranking": Ranking, "multilabel": MultiLabel,
         "detection": Detection, "segmentation": Segmentation, "translation": Translation}
SCENE_TASKS = ("detection", "segmentation")  # image in, boxes or class maps out (deployed apart from classifiers)


def create_task(name: str, **settings) -> Task:
    """A built-in task by name, given the settings its constructor takes (others are ignored)."""
    import inspect

    if name not in TASKS:
        raise choice_error("task", name, sorted(TASKS))
    cls = TASKS[name]
    accepted = inspect.signature(cls).parameters
    given = {k: v for k, v in settings.items() if k in accepted and v is not None}
    missing = [k for k, p in accepted.items() if p.default is inspect.Parameter.empty and k not in given]
    if missing:
        raise GpuaccelError(f"task {name} needs {', '.join(missing)} (from its data, or given: "
                            f"gpuaccel.tasks.{cls.__name__}({missing[0]}=...))")
    return cls(**given)


def task_of(described: dict | None) -> Task:
    """The task a checkpoint or an export recorded (``Task.describe()``); older runs recorded none
    and were classification."""
    described = dict(described or {"name": "classification"})
    return create_task(described.pop("name", "classification"), **described)


def resolve_task(task=None, *, loss_fn=None, metrics: dict | None = None, default: str | None = None,
                 **settings) -> Task:
    """What a run minimises: ``task`` (a Task, or a built-in task's name), else one built from a
    user's ``loss_fn(outputs, targets)``, else the ``default`` name (the data's own task);
    ``metrics`` ({name: torchmetrics metric or callable}) are added to it."""
    if task is not None and loss_fn is not None:
        raise GpuaccelError("pass task= or loss_fn= (with metrics=), not both")
    if loss_fn is not None:
        return CustomTask(loss_fn, metrics)
    if isinstance(task, str) or task is None:
        name = task or default
        if name is None:
            raise GpuaccelError("with train_data= from Python, say what to minimise: task= (e.g. "
                                "gpuaccel.tasks.Regression()) or loss_fn=")
        task = create_task(name, **settings)
    if not isinstance(task, Task):
        raise GpuaccelError(f"task= takes a gpuaccel.tasks.Task or a task name, not {type(task).__name__}")
    if type(task).loss is Task.loss:
        raise GpuaccelError(f"task {task.name!r} defines no loss; give it a loss() or pass loss_fn=")
    return task.with_metrics(metrics) if metrics else task


__all__ = ["Accuracy", "BatchMean", "Classification", "CustomTask", "Detection", "LanguageModelling", "Metric", "MetricTracker",
           "MultiLabel", "Ranking", "Regression", "Segmentation", "TASKS", "Translation", "Task", "as_metric", "call_model", "create_task",
           "resolve_task", "task_of", "SCENE_TASKS"]
