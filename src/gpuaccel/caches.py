"""Where gpuaccel keeps what it computes once per machine: decoded data sets, compiled kernels
and, where the interpreter is told not to write it beside the sources, Python bytecode.

This module imports nothing heavy: the ``gpuaccel`` command calls :func:`use_bytecode_cache` and
:func:`use_compile_cache` before anything imports torch; ``Trainer`` and ``Accelerator`` call
both when they compile, before Dynamo and Inductor are imported (importing the package changes
nothing).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path


def cache_root() -> Path:
    """``$GPUACCEL_CACHE_DIR``, else ``$XDG_CACHE_HOME/gpuaccel``, else ``~/.cache/gpuaccel``."""
    return Path(os.environ.get("GPUACCEL_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "gpuaccel"))


def use_bytecode_cache() -> str | None:
    """Keeps Python bytecode under the cache root when the interpreter was told not to write it
    (``PYTHONDONTWRITEBYTECODE``, which many container images set); returns the folder, or None.

    Why: without bytecode every process compiles torch's Python sources again: seconds of each
    command's start-up, and more where torch.compile imports Dynamo and Inductor
    (docs/results.md). Nothing is written beside the
    sources, which is what the setting is for; child processes (compile workers, loader workers,
    torchrun's) are pointed at the same folder. ``GPUACCEL_BYTECODE_CACHE=0`` leaves the
    interpreter as it was told, and so does a PyTorch installed with its bytecode (pip writes it
    whatever the setting says): the interpreter reads that, where a folder of its own would have
    it compile every source once more, each time the cache folder is new."""
    if not sys.dont_write_bytecode or sys.pycache_prefix or os.environ.get("GPUACCEL_BYTECODE_CACHE") == "0" \
            or has_bytecode("torch"):
        return None
    folder = cache_root() / "bytecode"
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:  # a read-only home: run as told
        return None
    sys.pycache_prefix = str(folder)
    sys.dont_write_bytecode = False
    os.environ["PYTHONPYCACHEPREFIX"] = str(folder)
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)  # children write into the folder, not beside sources
    if (os.cpu_count() or 1) >= 4:
        compile_bytecode_in_background(folder, BYTECODE_PACKAGES)
    return str(folder)


# What a compiled run imports, in the order to compile it: torch's underscored folders (Dynamo,
# Inductor, functorch) sort first, where compileall starts
BYTECODE_PACKAGES = ("torch", "triton", "sympy")


def start_niced(code: str, args: list[str], *, env: dict | None = None, output=None):
    """``python -c CODE ARGS``, niced, in a session of its own, its output to ``output`` (a file;
    by default discarded); returns the process. For work the command leaves for later: it must
    neither slow the command nor end with it (bytecode here, a model's compile in
    gpuaccel.compiling)."""
    import subprocess

    return subprocess.Popen([sys.executable, "-c", f"import os; os.nice(10); {code}", *args], env=env,
                            stdin=subprocess.DEVNULL, stdout=output or subprocess.DEVNULL,
                            stderr=subprocess.STDOUT if output else subprocess.DEVNULL, start_new_session=True)


def compile_bytecode_in_background(folder: Path, packages, workers: int | None = None):
    """Starts compiling the bytecode of each of ``packages`` that lacks its own into ``folder``,
    in a process of its own (niced) with ``workers`` processes (default: the cores less one),
    once per installed version of a package (a note in ``folder`` says it was done); returns the
    process, or None where there is nothing to do.

    Why: with an empty folder, the command compiles torch's sources one by one as it imports
    them, then Dynamo's and Inductor's, and every compile worker the same again: tens of
    seconds of a first command on a machine (docs/results.md, "Cold start"). Compiled in parallel
    beside it, most are there by the time they are imported; what is not yet is compiled by the
    importer, as before (both write whole files, atomically). A command with few cores has none
    to spare: :func:`use_bytecode_cache` starts this from four."""
    import importlib.metadata
    import importlib.util

    folders, notes = [], []
    for name in packages:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.submodule_search_locations or has_bytecode(name):
            continue
        try:
            version = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            version = "unknown"
        note = folder / f"compiled-{name}-{version}-{sys.implementation.cache_tag}"
        if not note.exists():
            folders += list(spec.submodule_search_locations)
            notes.append(str(note))
    if not folders:
        return None
    workers = workers or max(1, (os.cpu_count() or 2) - 1)
    code = ("import compileall, pathlib, sys; folders, notes = sys.argv[1:3]; "
            "[compileall.compile_dir(f, quiet=2, workers=int(sys.argv[3])) for f in folders.split(os.pathsep)]; "
            "[pathlib.Path(n).touch() for n in notes.split(os.pathsep)]")
    env = {**os.environ, "PYTHONPYCACHEPREFIX": str(folder)}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return start_niced(code, [os.pathsep.join(folders), os.pathsep.join(notes), str(workers)], env=env)


def has_bytecode(package: str) -> bool:
    """Whether ``package``'s bytecode lies beside its sources (pip's install writes it), found without
    importing the package."""
    import importlib.util

    spec = importlib.util.find_spec(package)
    if spec is None or not spec.origin or sys.pycache_prefix:
        return False
    return os.path.exists(importlib.util.cache_from_source(spec.origin))


def use_compile_cache() -> str | None:
    """Points torch.compile's caches (Inductor's compiled graphs, and Triton's kernels inside
    them) at ``<cache root>/inductor``, unless ``TORCHINDUCTOR_CACHE_DIR`` is set; returns the folder
    (None where the cache root cannot be written: PyTorch's default folder then).

    Why before torch is imported: Inductor settles its folder the first time anything asks for
    it, writing its default (``/tmp/torchinductor_<user>``) into the environment, and importing
    Dynamo asks (torch/_dynamo/package.py). Set later, the folder depended on what had imported
    Dynamo first: a run that decoded its data set used one folder and the next run, reading the
    decoded cache, the other, and compiled everything again.
    From Python, where Dynamo may have settled it already, PyTorch's folder is kept."""
    folder = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if not folder:
        os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)  # (set but empty: Inductor would try to make '' and fail)
        if not writable(cache_root() / "inductor"):
            return None  # PyTorch's own folder, then (Inductor stops at import on one it cannot make)
        folder = str(cache_root() / "inductor")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = folder
    return folder


def writable(folder: Path) -> bool:
    """Whether ``folder`` exists (made here where missing) and can be written."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        return False
    return os.access(folder, os.W_OK)
