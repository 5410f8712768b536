"""Where a training run stands and what it has achieved: its place in the data order, the samples
and seconds it has trained, and its evaluations. One object, so that a checkpoint saves it and a
resume puts it back whole (a checkpoint's "position" and "progress"), and the loop is the one
place that moves it on."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RunState:
    epoch: int = 0
    batch_in_epoch: int = 0
    global_step: int = 0  # optimizer steps taken
    samples_seen: int = 0  # by all processes together
    train_seconds: float = 0.0
    last_eval: dict = field(default_factory=dict)
    evaluated_at: int = 0  # the global step of the last finished evaluation
    best_metrics: dict[str, float] = field(default_factory=dict)  # each metric's best value so far
    best_step: int | None = None  # the step of the best evaluation (by the target's metric, else the task's main one)
    time_to_target: float | None = None  # training seconds when the target was first reached
    resumed: bool = False
    # the weights of the best evaluation since the last checkpoint, on the host, until written to
    # best.pt (not part of a checkpoint's progress: best.pt holds them)
    best_weights: dict | None = None
    best_copies: object | None = None  # on a GPU: the page-locked buffers they are copied into (device.PinnedCopies)

    def position(self) -> dict:
        return {"epoch": self.epoch, "batch_in_epoch": self.batch_in_epoch, "global_step": self.global_step}

    def progress(self) -> dict:
        return {"train_seconds": self.train_seconds, "samples_seen": self.samples_seen,
                "best_metrics": self.best_metrics, "time_to_target": self.time_to_target,
                "last_eval": self.last_eval, "evaluated_at": self.evaluated_at, "best_step": self.best_step}

    def load(self, position: dict, progress: dict) -> None:
        """Puts back what :meth:`position` and :meth:`progress` saved (checkpoints of earlier
        versions lack ``evaluated_at`` and ``best_step``)."""
        self.epoch, self.batch_in_epoch = position["epoch"], position["batch_in_epoch"]
        self.global_step = position["global_step"]
        self.train_seconds, self.samples_seen = progress["train_seconds"], progress["samples_seen"]
        self.best_metrics, self.time_to_target = progress["best_metrics"], progress["time_to_target"]
        self.last_eval = progress["last_eval"]
        self.evaluated_at = progress.get("evaluated_at", self.global_step)
        self.best_step = progress.get("best_step")

    def evaluated(self, result: dict, ranked_by: str, higher_is_better, reached_target: bool) -> bool:
        """Records an evaluation at the current step: the last one, each metric's best value, and
        the training time at which the target was first reached. True where it is the best
        evaluation so far by ``ranked_by`` (``higher_is_better(name)`` says which way is better)."""
        self.last_eval, self.evaluated_at = result, self.global_step
        best = self.best_metrics
        value = result.get(ranked_by)
        improved = value is not None and (ranked_by not in best or (
            value > best[ranked_by] if higher_is_better(ranked_by) else value < best[ranked_by]))
        for name, value in result.items():
            best[name] = (max if higher_is_better(name) else min)(best.get(name, value), value)
        if self.time_to_target is None and reached_target:
            self.time_to_target = self.train_seconds
        return improved

    def stepped(self, batches: int, samples: int, batches_per_epoch: int) -> bool:
        """Counts one optimizer step over ``batches`` micro-batches of ``samples`` samples (all
        processes); True where it ended an epoch (the position then moves to the next one)."""
        self.samples_seen += samples
        self.batch_in_epoch += batches
        self.global_step += 1
        if self.batch_in_epoch == batches_per_epoch:
            self.epoch, self.batch_in_epoch = self.epoch + 1, 0
            return True
        return False
