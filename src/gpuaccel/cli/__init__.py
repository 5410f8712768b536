"""The ``gpuaccel`` command: a thin layer over the Python API. Parsing and printing only: each
command's module (train, deploy, bench) declares its options and prints what the API returns;
the options of training come from the config schema (options.py).

A :class:`GpuaccelError` becomes one line on stderr and exit status 2; Ctrl-C during training
saves a checkpoint and exits with 130; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import atexit
import os
import sys
import threading
import warnings

from ..caches import cache_root, use_bytecode_cache, use_compile_cache
from ..errors import GpuaccelError, speaking_to_the_command_line
from .bench import add_bench_parsers
from .deploy import add_deploy_parsers
from .options import Parser
from .train import EXIT_INTERRUPTED, add_train_parser

EXIT_USER_ERROR = 2


def build_parser() -> argparse.ArgumentParser:
    from .. import __version__

    parser = Parser(prog="gpuaccel", description="Fast deep-learning training and inference on NVIDIA GPUs; "
                                                  "the same code runs on a CPU.")
    parser.add_argument("--version", action="version", version=f"gpuaccel {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    add_train_parser(sub)
    add_deploy_parsers(sub)
    add_bench_parsers(sub)
    parser.commands = sub.choices  # {name: its parser}
    return parser


def _format_warning(message, category, filename, lineno, line=None):
    return f"gpuaccel: warning: {message}\n"


def set_up_process() -> None:
    """What the command does first, before torch is imported: its caches (caches.py), for itself
    and its child processes. Importing gpuaccel as a library does none of it."""
    use_bytecode_cache()
    if use_compile_cache() is None:
        print(f"gpuaccel: warning: the cache directory {cache_root()} cannot be written: decoded data sets and "
              f"compiled kernels are not kept between runs (set GPUACCEL_CACHE_DIR to a folder you can write)",
              file=sys.stderr)


def run() -> None:
    """The ``gpuaccel`` command (and ``python -m gpuaccel``): :func:`main`, then the process ends
    as the interpreter would end it, less the interpreter's own finalisation.

    Why: after a run on a GPU, finalising the interpreter (tearing down every module and the
    CUDA state it holds) took a tenth of a short ``gpuaccel train --recipe cifar10-fast``, and
    did nothing a user sees: every file gpuaccel writes is closed by then. The exit
    does what CPython's does before that finalisation, in its order: :func:`_end_threads`, then
    the exit handlers (compile workers, loader processes and logging are shut down there)."""
    set_up_process()
    try:
        code = main()
        sys.stdout.flush()
    except BrokenPipeError:  # the reader went away (`gpuaccel env --json | head`): nothing more to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = 1
    _end_threads()
    atexit._run_exitfuncs()  # (CPython's own exit path calls the same, after the threads end)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (BrokenPipeError, ValueError):
            pass
    os._exit(code)


def _end_threads() -> None:
    """What the interpreter does first at exit (``threading._shutdown``): the threading module's
    exit hooks, then a wait for every non-daemon thread. The hooks matter: a thread pool's
    workers (``concurrent.futures``, which a cold torch.compile starts) wait for work until
    the pool's hook tells them to stop; joining them without it never returned."""
    shutdown = getattr(threading, "_shutdown", None)
    if shutdown is not None:
        shutdown()
        return
    for thread in threading.enumerate():  # (an interpreter without the hook: join what is left)
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()


def main(argv=None) -> int:
    warnings.formatwarning = _format_warning
    speaking_to_the_command_line(True)
    try:
        argv = list(sys.argv[1:] if argv is None else argv)
        parser = build_parser()
        args, unknown = parser.parse_known_args(argv)
        if unknown:  # (named by the command's own parser, which lists its options)
            command = parser.commands.get(getattr(args, "command", None), parser)
            command.error(f"unrecognized arguments: {' '.join(unknown)}")
        args.argv = argv[1:]  # after the command name: what a launcher passes on
        if not getattr(args, "handler", None):
            build_parser().print_help()
            return EXIT_USER_ERROR
        return args.handler(args)
    except GpuaccelError as exc:
        print(f"gpuaccel: error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print("gpuaccel: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    finally:
        speaking_to_the_command_line(False)  # (main may be called from Python, e.g. by tests)
