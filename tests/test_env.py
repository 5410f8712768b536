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
