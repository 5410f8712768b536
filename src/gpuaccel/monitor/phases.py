"""Where a command's wall-clock time goes, phase by phase, from the start of its process:
the interpreter and imports before gpuaccel's trainer runs, CUDA's initialisation, reading the
data, building the model, the warm-up, training, evaluations and checkpoints, the final save.
A run's summary carries the table (``phases``), so that a slow command says why."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

BEFORE = "start-up (interpreter, imports, command line)"


def process_age() -> float | None:
    """Seconds since this process started (from /proc on Linux), or None where it cannot be told."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # (the command name may hold spaces)
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22: start time, in clock ticks
    except (OSError, ValueError, IndexError):
        return None


class PhaseClock:
    """Seconds per phase: ``mark(phase)`` charges the time since the previous mark to ``phase``."""

    def __init__(self, since_process_start: bool = True):
        """``since_process_start``: the first phase is the process's life before this clock
        (:data:`BEFORE`); else the clock times only what is marked after it starts."""
        self.phases: dict[str, float] = {}
        age = process_age() if since_process_start else None
        if age is not None:
            self.phases[BEFORE] = age
        self._last = time.perf_counter()

    def mark(self, phase: str) -> None:
        now = time.perf_counter()
        self.add(phase, now - self._last)
        self._last = now

    def add(self, phase: str, seconds: float) -> None:
        self.phases[phase] = self.phases.get(phase, 0.0) + max(0.0, seconds)

    def restart(self) -> None:
        """The next mark measures from now (after time charged with ``add``)."""
        self._last = time.perf_counter()

    def table(self) -> dict[str, float]:
        return {name: round(seconds, 3) for name, seconds in self.phases.items()}


@dataclass
class SetupTimes:
    """A trainer's time before its training clock starts: the set-up phase by phase (``phases``,
    then on through the run), its total, the warm-up's total and parts, and with several
    processes each one's phases until the warm-up (the slowest holds the rest there)."""

    phases: PhaseClock = field(default_factory=PhaseClock)
    setup_seconds: float = 0.0
    warmup_seconds: float = 0.0
    warmup_phases: dict[str, float] = field(default_factory=dict)
    setup_by_process: list[dict[str, float]] = field(default_factory=list)
