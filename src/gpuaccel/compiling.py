"""torch.compile's modes as gpuaccel names them (PyTorch's own, plus "tuned"), how many
processes compile, and the notes of what this machine compiled before (a background compile's
among them)."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import os
import sys
from pathlib import Path

from .caches import start_niced, use_bytecode_cache, use_compile_cache

COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs", "tuned")


def compile_arguments(mode: str, tune_kernels: bool = False) -> dict:
    """Keyword arguments of ``torch.compile`` (or ``nn.Module.compile``) for ``mode``, with
    ``tune_kernels``: each of inductor's Triton kernels' launch parameters tuned by coordinate
    descent when it is compiled (the tuned kernels are cached with the rest).

    "tuned" is inductor's default code with tuned kernels: PyTorch's max-autotune-no-cudagraphs
    without the search over convolution and matrix-product templates, whose compile time did
    not fit ResNet-50: slightly faster steps for minutes more compiling, once per machine
    (docs/training.md)."""
    if mode == "tuned":
        mode, tune_kernels = "default", True
    if not tune_kernels:
        return {"mode": mode}
    import torch._inductor

    # torch.compile takes a mode or options, not both: the mode's own options, plus tuning
    return {"options": {**torch._inductor.list_mode_options(mode), "coordinate_descent_tuning": True}}


def compile_module(module, mode: str, tune_kernels: bool = False, *, split_bytes: int | None = None,
                   dynamic: bool = False):
    """``torch.compile(module)`` as gpuaccel compiles, for ``Trainer`` and ``Accelerator`` alike: in
    ``mode`` (above), with static shapes, its kernels cached on disk (``caches.use_compile_cache``:
    only a machine's first run pays for them). Static shapes: a short last batch gets a graph of
    its own rather than making Dynamo recompile the model for a symbolic batch size, whose
    kernels are slower and which CUDA graphs cannot record.

    ``split_bytes``: the model's graph is cut into pieces of about that many bytes of parameters,
    in reverse order, each compiled on its own, so that its backward pass hands gradients back
    piece by piece (for an all-reduce in buckets during the backward pass,
    parallel/gradient_buckets.py). The cutting is Dynamo's DDPOptimizer, what torch.compile does
    to a model wrapped by DDP, here in front of the same Inductor compilation.

    ``dynamic``: the inputs' sizes symbolic, one compilation for data whose batches come in
    several shapes by design (translation's length buckets), instead of one per shape; each shape
    is still recorded as its own CUDA graph."""
    import torch

    import_compiler()
    arguments = compile_arguments(mode, tune_kernels)
    if split_bytes is None:
        return torch.compile(module, dynamic=dynamic, **arguments)
    from torch._dynamo.backends.distributed import DDPOptimizer

    inductor = torch._TorchCompileInductorWrapper(arguments.get("mode"), arguments.get("options"), False)
    split = DDPOptimizer(split_bytes, inductor, first_bucket_cap=split_bytes)
    return torch.compile(module, dynamic=False, backend=split.compile_fn)


def compile_regions(module, mode: str, tune_kernels: bool = False) -> int:
    """Compiles, in place, each copy of ``module``'s repeated block (the modules of an
    ``nn.ModuleList`` whose items are all of one class: a transformer's layers), as
    ``compile_module`` would; returns how many repeated blocks ``module`` has (0: none, nothing
    was compiled). Blocks compiled before are left as they are (evaluation asks again).

    Why: a whole model's graph is traced and compiled as one, its layers one after another; the
    copies of one block run the same code, which Dynamo compiles once and reuses for every copy
    (their parameters are its inputs). The first compile is then about one layer's, not the
    model's; the few operations between the blocks (embeddings, the last norm and the head) run
    eagerly, which a captured step graph makes as cheap to launch as compiled code."""
    import torch.nn as nn

    import_compiler()
    arguments = compile_arguments(mode, tune_kernels)
    blocks = [block for child in module.modules() if isinstance(child, nn.ModuleList) and len(child) > 1
              and len({type(item) for item in child}) == 1 for block in child]
    for block in blocks:
        if getattr(block, "_compiled_call_impl", None) is None:
            block.compile(dynamic=False, **arguments)
    return len(blocks)


_CUDNN_ATTENTION_BEFORE: list[bool] = []  # cuDNN attention's setting before avoid_runtime_compiles, until put back


def avoid_runtime_compiles() -> None:
    """For a run that may train uncompiled, until :func:`allow_runtime_compiles`
    (``Trainer.compile_now``, and the end of ``Trainer.fit``): the kernels built at their first
    use are left for prebuilt ones. cuDNN's attention is turned off
    (``torch.backends.cuda.enable_cudnn_sdp``) and ``layers.TritonMaxPool2d`` pools with ATen's
    kernels (:func:`runtime_compiles_avoided`). Where the run compiles, the compiled graph and the
    background compile keep them.

    Why: cuDNN builds its attention kernels at run time, for each shape, and the CUDA driver keeps
    them in its cache (``~/.nv/ComputeCache``): on a machine that had not run them yet,
    gpt2-small's first uncompiled steps took 1.49 s and its task check 0.60 s on an H200, with
    flash attention (compiled into PyTorch) 0.36 s and 0.22 s; its uncompiled training, 4% longer,
    gave that back in part. Triton compiles the max-pooling kernels at their first call, forward
    and backward, with and without gradients: a second or more of cifar10-fast's first uncompiled
    command (benchmarks/cold_start/README.md)."""
    import torch

    if not _CUDNN_ATTENTION_BEFORE:
        _CUDNN_ATTENTION_BEFORE.append(torch.backends.cuda.cudnn_sdp_enabled())
    torch.backends.cuda.enable_cudnn_sdp(False)


def runtime_compiles_avoided() -> bool:
    """Whether a run that may train uncompiled asked for prebuilt kernels (:func:`avoid_runtime_compiles`)."""
    return bool(_CUDNN_ATTENTION_BEFORE)


def kernels_may_compile_now() -> bool:
    """Whether a kernel built at its first use (gpuaccel's Triton kernels) may be called here: not
    in an uncompiled run that asked for prebuilt kernels, but always inside a compiled graph."""
    import torch

    return not runtime_compiles_avoided() or torch.compiler.is_compiling()


def allow_runtime_compiles() -> None:
    """The kernels as they were before :func:`avoid_runtime_compiles` (nothing where it did not run)."""
    if _CUDNN_ATTENTION_BEFORE:
        import torch

        torch.backends.cuda.enable_cudnn_sdp(_CUDNN_ATTENTION_BEFORE.pop())


def import_compiler() -> None:
    """Imports what ``torch.compile`` imports on its first call, Dynamo and Inductor, with their
    kernel cache set up first. It is most of what setting a compiled run up costs besides the
    data, so ``Trainer`` imports it as a phase of its own.

    Where the interpreter is told not to write bytecode, it is kept in gpuaccel's cache first
    (``caches.use_bytecode_cache``, which the ``gpuaccel`` command does as it starts): from
    Python too, Dynamo's and Inductor's sources are then compiled once per machine, not in
    every process (seconds of every compiling process's set-up, docs/results.md)."""
    use_bytecode_cache()
    use_compile_cache()
    import_cpp_extension_quietly()
    import torch._dynamo  # noqa: F401
    import torch._inductor.compile_fx  # noqa: F401


CUDA_HOME_NOTICE = "No CUDA runtime is found"


class _WithoutCudaHomeNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(CUDA_HOME_NOTICE)


_WITHOUT_CUDA_HOME_NOTICE = _WithoutCudaHomeNotice()  # (one instance: addFilter keeps it once)


def import_cpp_extension_quietly() -> None:
    """Imports ``torch.utils.cpp_extension`` (Inductor does when it first compiles) without the
    notice it gives when a CUDA build of PyTorch runs on a machine without a GPU ("No CUDA
    runtime is found, using CUDA_HOME=..."): it tells a CPU user nothing they can act on.
    PyTorch logs it (torch 2.13) or prints it (earlier); anything else printed is passed on."""
    import torch

    logging.getLogger("torch.utils.cpp_extension").addFilter(_WITHOUT_CUDA_HOME_NOTICE)
    if "torch.utils.cpp_extension" in sys.modules or torch.cuda.is_available():
        return
    printed = io.StringIO()
    with contextlib.redirect_stderr(printed), contextlib.redirect_stdout(printed):
        import torch.utils.cpp_extension  # noqa: F401
    for line in printed.getvalue().splitlines():
        if not line.startswith(CUDA_HOME_NOTICE):
            print(line, file=sys.stderr)


class CompiledNote:
    """Whether what ``identity`` names (JSON-able: what decides a model's compiled graphs, e.g.
    the configuration, the model and its input shapes) has compiled on this machine: a note file
    in Inductor's cache folder, so clearing that cache clears the notes (``path`` is None where
    there is no cache folder to keep compiled graphs in). Beside it, while a background process
    compiles the same graphs, a lock file names that process."""

    def __init__(self, identity):
        import torch

        text = json.dumps([torch.__version__, identity], default=str, sort_keys=True)
        folder = use_compile_cache()
        self.path = None if folder is None else \
            Path(folder) / "gpuaccel-compiled" / hashlib.sha256(text.encode()).hexdigest()[:32]
        self.compiled_before = self.path is not None and self.path.exists()

    def write(self) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.touch()
        except OSError:  # a cache that became unwritable: the next run compiles with workers again
            pass

    @property
    def lock(self) -> Path:
        return self.path.with_suffix(".compiling")

    def claim(self) -> bool:
        """Takes the lock for a background compile of these graphs (the lock names this process
        until :meth:`hand_over`); False while another live process holds it."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(2):
            try:
                with open(self.lock, "x") as f:
                    f.write(str(os.getpid()))
                return True
            except FileExistsError:
                if _alive(self.lock):
                    return False
                self.lock.unlink(missing_ok=True)  # its process ended without removing it
        return False

    def hand_over(self, pid: int) -> None:
        """The lock now names ``pid``, the process that compiles (and removes it when it ends)."""
        tmp = self.lock.with_suffix(".tmp")
        tmp.write_text(str(pid))
        os.replace(tmp, self.lock)


def start_background_compile(note: CompiledNote, entry: str, settings: dict) -> bool:
    """Starts ``entry`` (a module with a ``main()``: gpuaccel.train.precompile) in a process of its
    own that compiles what ``note`` names: niced, in a session of its own (it outlives this one),
    ``settings`` written to ``NOTE.json`` for it, its output to ``NOTE.log``; the process holds
    the note's lock and removes it as it ends. True where one is now compiling it (this one, or
    another run's found running); False where none can start."""
    try:
        if not note.claim():
            return True  # another run's process compiles the same graphs
    except OSError:
        return False
    try:
        note.path.with_suffix(".json").write_text(json.dumps(settings, default=str))
        with open(note.path.with_suffix(".log"), "w") as log:
            process = start_niced(f"from {entry} import main; main()", [str(note.path)], output=log)
        note.hand_over(process.pid)
    except OSError:
        note.lock.unlink(missing_ok=True)
        return False
    return True


def _alive(lock: Path) -> bool:
    """Whether the process a lock file names still runs (an unreadable lock counts as held)."""
    try:
        os.kill(int(lock.read_text()), 0)
    except ProcessLookupError:
        return False
    except (OSError, ValueError):
        return lock.exists()
    return True


def compiling_in_background(folder) -> list[Path]:
    """The lock files of the background compiles running on ``folder`` (Inductor's cache folder)."""
    return [lock for lock in (Path(folder) / "gpuaccel-compiled").glob("*.compiling") if _alive(lock)]


@contextlib.contextmanager
def compile_workers_unless_cached(note: CompiledNote):
    """Around the first steps of a compiled model: if what ``note`` names has compiled on this
    machine before, Inductor compiles in this process, without its worker processes; after a
    clean exit it is noted as compiled. Yields ``note``.

    Why: whenever it compiles, Inductor starts one worker process per core, each importing
    torch. With every graph and kernel in its cache they have nothing to do, yet they take the
    CPU while the run warms up, and the process waits for them at exit. A compile that misses
    the cache all the same (say, after a model's code changed) runs in this process: slower,
    never wrong. ``TORCHINDUCTOR_COMPILE_THREADS``, where set, decides instead."""
    import torch._inductor.config as inductor_config

    if note.path is None:  # no cache to keep compiled graphs in: compile as PyTorch does
        yield note
        return
    threads = inductor_config.compile_threads
    if note.compiled_before and "TORCHINDUCTOR_COMPILE_THREADS" not in os.environ:
        inductor_config.compile_threads = 1
    try:
        yield note
        note.write()
    finally:
        inductor_config.compile_threads = threads
