"""The one exception type for mistakes a user can fix.

Anything raised as :class:`GpuaccelError` is the user's to correct (a wrong path,
an unknown name, an impossible option); the CLI prints it as one line and exits
with status 2. Every other exception is a bug in gpuaccel and keeps its traceback.
"""


class GpuaccelError(Exception):
    """A user error: the message says what is wrong and how to fix it."""


def choice_error(what: str, value: object, valid) -> GpuaccelError:
    """An error for an unknown name, listing the valid ones."""
    return GpuaccelError(f"unknown {what} {value!r}; choose one of: {', '.join(map(str, valid))}")
