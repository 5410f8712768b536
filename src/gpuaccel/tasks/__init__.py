"""Tasks: what a kind of problem brings to training (loss, metrics, evaluation).

``Classification``, ``Regression``, ``LanguageModelling`` and ``Ranking`` are built in; ``CustomTask(loss_fn, metrics)`` wraps
a user's own. ``create_task(name, **settings)`` builds one by name (the ``task`` setting).
"""

from ..errors import choice_error
from .base import Accuracy, BatchMean, CustomTask, Metric, MetricTracker, Task, as_metric, call_model
from .classification import Classification
from .language import LanguageModelling
from .ranking import Ranking
from .regression import Regression

TASKS = {"classification": Classification, "regression": Regression,
         "language_modelling": LanguageModelling, "ranking": Ranking}


def create_task(name: str, **settings) -> Task:
    """A built-in task by name, given the settings its constructor takes (others are ignored)."""
    import inspect

    if name not in TASKS:
        raise choice_error("task", name, sorted(TASKS))
    cls = TASKS[name]
    accepted = inspect.signature(cls).parameters
    return cls(**{k: v for k, v in settings.items() if k in accepted})


__all__ = ["Accuracy", "BatchMean", "Classification", "CustomTask", "LanguageModelling", "Metric", "MetricTracker",
           "Ranking", "Regression", "TASKS", "Task", "as_metric", "call_model", "create_task"]
