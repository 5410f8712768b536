"""When, between optimizer steps, a run evaluates, saves a checkpoint and stops."""

from __future__ import annotations

import time

import torch

from ..parallel import Distributed
from .config import TrainConfig


class Cadence:
    def __init__(self, config: TrainConfig, dist: Distributed, device: torch.device,
                 collective_checkpoints: bool = False):
        """``collective_checkpoints``: every rank writes its part of a checkpoint (sharded state:
        FSDP, pipeline stages, sharded embedding tables), so they must all decide to write one."""
        self.config, self.dist, self.device = config, dist, device
        self.collective = collective_checkpoints and dist.active
        self.last_checkpoint = time.perf_counter()

    def evaluation_due(self, step: int, end_of_epoch: bool, finished: bool) -> bool:
        """At each epoch's end (or every ``eval_every`` steps), and at the end of training."""
        every = self.config.eval_every
        return finished or (end_of_epoch if every is None else step % every == 0)

    def out_of_time(self, step: int, elapsed: float) -> bool:
        """``elapsed`` seconds of training reached ``time_limit``. Ranks must agree on stopping, so the
        clock of any one of them decides; that takes an all-reduce and a host synchronisation, so
        several processes check every 16 steps, not every one."""
        limit = self.config.time_limit
        if limit is None or (self.dist.active and step % 16):
            return False
        return self.dist.any(elapsed >= limit, self.device)

    def checkpoint_due(self, step: int, epoch: int, end_of_epoch: bool, last: bool) -> bool:
        """At the end (``last``), at epoch ends every ``checkpoint_epochs`` epochs, every
        ``checkpoint_every`` steps, and after ``checkpoint_seconds`` since the last one."""
        config = self.config
        return last or (end_of_epoch and bool(config.checkpoint_epochs) and epoch % config.checkpoint_epochs == 0) \
            or (config.checkpoint_every is not None and step % config.checkpoint_every == 0) \
            or self._checkpoint_time(step)

    def _checkpoint_time(self, step: int) -> bool:
        """``checkpoint_seconds`` passed since the last checkpoint. Each rank's clock differs a
        little: where every rank takes part in the write, one deciding alone would wait in the
        write's collective for ranks still training. So, as for stopping, any one's clock
        decides, checked every 16 steps (an all-reduce and a host synchronisation)."""
        due = time.perf_counter() - self.last_checkpoint >= self.config.checkpoint_seconds
        if not self.collective:
            return due
        return step % 16 == 0 and self.dist.any(due, self.device)

    def checkpointed(self) -> None:
        self.last_checkpoint = time.perf_counter()
