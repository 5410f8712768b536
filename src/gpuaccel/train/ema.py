"""An exponential moving average of a model's weights, for evaluation.

``torch.optim.swa_utils.AveragedModel`` reads a device counter on the host at every
update (a synchronisation per step), so this keeps its own step count on the host
and updates all floating-point parameters and buffers with one fused lerp.
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn


class WeightAverage:
    def __init__(self, model: nn.Module, decay: float, device: torch.device | None = None):
        self.module = copy.deepcopy(model).eval()
        for p in self.module.parameters():
            p.requires_grad_(False)
        self.decay = decay
        self.updates = 0
        self._tensors = None  # (ours, theirs) float tensors and other tensors, found once
        # the model's weight in the next blend, where a step reads it on the device (a CUDA graph)
        self.weight = torch.zeros((), device=device)

    def _pair_up(self, model: nn.Module):
        # state_dict() returns the same tensor objects every time (loading copies in place)
        ours = list(self.module.state_dict().values())
        theirs = [t.detach() for t in model.state_dict().values()]
        floats = [i for i, t in enumerate(ours) if t.is_floating_point()]
        others = [i for i, t in enumerate(ours) if not t.is_floating_point()]
        return ([ours[i] for i in floats], [theirs[i] for i in floats],
                [ours[i] for i in others], [theirs[i] for i in others])

    def advance(self) -> float:
        """Counts one update and returns the weight it gives the model: 1 - decay, where the
        decay starts at (1+n)/(10+n), so the average never clings to the random initialisation."""
        self.updates += 1
        return 1.0 - min(self.decay, (1 + self.updates) / (10 + self.updates))

    def advance_weight(self) -> torch.Tensor:
        """:meth:`advance`, written into :attr:`weight` (the same tensor every time), for a step
        that blends with it on the device: ``blend(model, average.weight)``."""
        self.weight.fill_(self.advance())
        return self.weight

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        self.blend(model, self.advance())

    @torch.no_grad()
    def blend(self, model: nn.Module, weight: float | torch.Tensor) -> None:
        """average += weight * (model - average). A tensor ``weight`` is read on the device, as a
        CUDA graph needs (the foreach lerp takes only a host number)."""
        if self._tensors is None:
            self._tensors = self._pair_up(model)
        ours, theirs, our_counts, their_counts = self._tensors
        if isinstance(weight, torch.Tensor):
            deltas = torch._foreach_sub(theirs, ours)
            torch._foreach_mul_(deltas, weight)
            torch._foreach_add_(ours, deltas)
        else:
            torch._foreach_lerp_(ours, theirs, weight)
        for a, b in zip(our_counts, their_counts):  # e.g. batch norm's step counters
            a.copy_(b)

    def state_dict(self) -> dict:
        return {"module": self.module.state_dict(), "updates": self.updates}

    def load_state_dict(self, state: dict) -> None:
        self.module.load_state_dict(state["module"])
        self.updates = state["updates"]
