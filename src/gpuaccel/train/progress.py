"""What a run prints while it trains."""

from __future__ import annotations

import sys
import time

LINE_EVERY_SECONDS = 30.0


class Progress:
    """A progress bar (step, loss, img/s, ETA) on a terminal; elsewhere (a log file, a batch
    job's output) a line per evaluation and, between them, a line every ``every_seconds``
    (step, share done, steps/s, time left), so a long run's log shows it is alive.

    Everything goes to stderr so that ``--json`` output on stdout stays parseable.
    """

    def __init__(self, total_steps: int, initial: int = 0, quiet: bool = False, stream=None,
                 every_seconds: float = LINE_EVERY_SECONDS):
        self.stream = stream or sys.stderr
        self.quiet = quiet
        self.bar = None
        self.total, self.step, self.every = total_steps, initial, every_seconds
        self.time_left = None  # () -> seconds a time limit leaves, where one is set
        self._since, self._steps_since = time.monotonic(), 0
        if not quiet and self.stream.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, initial=initial, unit="step", dynamic_ncols=True,
                            file=self.stream, leave=False)

    def advance(self, steps: int = 1, **postfix) -> None:
        self.step += steps
        if self.bar is not None:
            self.bar.update(steps)
            if postfix:
                self.bar.set_postfix(postfix, refresh=False)
        elif not self.quiet:
            self._steps_since += steps
            now = time.monotonic()
            if now - self._since >= self.every:
                rate = self._steps_since / max(now - self._since, 1e-9)
                left = (self.total - self.step) / rate if rate > 0 else float("inf")
                if self.time_left is not None:
                    left = max(0.0, min(left, self.time_left()))
                self.log(f"step {self.step:,}/{self.total:,} ({100 * self.step / max(self.total, 1):.0f}%), "
                         f"{rate:,.1f} steps/s, about {_duration(left)} left")  # (log restarts the period)

    def log(self, line: str) -> None:
        if self.quiet:
            return
        self._since, self._steps_since = time.monotonic(), 0  # the next steady line a period after this one
        if self.bar is not None:
            self.bar.write(line, file=self.stream)
        else:
            print(line, file=self.stream, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _duration(seconds: float) -> str:
    if seconds == float("inf"):
        return "an unknown time"
    seconds = int(round(seconds))
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min" if seconds >= 3600 else \
        f"{seconds // 60} min {seconds % 60:02d} s" if seconds >= 60 else f"{seconds} s"
