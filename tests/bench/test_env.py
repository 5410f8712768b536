"""`gpuaccel env`: the machine report, useful on a laptop without a GPU too."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from gpuaccel.bench.env import collect, format_report, measure_ceilings
from gpuaccel.cli import main


def test_report_names_cpu_torch_and_packages():
    info = collect()
    assert info["cpu"]["cores"] >= 1 and info["torch"] == torch.__version__
    assert "onnxruntime" in info["packages"]
    text = format_report(info)
    assert "CPU" in text and torch.__version__ in text and "packages" in text


def test_env_json_and_measure_on_this_machine(capsys):
    assert main(["env", "--json", "--measure", "--device", "cpu"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["ceilings"] == {"skipped": "no CUDA GPU: the ceilings are GPU measurements"}
    assert measure_ceilings(torch.device("cpu"))["skipped"]


# the gpuaccel command's first step, then what the interpreter was told
_COMMAND = "from gpuaccel.cli import set_up_process; set_up_process(); "
# as where PyTorch was installed without its bytecode (a container image's, say)
_NO_TORCH_BYTECODE = "import gpuaccel.caches as caches; caches.has_bytecode = lambda package: False; "
_BYTECODE_STATE = (_COMMAND + "import json, os, sys, torch; print(json.dumps([sys.pycache_prefix, "
                   "sys.dont_write_bytecode, os.environ.get('PYTHONPYCACHEPREFIX'), "
                   "os.environ.get('PYTHONDONTWRITEBYTECODE')]))")


def _interpreter_state(tmp_path, code: str = _BYTECODE_STATE, **env):
    """What ``code`` prints last, as JSON, in a fresh interpreter with gpuaccel's cache under
    ``tmp_path`` and ``env`` (by default: sys.pycache_prefix and the bytecode setting after
    the command's set-up)."""
    import os
    import subprocess
    import sys

    base = {k: v for k, v in os.environ.items()
            if k not in ("PYTHONDONTWRITEBYTECODE", "PYTHONPYCACHEPREFIX", "TORCHINDUCTOR_CACHE_DIR")}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          env={**base, "GPUACCEL_CACHE_DIR": str(tmp_path), **env})
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_compiled_kernels_go_to_gpuaccels_cache_whatever_imports_dynamo_first(tmp_path):
    # importing Dynamo settles Inductor's folder (its default under /tmp unless told): the command
    # names its own before, so every run of a machine reads and writes the same one
    code = (_COMMAND + "import json, torch._dynamo; from torch._inductor.runtime.cache_dir_utils import cache_dir; "
            "print(json.dumps(cache_dir()))")
    assert _interpreter_state(tmp_path, code) == str(tmp_path / "inductor")
    assert _interpreter_state(tmp_path, code, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "mine")) == str(tmp_path / "mine")


def test_bytecode_goes_to_the_cache_where_the_interpreter_may_not_write_it_beside_sources(tmp_path):
    folder = tmp_path / "bytecode"
    prefix, no_bytecode, env_prefix, env_setting = _interpreter_state(
        tmp_path, _NO_TORCH_BYTECODE + _BYTECODE_STATE, PYTHONDONTWRITEBYTECODE="1")
    assert prefix == env_prefix == str(folder) and not no_bytecode and env_setting is None
    # torch, imported after the command's first lines, was compiled into the folder, not beside its sources
    assert any("torch" in p.parts for p in folder.rglob("*.pyc"))
    # a user's own choices stand: bytecode allowed (the default), or the cache turned off
    assert _interpreter_state(tmp_path)[0] is None
    off = _interpreter_state(tmp_path, _NO_TORCH_BYTECODE + _BYTECODE_STATE, PYTHONDONTWRITEBYTECODE="1",
                             GPUACCEL_BYTECODE_CACHE="0")
    assert off[0] is None and off[1] is True and off[3] == "1"
    # a PyTorch installed with its bytecode (pip writes it whatever the setting) is read as it lies
    installed = "import gpuaccel.caches as caches; caches.has_bytecode = lambda package: True; " + _BYTECODE_STATE
    assert _interpreter_state(tmp_path, installed, PYTHONDONTWRITEBYTECODE="1") == [None, True, None, "1"]


def test_a_package_has_bytecode_where_its_compiled_sources_lie_beside_them(tmp_path, monkeypatch):
    import py_compile
    import sys

    from gpuaccel.caches import has_bytecode
    monkeypatch.setattr(sys, "pycache_prefix", None)  # (bytecode beside the sources is what is asked about)
    source = tmp_path / "plainpackage" / "__init__.py"
    source.parent.mkdir()
    source.write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert not has_bytecode("plainpackage")
    py_compile.compile(str(source))  # (into plainpackage/__pycache__, as pip's install does)
    assert has_bytecode("plainpackage")


def test_a_packages_bytecode_is_compiled_into_the_cache_in_the_background_once(tmp_path, monkeypatch):
    """The first command of a machine with cores to spare compiles the heavy packages' bytecode
    in a process beside it: into the cache folder, each module once, not again the next time."""
    import importlib.util

    from gpuaccel.caches import compile_bytecode_in_background
    package = tmp_path / "src" / "heavypackage"
    (package / "inner").mkdir(parents=True)
    for source in (package / "__init__.py", package / "inner" / "__init__.py", package / "inner" / "deep.py"):
        source.write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path / "src"))
    folder = tmp_path / "bytecode"
    monkeypatch.setattr(sys, "pycache_prefix", str(folder))  # (where cache_from_source then points)
    background = compile_bytecode_in_background(folder, ["heavypackage", "no_such_package"], workers=2)
    assert background.wait(timeout=60) == 0
    for source in (package / "__init__.py", package / "inner" / "deep.py"):
        assert os.path.exists(importlib.util.cache_from_source(str(source)))
    assert not (package / "__pycache__").exists()
    assert compile_bytecode_in_background(folder, ["heavypackage"]) is None  # (done once: the note says so)


def test_compiling_from_python_sets_the_bytecode_cache_up_before_importing_dynamo(monkeypatch):
    """Trainer and Accelerator compile through ``import_compiler``: without the command's set-up,
    the ~1,000 modules of Dynamo and Inductor it imports need the bytecode cache set up first
    (what that does is the test above's)."""
    import builtins

    import gpuaccel.compiling as compiling
    calls = []
    monkeypatch.setattr(compiling, "use_bytecode_cache", lambda: calls.append("bytecode cache"))
    real_import = builtins.__import__

    def recording_import(name, *args, **kwargs):
        if name.startswith(("torch._dynamo", "torch._inductor")):
            calls.append(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", recording_import)
    compiling.import_compiler()
    assert calls[0] == "bytecode cache" and "torch._dynamo" in calls


def test_importing_gpuaccel_changes_nothing_in_the_importing_process(tmp_path):
    """A library import leaves the interpreter's settings and the environment as they were, also
    with the parts a user touches imported (the command sets its caches up itself)."""
    code = ("import json, os, sys, torch; before = [dict(os.environ), sys.pycache_prefix, sys.dont_write_bytecode]; "
            "import gpuaccel; gpuaccel.Trainer, gpuaccel.Accelerator, gpuaccel.tasks, gpuaccel.open_dataset; "
            "import gpuaccel.cli, gpuaccel.runtime, gpuaccel.deploy.export; "
            "after = [dict(os.environ), sys.pycache_prefix, sys.dont_write_bytecode]; "
            "print(json.dumps([before == after, sorted(set(after[0].items()) ^ set(before[0].items()))]))")
    unchanged, difference = _interpreter_state(tmp_path, code, PYTHONDONTWRITEBYTECODE="1")
    assert unchanged, difference


def test_a_setup_compiled_before_compiles_without_worker_processes(tmp_path, monkeypatch):
    import torch._inductor.config as inductor_config

    from gpuaccel.compiling import CompiledNote, compile_workers_unless_cached

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("TORCHINDUCTOR_COMPILE_THREADS", raising=False)
    threads = inductor_config.compile_threads
    with pytest.raises(RuntimeError), compile_workers_unless_cached(CompiledNote({"model": "a"})):
        raise RuntimeError("a compile that fails is not noted")
    with compile_workers_unless_cached(CompiledNote({"model": "a"})) as note:
        assert not note.compiled_before and inductor_config.compile_threads == threads
    with compile_workers_unless_cached(CompiledNote({"model": "a"})) as note:
        assert note.compiled_before and inductor_config.compile_threads == 1
    assert inductor_config.compile_threads == threads
    with compile_workers_unless_cached(CompiledNote({"model": "b"})) as note:  # another setup: its own note
        assert not note.compiled_before
    monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "4")  # the user's setting decides
    with compile_workers_unless_cached(CompiledNote({"model": "a"})) as note:
        assert note.compiled_before and inductor_config.compile_threads == threads


def test_one_background_compile_at_a_time(tmp_path, monkeypatch):
    """A background compile's lock: taken once; held while the process it names lives, taken
    over once that process has ended without removing it."""
    from gpuaccel.compiling import CompiledNote, compiling_in_background

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    note = CompiledNote({"model": "a"})
    assert note.claim() and not CompiledNote({"model": "a"}).claim()
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        note.hand_over(sleeper.pid)
        assert compiling_in_background(tmp_path) == [note.lock] and not note.claim()
    finally:
        sleeper.kill()
        sleeper.wait()
    assert compiling_in_background(tmp_path) == [] and note.claim()  # (its process is gone)
    assert note.lock.read_text() == str(os.getpid())
