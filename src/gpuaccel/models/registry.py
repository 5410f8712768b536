"""``create_model(name, ...)``: one entry point for built-in, user and timm models.

A factory declares the keywords it needs (``num_classes``, ``in_channels``,
``image_size``, ...) and gets those the data offers, so a model is chosen by name alone
and the data set supplies the rest.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch.nn as nn

from ..errors import GpuaccelError, choice_error

_REGISTRY: dict[str, Callable[..., nn.Module]] = {}
_BUILT_ON_DEVICE: set[str] = set()


def register_model(name: str, *, builds_on_device: bool = False):
    """Decorator: ``@register_model("resnet18")`` over a factory taking any of the offered keywords
    (``num_classes``, ``in_channels``, ``image_size``, ...). ``builds_on_device``: the factory may
    run under a ``torch.device`` context, making its parameters (and drawing their initial values)
    on the device that trains them (:func:`builds_on_device`)."""
    def add(factory):
        _REGISTRY[name] = factory
        if builds_on_device:
            _BUILT_ON_DEVICE.add(name)
        return factory
    return add


def list_models() -> list[str]:
    return sorted(_REGISTRY)


def builds_on_device(name: str) -> bool:
    """Whether the registered model ``name`` may be built on its GPU directly. Why: drawing a large
    model's initial values on the host and then copying them over is most of what building it
    costs (GPT-2 small's 124 M normal draws: about a second on a 2-core CPU; building and placing
    it took 0.67-1.09 s on an H200's host, 0.09-0.14 s built on the GPU, docs/results.md). Opt-in,
    per model: built in place, a model's initial values come from the GPU's random generator, not
    the host's (the same for a seed on every run on that kind of device)."""
    return name in _BUILT_ON_DEVICE


def create_model(name: str, num_classes: int = 10, in_channels: int = 3, image_size: int = 32, *,
                 required: tuple[str, ...] = (), **kwargs) -> nn.Module:
    """Builds a model by name: a registered one (``list_models()``), ``package.module:factory``
    for a user's own, or ``timm:<name>`` when timm is installed.

    The data offers ``num_classes``, ``in_channels`` and ``image_size`` (and a task may offer
    more, e.g. ``vocab_size``); a factory gets those of them it accepts, so a model that has
    no use for ``image_size`` need not take it. The keywords in ``required`` (a user's own
    model arguments) must be ones the factory takes."""
    offered = dict(num_classes=num_classes, in_channels=in_channels, image_size=image_size, **kwargs)
    if name.startswith("timm:"):
        return _create_timm(name[5:], num_classes, in_channels, **{k: offered[k] for k in required})
    if ":" in name:
        return _checked(name, _call_with_accepted(_import_factory(name), offered, required, name))
    if name not in _REGISTRY:
        raise choice_error("model", name, list_models() + ["package.module:factory", "timm:<name>"])
    return _call_with_accepted(_REGISTRY[name], offered, required, name)


def _call_with_accepted(factory: Callable[..., nn.Module], offered: dict, required=(), name: str = "") -> nn.Module:
    params = inspect.signature(factory).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    unknown = [k for k in required if not (takes_any or k in params)]
    if unknown:
        accepted = [p for p in params if p not in ("num_classes", "in_channels", "image_size", "vocab_size")]
        raise GpuaccelError(f"model {name} takes no argument(s) {', '.join(unknown)}; it takes: "
                            f"{', '.join(accepted) or 'none'}")
    try:
        return factory(**{k: v for k, v in offered.items() if takes_any or k in params})
    except TypeError as exc:
        if required:  # a user's argument of the wrong type, most likely
            raise GpuaccelError(f"model {name}: {exc}") from None
        raise


def model_source_dir(spec: str) -> str | None:
    """For ``package.module:factory``: the directory its top package is imported from, which a
    run records so that resuming, exporting or inferring from another directory finds it."""
    if ":" not in spec or spec.startswith("timm:"):
        return None
    module_name = spec.partition(":")[0]
    module = _import_module(module_name, spec)
    file = getattr(module, "__file__", None)
    if file is None:
        return None
    root = Path(file).resolve().parent
    for _ in range(module_name.count(".") + (Path(file).name == "__init__.py")):
        root = root.parent
    return str(root)


def _import_module(module_name: str, spec: str, search: str | None = None):
    """Imports ``module_name``, also from ``search`` and the working directory (what
    ``python -m`` would find), which gpuaccel puts on the path itself."""
    for directory in (search, os.getcwd()):
        if directory and directory not in sys.path:
            sys.path.insert(0, directory)
    try:
        return importlib.import_module(module_name)
    except ImportError as exc:
        raise GpuaccelError(f"cannot import {module_name!r} for model {spec!r}: {exc}") from None


def _import_factory(spec: str, search: str | None = None) -> Callable[..., nn.Module]:
    module_name, _, attr = spec.partition(":")
    factory = getattr(_import_module(module_name, spec, search), attr, None)
    if not callable(factory):
        raise GpuaccelError(f"{module_name} has no callable {attr!r} (model spec {spec!r})")
    return factory


def add_search_dir(directory: str | None) -> None:
    """Puts a recorded model source directory on the import path (see :func:`model_source_dir`)."""
    if directory and Path(directory).is_dir() and directory not in sys.path:
        sys.path.insert(0, directory)


def _checked(spec: str, model) -> nn.Module:
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
