"""Around the training loop: the training clock (evaluations and checkpoints are not training
time), one ``fit``'s meters and its evaluate-and-log step, and the context that holds them:
SIGTERM stops like Ctrl-C, the collector leaves the warm-up's objects alone, the run
directory is released at the end."""

from __future__ import annotations

import contextlib
import gc
import signal
import time

import torch

from ..device import synchronize
from ..files import MetricsFile
from ..monitor.profiling import ScalarLog, StepProfiler
from .progress import Progress
from .summary import format_record


class Stop(Exception):
    """Raised by a signal handler so that SIGTERM stops training like Ctrl-C does."""


class TrainingClock:
    """The training clock, and what was trained since the last evaluation: the loss summed on the
    device, the samples, the seconds. Evaluations and checkpoints are not training time."""

    def __init__(self, trained_before: float):
        self.loss_sum: torch.Tensor | None = None
        self.samples = 0
        self.trained_before = trained_before  # (a resumed run's earlier segments)
        self.trained = 0.0  # this process's training seconds, finished segments
        self.segment_start = time.perf_counter()

    def add(self, loss: torch.Tensor, samples: int) -> None:
        self.loss_sum = loss.detach().clone() if self.loss_sum is None else self.loss_sum.add_(loss)
        self.samples += samples

    def training_seconds(self) -> float:
        return self.trained_before + self.trained + time.perf_counter() - self.segment_start

    def end_segment(self) -> float:
        """Ends the current stretch of training (the caller has synchronised the device)."""
        self.trained += time.perf_counter() - self.segment_start
        return self.trained_before + self.trained

    def start_segment(self) -> None:
        self.segment_start = time.perf_counter()

    @contextlib.contextmanager
    def paused(self):
        pause = time.perf_counter()
        yield
        self.segment_start += time.perf_counter() - pause


class FitContext:
    """One ``fit``'s meters (data wait, GPU samples, profiler, TensorBoard scalars) and its
    evaluate-and-log step, with the collector's view of the warm-up's objects frozen."""

    def __init__(self, trainer, progress: Progress, clock: TrainingClock):
        cfg, main = trainer.config, trainer.dist.is_main
        self.trainer, self.progress, self.clock = trainer, progress, clock
        self.metrics = MetricsFile(trainer.run_dir / "metrics.jsonl") if main else None
        self.wall_start = time.perf_counter()
        # the accelerator's GPU sampler and data-wait meter: read at each evaluation through its stats()
        self.sampler = trainer.acc.monitor(trainer.run_dir / f"gpu{'' if main else trainer.dist.rank}.jsonl",
                                           origin=self.wall_start) if cfg.logging.monitor else None
        self.profiler = StepProfiler(trainer.run_dir, trainer.device, *cfg.logging.profile_window) \
            if cfg.logging.profile and main else None
        self.scalars = ScalarLog(trainer.run_dir) if cfg.logging.tensorboard and main else None
        self.seconds_at_eval = trainer.state.train_seconds
        self.evaluation_seconds = 0.0  # the last evaluation's duration
        self.steps = 0  # optimizer steps taken in this fit
        self._stepped_at, self.last_step_seconds = clock.training_seconds(), 0.0
        self.wall_seconds = 0.0
        self._started = None  # an epoch's batches started ahead and not yet taken
        # Compilation leaves millions of long-lived objects behind; the collector's full passes
        # over them would stall the training and pipeline threads mid-epoch. Frozen, they are
        # skipped (as long-running servers do); the garbage made before is collected first.
        # Whatever was frozen before is thawed with them at the end: freezing is only a hint to
        # the collector, and Python 3.12 itself starts with 375 objects frozen, so leaving the
        # freeze to a caller who had frozen objects turned it off in every 3.12 process.
        gc.collect()
        gc.freeze()

    def stepped(self) -> None:
        self.steps += 1
        now = self.clock.training_seconds()  # (evaluations and checkpoints between steps are not counted)
        self.last_step_seconds, self._stepped_at = now - self._stepped_at, now
        self.progress.advance()
        if self.profiler is not None:
            self.profiler.step()

    def time_reserve(self) -> float:
        """What ``--time-limit`` keeps free after the training so far: the final evaluation (as
        long as the last one; before any, an estimate: each held-out batch's forward pass at a
        third of a training step) and one more step, since a step begun before the limit ends
        after it."""
        trained = self.clock.trained + time.perf_counter() - self.clock.segment_start  # (this fit's)
        step = max(trained / max(1, self.steps), self.last_step_seconds)  # (the last, where steps slow down)
        evaluation = self.evaluation_seconds or len(self.trainer.eval_loader) * step / 3
        return evaluation + step

    def started(self, batches):
        self._started = batches
        return batches

    def evaluate_and_log(self) -> dict:
        """Evaluates, appends the record to metrics.jsonl and prints it; the time it takes is not
        training time."""
        trainer, clock = self.trainer, self.clock
        synchronize(trainer.device)
        trainer.state.train_seconds = clock.end_segment()
        loss_sum = clock.loss_sum if clock.loss_sum is not None else torch.zeros((), device=trainer.device)
        started = time.perf_counter()
        record = trainer.evaluate_and_record(loss_sum, clock.samples, trainer.state.train_seconds - self.seconds_at_eval,
                                             time.perf_counter() - self.wall_start)
        self.evaluation_seconds = time.perf_counter() - started  # (--time-limit keeps this much for the last one)
        measured = trainer.acc.stats()  # (since the previous evaluation)
        record["data_wait"] = measured["data_wait_share"]
        if measured["gpu_util"] is not None:  # (with --monitor on a GPU)
            record["gpu_util"] = measured["gpu_util"]
        if self.metrics is not None:
            self.metrics.append(record)
        if self.scalars is not None:
            self.scalars.add(record, trainer.state.global_step)
        self.progress.log(format_record(record, trainer.config.loop.epochs, trainer.metric_tracker.metrics,
                                        trainer.inputs.unit))
        clock.loss_sum, clock.samples = None, 0
        self.seconds_at_eval = trainer.state.train_seconds
        clock.start_segment()
        return record

    def close(self) -> None:
        trainer = self.trainer
        synchronize(trainer.device)
        trainer.state.train_seconds = max(trainer.state.train_seconds, self.clock.trained_before + self.clock.trained)
        self.wall_seconds = time.perf_counter() - self.wall_start
        if self._started is not None and hasattr(self._started, "close"):
            self._started.close()  # started for an epoch that the run did not reach
        stop_readers(trainer)
        gc.unfreeze()
        for meter in (self.sampler, self.profiler, self.scalars):
            if meter is not None:
                (meter.stop if meter is self.sampler else meter.close)()


def stop_readers(trainer) -> None:
    """Stops the loaders' reader processes with the run, not when the collector finds the trainer:
    a DataLoader iterator collected in a reference cycle has its queues finalised first, so its
    workers never hear the stop and PyTorch waits 5 s for each (70 s for 14 of them)."""
    for loader in (trainer.train_loader, trainer.eval_loader):
        stop = getattr(loader, "stop_workers", None)
        if stop is not None:
            stop()


def install_sigterm():
    """SIGTERM (what torchrun and schedulers send) checkpoints and stops, like Ctrl-C."""
    def handler(signum, frame):
        raise Stop()
    try:
        return signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread: leave signals alone
        return None


@contextlib.contextmanager
def signals_held():
    """Ctrl-C and SIGTERM wait until the block ends (a checkpoint being written): an exception
    raised inside torch.save leaves its zip writer to fail on closing, and that error would
    replace the stop. A signal that came is raised again after, to its own handler."""
    came = []
    try:
        previous = {s: signal.signal(s, lambda signum, frame: came.append(signum))
                    for s in (signal.SIGINT, signal.SIGTERM)}
    except ValueError:  # not the main thread: signals do not reach it anyway
        yield
        return
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, signal.SIG_DFL if handler is None else handler)  # (None: not set from Python)
        for s in dict.fromkeys(came):
            signal.raise_signal(s)


@contextlib.contextmanager
def fit_context(trainer, progress: Progress, clock: "TrainingClock"):
    """Around the loop: SIGTERM stops like Ctrl-C (a checkpoint, then KeyboardInterrupt), the
    long-lived objects frozen for the collector, the meters running; all put back after."""
    context = FitContext(trainer, progress, clock)
    previous_handler = install_sigterm()
    trainer.model.train()
    clock.start_segment()
    try:
        yield context
    except (KeyboardInterrupt, Stop):
        # batches taken since the last optimizer step are not in the weights: the position is
        # that of the last step, so a resume redoes them
        trainer.optimizer.zero_grad(set_to_none=True)
        if trainer.dist.is_main and not trainer.collective_state:  # (other ranks cannot be relied on to stop together)
            trainer.save_checkpoint()
        progress.close()
        trainer.step.release()
        raise KeyboardInterrupt(str(trainer.run_dir)) from None
    finally:
        context.close()
        trainer.run.unlock()
        if previous_handler is not None:
            signal.signal(signal.SIGTERM, previous_handler)
    progress.close()

