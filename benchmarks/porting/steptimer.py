"""Times a training script from inside it, the same way in every variant of the script.

Each ported script calls ``steptimer.tick(loss, samples)`` once per training step (one line
added to the original, before any port). After ``STEPTIMER_WARMUP`` steps (compilation,
cuDNN's autotuning, a captured step's warm-up and recording) the clock starts, after a
device synchronisation; after ``STEPTIMER_STEPS`` more it stops after another, writes one
JSON line (steps/s, samples/s, the mean training loss of the timed steps) to
``STEPTIMER_OUT`` (or standard output) and ends the process.

Paired (``STEPTIMER_PAIR`` = ``first`` or ``second``, ``STEPTIMER_PAIR_DIR`` a folder holding two
FIFOs, ``first_to_second`` and ``second_to_first``): two variants of a script run at once and take
turns after their warm-ups, one timed step each, handing a baton through the FIFOs; each step
ends with a device synchronisation, so neither's GPU work overlaps the other's. Neighbouring steps
then ran milliseconds apart, under the same drift of the host, and each step's time is written
(``step_seconds``) for ``run_ports.py --paired`` to compare neighbours.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

WARMUP = int(os.environ.get("STEPTIMER_WARMUP", "50"))
STEPS = int(os.environ.get("STEPTIMER_STEPS", "300"))
PAIR = os.environ.get("STEPTIMER_PAIR")  # None, "first" or "second"
_state = {"calls": 0, "start": None, "samples": 0, "losses": [], "step_seconds": []}


class Baton:
    """Turns between two processes through two FIFOs: ``give`` lets the other run a step, ``take``
    waits for it to give the turn back. Opened in the same order by both, so neither blocks forever."""

    def __init__(self, folder: str, role: str):
        to_second, to_first = os.path.join(folder, "first_to_second"), os.path.join(folder, "second_to_first")
        if role == "first":
            self.out = os.open(to_second, os.O_WRONLY)
            self.inp = os.open(to_first, os.O_RDONLY)
        else:
            self.inp = os.open(to_second, os.O_RDONLY)
            self.out = os.open(to_first, os.O_WRONLY)

    def give(self) -> None:
        os.write(self.out, b"x")

    def take(self) -> None:
        if not os.read(self.inp, 1):
            raise RuntimeError("steptimer: the other process of the pair ended early")


def _synchronize() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def tick(loss=None, samples: int = 0) -> None:
    """One training step has been launched; ``loss`` (a tensor or a number) is its loss."""
    if PAIR:
        return _paired_tick(loss, samples)
    _state["calls"] += 1
    calls = _state["calls"]
    if calls == WARMUP:
        _synchronize()
        _state["start"] = time.perf_counter()
        return
    if calls <= WARMUP:
        return
    _state["samples"] += int(samples)
    if loss is not None:  # kept on the device: no synchronisation per step
        _state["losses"].append(loss.detach().float().clone() if isinstance(loss, torch.Tensor) else float(loss))
    if calls == WARMUP + STEPS:
        _finish()


def _paired_tick(loss, samples: int) -> None:
    _state["calls"] += 1
    calls = _state["calls"]
    if calls < WARMUP:
        return
    _synchronize()
    if calls == WARMUP:
        _state["baton"] = Baton(os.environ["STEPTIMER_PAIR_DIR"], PAIR)
        if PAIR == "second":
            _state["baton"].take()
        _state["start"] = _state["step_start"] = time.perf_counter()
        return
    _state["step_seconds"].append(round(time.perf_counter() - _state["step_start"], 7))
    _state["samples"] += int(samples)
    if loss is not None:
        _state["losses"].append(loss.detach().float().clone() if isinstance(loss, torch.Tensor) else float(loss))
    last = calls == WARMUP + STEPS
    if not (last and PAIR == "second"):  # the second's last step is the pair's last
        _state["baton"].give()
    if last:
        _finish(paired_seconds=sum(_state["step_seconds"]))  # (ends the process)
    _state["baton"].take()
    _state["step_start"] = time.perf_counter()


def _finish(paired_seconds: float | None = None) -> None:
    _synchronize()
    # paired: the process's own steps only, not the other's turns
    seconds = paired_seconds if paired_seconds is not None else time.perf_counter() - _state["start"]
    losses = [float(x) for x in _state["losses"]]
    result = {"label": os.environ.get("STEPTIMER_LABEL"), "steps": STEPS, "seconds": round(seconds, 4), "steps_per_second": round(STEPS / seconds, 2),
              "samples_per_second": round(_state["samples"] / seconds, 1),
              "mean_loss": round(sum(losses) / len(losses), 5) if losses else None,
              "last_loss": round(losses[-1], 5) if losses else None,
              "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
              "torch": torch.__version__}
    if PAIR:
        result.update(pair=PAIR, step_seconds=_state["step_seconds"])
    line = json.dumps(result)
    out = os.environ.get("STEPTIMER_OUT")
    if out:
        with open(out, "a") as f:
            f.write(line + "\n")
    else:
        print(line)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # the measurement is made; the rest of the script's epochs are not needed
