"""Times a training script from inside it, the same way in every variant of the script.

Each ported script calls ``steptimer.tick(loss, samples)`` once per training step (one line
added to the original, before any port). After ``STEPTIMER_WARMUP`` steps (compilation,
cuDNN's autotuning, a captured step's warm-up and recording) the clock starts, after a
device synchronisation; after ``STEPTIMER_STEPS`` more it stops after another, writes one
JSON line (steps/s, samples/s, the mean training loss of the timed steps) to
``STEPTIMER_OUT`` (or standard output) and ends the process.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

WARMUP = int(os.environ.get("STEPTIMER_WARMUP", "50"))
STEPS = int(os.environ.get("STEPTIMER_STEPS", "300"))
_state = {"calls": 0, "start": None, "samples": 0, "losses": []}


def _synchronize() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def tick(loss=None, samples: int = 0) -> None:
    """One training step has been launched; ``loss`` (a tensor or a number) is its loss."""
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


def _finish() -> None:
    _synchronize()
    seconds = time.perf_counter() - _state["start"]
    losses = [float(x) for x in _state["losses"]]
    result = {"label": os.environ.get("STEPTIMER_LABEL"), "steps": STEPS, "seconds": round(seconds, 4), "steps_per_second": round(STEPS / seconds, 2),
              "samples_per_second": round(_state["samples"] / seconds, 1),
              "mean_loss": round(sum(losses) / len(losses), 5) if losses else None,
              "last_loss": round(losses[-1], 5) if losses else None,
              "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
              "torch": torch.__version__}
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
