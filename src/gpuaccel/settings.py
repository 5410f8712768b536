"""How a training setting is declared, once: by the sections of train/config.py, and by each
data kind for the settings only it reads (``DataKind.options``, data/kinds.py). The command
line, recipes and ``config.json`` are made from these declarations."""

from __future__ import annotations

import dataclasses

from .errors import GpuaccelError


def setting(default, help: str, *, choices=None, metavar: str | None = None, cli: bool = True,
            flag: str | None = None):
    """A setting of a section, declared once: its default, its help text and valid values, and its
    flat name where that is not the field's own (``flag``). The command line and recipes are made
    from these."""
    factory = dict(default_factory=lambda: list(default)) if isinstance(default, list) else dict(default=default)
    return dataclasses.field(**factory, metadata={"help": help, "choices": choices, "metavar": metavar, "cli": cli,
                                                  "flag": flag})


def check_whole(settings, name: str, minimum: int = 1) -> None:
    """A one-line error unless ``settings.<name>`` is a whole number >= ``minimum``."""
    value = getattr(settings, name)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise GpuaccelError(f"--{name.replace('_', '-')} must be a whole number >= {minimum}, got {value}")
