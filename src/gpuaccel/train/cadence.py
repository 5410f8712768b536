"""When, between optimizer steps, a run evaluates, saves a checkpoint and stops."""

from __future__ import annotations

import time

import torch

from ..parallel import Distributed
from ..parallel.distributed import PendingFlag
from .config import TrainConfig


class Cadence:
    def __init__(self, config: TrainConfig, dist: Distributed, device: torch.device,
                 collective_checkpoints: bool = False):
        """``collective_checkpoints``: every rank writes its part of a checkpoint (sharded state:
        FSDP, pipeline stages, sharded embedding tables), so they must all decide to write one."""
        self.config, self.dist, self.device = config, dist, device
        self.collective = collective_checkpoints and dist.active
        self.last_checkpoint = time.perf_counter()
        self._verdicts: dict[str, PendingFlag] = {}  # each clock's verdict agreed at its last check

    def evaluation_due(self, step: int, end_of_epoch: bool, finished: bool) -> bool:
        """At each epoch's end (or every ``eval_every`` steps), and at the end of training."""
        every = self.config.loop.eval_every
        return finished or (end_of_epoch if every is None else step % every == 0)

    def out_of_time(self, step: int, elapsed: float) -> bool:
        """``elapsed`` seconds of training reached ``time_limit``; ranks must agree on stopping."""
        limit = self.config.loop.time_limit
        return limit is not None and self._any_clock("time limit", step, elapsed >= limit)

    def _any_clock(self, name: str, step: int, passed: bool) -> bool:
        """Where ranks must take the same branch on a clock (each rank's differs a little), the
        clock of any one of them decides. Every 16 steps each rank sends its clock's verdict and
        reads the verdict agreed at the check before (every rank the same, at the same step):
        reading the one just sent would make the host wait for the GPU's whole queue, and the
        GPU then idle while the host launches the next steps. A decision comes 16 steps late."""
        if not self.dist.active:
            return passed
        if step % 16:
            return False
        before = self._verdicts.get(name)
        self._verdicts[name] = self.dist.start_any(passed, self.device)
        return before is not None and before.result()

    def checkpoint_due(self, step: int, epoch: int, end_of_epoch: bool, last: bool) -> bool:
        """At the end (``last``), at epoch ends every ``checkpoint_epochs`` epochs, every
        ``checkpoint_every`` steps, and after ``checkpoint_seconds`` since the last one."""
        logging = self.config.logging
        return last or (end_of_epoch and bool(logging.checkpoint_epochs) and epoch % logging.checkpoint_epochs == 0) \
            or (logging.checkpoint_every is not None and step % logging.checkpoint_every == 0) \
            or self._checkpoint_time(step)

    def _checkpoint_time(self, step: int) -> bool:
        """``checkpoint_seconds`` passed since the last checkpoint. Where every rank takes part in
        the write, one deciding alone would wait in the write's collective for ranks still
        training: they agree, as on stopping."""
        due = time.perf_counter() - self.last_checkpoint >= self.config.logging.checkpoint_seconds
        return self._any_clock("checkpoint", step, due) if self.collective else due

    def checkpointed(self) -> None:
        self.last_checkpoint = time.perf_counter()
        self._verdicts.pop("checkpoint", None)  # (sent before this checkpoint: every rank drops it)
