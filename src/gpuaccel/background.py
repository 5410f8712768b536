"""gpuaccel's background threads (batches made ahead, the next epoch's order drawn, the GPU
sampled) end before Python finalises.

Python ends a daemon thread still running at finalisation with ``pthread_exit`` as soon as the
thread takes the GIL back. Inside a PyTorch operator (which lets the GIL go) that unwinds
through C++ frames that may not throw, and the process aborts after the script's own error:
"terminate called without an active exception", exit status 134. An exception out of
``fit()``, uncaught, leaves its loaders' threads running (its traceback holds them) until
then. atexit's functions run before finalisation, while a thread can still finish its
operator and stop, so each object that runs such a thread registers its stop here. A stop
waits a few seconds at most: a thread blocked in a read (its reader process gone) is left to the
interpreter rather than holding the process."""

from __future__ import annotations

import atexit
import weakref
from collections.abc import Callable

_running: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # owner -> its stop, unbound


def stop_at_exit(owner, stop: Callable[[object], None]) -> None:
    """``stop(owner)`` is called at exit, unless ``owner`` was collected before (its own
    clean-up then stopped its thread)."""
    _running[owner] = stop


@atexit.register
def _stop_all() -> None:
    for owner, stop in list(_running.items()):
        try:
            stop(owner)
        except Exception:  # (exiting: one owner's failure must not leave the others' threads running)
            pass
