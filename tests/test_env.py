"""`gpuaccel env`: the machine report, useful on a laptop without a GPU too."""

from __future__ import annotations

import json

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


def _interpreter_state(tmp_path, **env) -> dict:
    """sys.pycache_prefix and the bytecode setting of a fresh interpreter after `import gpuaccel`."""
    import os
    import subprocess
    import sys

    code = ("import json, os, sys, gpuaccel; print(json.dumps([sys.pycache_prefix, sys.dont_write_bytecode, "
            "os.environ.get('PYTHONPYCACHEPREFIX'), os.environ.get('PYTHONDONTWRITEBYTECODE')]))")
    base = {k: v for k, v in os.environ.items() if k not in ("PYTHONDONTWRITEBYTECODE", "PYTHONPYCACHEPREFIX")}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          env={**base, "GPUACCEL_CACHE_DIR": str(tmp_path), **env})
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_bytecode_goes_to_the_cache_where_the_interpreter_may_not_write_it_beside_sources(tmp_path):
    folder = tmp_path / "bytecode"
    prefix, no_bytecode, env_prefix, env_setting = _interpreter_state(tmp_path, PYTHONDONTWRITEBYTECODE="1")
    assert prefix == env_prefix == str(folder) and not no_bytecode and env_setting is None
    # torch, imported after gpuaccel's first lines, was compiled into the folder, not beside its sources
    assert any("torch" in p.parts for p in folder.rglob("*.pyc"))
    # a user's own choices stand: bytecode allowed (the default), or the cache turned off
    assert _interpreter_state(tmp_path)[0] is None
    off = _interpreter_state(tmp_path, PYTHONDONTWRITEBYTECODE="1", GPUACCEL_BYTECODE_CACHE="0")
    assert off[0] is None and off[1] is True and off[3] == "1"
