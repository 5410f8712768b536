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
    def __init__(self, model: nn.Module, decay: float):
        self.module = copy.deepcopy(model).eval()
        for p in self.module.parameters():
            p.requires_grad_(False)
        self.decay = decay
        self.updates = 0

    def _pairs(self, model: nn.Module):
        ours = list(self.module.state_dict().values())
        theirs = list(model.state_dict().values())
        floats = [(a, b) for a, b in zip(ours, theirs) if a.is_floating_point()]
        others = [(a, b) for a, b in zip(ours, theirs) if not a.is_floating_point()]
        return floats, others

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        """Early on the average follows the model closely (decay (1+n)/(10+n)), so it is
        never dominated by the random initialisation."""
        self.updates += 1
        decay = min(self.decay, (1 + self.updates) / (10 + self.updates))
        floats, others = self._pairs(model)
        torch._foreach_lerp_([a for a, _ in floats], [b.detach() for _, b in floats], 1.0 - decay)
        for a, b in others:  # e.g. batch norm's step counters
            a.copy_(b)

    def state_dict(self) -> dict:
        return {"module": self.module.state_dict(), "updates": self.updates}

    def load_state_dict(self, state: dict) -> None:
        self.module.load_state_dict(state["module"])
        self.updates = state["updates"]
