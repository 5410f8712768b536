"""What a run prints while it trains."""

from __future__ import annotations

import sys


class Progress:
    """A progress bar (step, loss, img/s, ETA) on a terminal, one line per evaluation elsewhere.

    Everything goes to stderr so that ``--json`` output on stdout stays parseable.
    """

    def __init__(self, total_steps: int, initial: int = 0, quiet: bool = False, stream=None):
        self.stream = stream or sys.stderr
        self.quiet = quiet
        self.bar = None
        if not quiet and self.stream.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, initial=initial, unit="step", dynamic_ncols=True,
                            file=self.stream, leave=False)

    def advance(self, steps: int = 1, **postfix) -> None:
        if self.bar is not None:
            self.bar.update(steps)
            if postfix:
                self.bar.set_postfix(postfix, refresh=False)

    def log(self, line: str) -> None:
        if self.quiet:
            return
        if self.bar is not None:
            self.bar.write(line, file=self.stream)
        else:
            print(line, file=self.stream, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
