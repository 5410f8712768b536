"""The one exception type for mistakes a user can fix.

Anything raised as :class:`GpuaccelError` is the user's to correct (a wrong path,
an unknown name, an impossible option); the CLI prints it as one line and exits
with status 2. Every other exception is a bug in gpuaccel and keeps its traceback.

Messages name settings as the command line spells them (``--batch-size``). Read from
Python, where the same setting is a keyword argument or a ``TrainConfig`` field, the
message names that instead (``batch_size``): :func:`speaking_to_the_command_line`
says which audience the process has (the CLI sets it).
"""

from __future__ import annotations

import re

_OPTION = re.compile(r"(?<![\w-])--([a-z][a-z0-9]*(?:-[a-z0-9]+)*)")
_audience = {"command_line": False}


def speaking_to_the_command_line(yes: bool = True) -> None:
    """Errors name command-line options from now on (``gpuaccel``'s entry point calls this)."""
    _audience["command_line"] = yes


def python_names(message: str) -> str:
    """``message`` with each command-line option written as its Python name:
    '--batch-size 1' -> 'batch_size 1'."""
    return _OPTION.sub(lambda m: m.group(1).replace("-", "_"), message)


class GpuaccelError(Exception):
    """A user error: the message says what is wrong and how to fix it."""

    def __str__(self) -> str:
        message = super().__str__()
        return message if _audience["command_line"] else python_names(message)


def choice_error(what: str, value: object, valid) -> GpuaccelError:
    """An error for an unknown name, listing the valid ones, and the likeliest meant first (a name
    spelled with other punctuation or case, or close to it)."""
    import difflib

    names = [str(v) for v in valid]
    plain = {"".join(ch for ch in n.lower() if ch.isalnum()): n for n in names}
    meant = plain.get("".join(ch for ch in str(value).lower() if ch.isalnum())) or \
        next(iter(difflib.get_close_matches(str(value), names, n=1, cutoff=0.75)), None)
    hint = f"did you mean {meant!r}? " if meant is not None and meant != value else ""
    return GpuaccelError(f"unknown {what} {value!r}; {hint}choose one of: {', '.join(names)}")
