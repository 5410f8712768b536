"""``create_model(name, ...)``: one entry point for built-in, user and timm models.

Every factory takes the same keywords (``num_classes``, ``in_channels``, ``image_size``),
so a model is chosen by name alone and the data set supplies the rest.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable

import torch.nn as nn

from ..errors import GpuaccelError, choice_error

_REGISTRY: dict[str, Callable[..., nn.Module]] = {}


def register_model(name: str):
    """Decorator: ``@register_model("resnet18")`` over a factory(num_classes, in_channels, image_size)."""
    def add(factory):
        _REGISTRY[name] = factory
        return factory
    return add


def list_models() -> list[str]:
    return sorted(_REGISTRY)


def create_model(name: str, num_classes: int = 10, in_channels: int = 3, image_size: int = 32, **kwargs) -> nn.Module:
    """Builds a model by name: a registered one (``list_models()``), ``package.module:factory``
    for a user's own, or ``timm:<name>`` when timm is installed."""
    if name.startswith("timm:"):
        return _create_timm(name[5:], num_classes, in_channels, **kwargs)
    if ":" in name:
        return _create_user(name, num_classes, in_channels, image_size, **kwargs)
    if name not in _REGISTRY:
        raise choice_error("model", name, list_models() + ["package.module:factory", "timm:<name>"])
    return _REGISTRY[name](num_classes=num_classes, in_channels=in_channels, image_size=image_size, **kwargs)


def _create_user(spec: str, num_classes: int, in_channels: int, image_size: int, **kwargs) -> nn.Module:
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise GpuaccelError(f"cannot import {module_name!r} for model {spec!r}: {exc}") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise GpuaccelError(f"{module_name} has no callable {attr!r} (model spec {spec!r})")
    offered = dict(num_classes=num_classes, in_channels=in_channels, image_size=image_size, **kwargs)
    params = inspect.signature(factory).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    model = factory(**{k: v for k, v in offered.items() if takes_any or k in params})
    if not isinstance(model, nn.Module):
        raise GpuaccelError(f"{spec} returned {type(model).__name__}, not a torch.nn.Module")
    return model


def _create_timm(name: str, num_classes: int, in_channels: int, **kwargs) -> nn.Module:
    try:
        import timm
    except ImportError:
        raise GpuaccelError("timm models need the timm package: pip install timm") from None
    if not timm.list_models(name):
        raise GpuaccelError(f"timm has no model {name!r}; see timm.list_models()")
    return timm.create_model(name, pretrained=False, num_classes=num_classes, in_chans=in_channels, **kwargs)
