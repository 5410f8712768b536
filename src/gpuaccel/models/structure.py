"""A model's layer widths, recorded and re-applied.

A channel-pruned model no longer matches its registry definition, so its checkpoint
carries ``structure``: the widths of every convolution, linear and batch-norm layer.
``apply_structure`` reshapes a freshly created model to those widths before its weights
are loaded (the trainer does this on resume, deploy/ on export and inference).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ..errors import GpuaccelError

_SHAPED = (nn.Conv2d, nn.Linear, nn.BatchNorm2d, nn.BatchNorm1d)


def layer_structure(model: nn.Module) -> dict[str, dict]:
    """The width attributes of every convolution, linear and batch-norm layer, by module name."""
    structure = {}
    for name, m in model.named_modules():
        if isinstance(m, nn.Conv2d):
            structure[name] = {"in_channels": m.in_channels, "out_channels": m.out_channels, "groups": m.groups}
        elif isinstance(m, nn.Linear):
            structure[name] = {"in_features": m.in_features, "out_features": m.out_features}
        elif isinstance(m, (nn.BatchNorm2d, nn.BatchNorm1d)):
            structure[name] = {"num_features": m.num_features}
    return structure


def apply_structure(model: nn.Module, structure: dict[str, dict]) -> nn.Module:
    """Reshapes ``model``'s layers in place to the widths in ``structure`` (new, uninitialised
    tensors: load the pruned weights next)."""
    for name, widths in structure.items():
        try:
            m = model.get_submodule(name)
        except AttributeError:
            raise GpuaccelError(f"the pruned structure names a layer {name!r} the model does not have") from None
        for attr, value in widths.items():
            setattr(m, attr, value)
        if isinstance(m, nn.Conv2d):
            _reshape(m, "weight", (m.out_channels, m.in_channels // m.groups, *m.kernel_size))
            _reshape(m, "bias", (m.out_channels,))
        elif isinstance(m, nn.Linear):
            _reshape(m, "weight", (m.out_features, m.in_features))
            _reshape(m, "bias", (m.out_features,))
        elif isinstance(m, (nn.BatchNorm2d, nn.BatchNorm1d)):
            for key in ("weight", "bias", "running_mean", "running_var"):
                _reshape(m, key, (m.num_features,))
    return model


def _reshape(module: nn.Module, key: str, shape: tuple) -> None:
    old = getattr(module, key, None)
    if old is None or tuple(old.shape) == tuple(shape):
        return
    new = torch.empty(shape, dtype=old.dtype, device=old.device)
    if isinstance(old, nn.Parameter):
        setattr(module, key, nn.Parameter(new, requires_grad=old.requires_grad))
    else:
        setattr(module, key, new)
