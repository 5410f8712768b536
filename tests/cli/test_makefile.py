"""The Makefile's choice of PyTorch build: PyTorch's CPU wheel index on a machine without an
NVIDIA GPU (where the index can be reached), none on a machine with one or where TORCH_INDEX
says so, and a reinstall when the choice changes. make runs for real, with stand-ins for the
interpreter (it logs pip's arguments) and for nvidia-smi."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
FAKE_PYTHON = """#!/bin/sh
# "-m venv DIR" makes DIR/bin/python (a copy of this script); "-c" (the index probe) succeeds
# where FAKE_INDEX is "reachable"; "-m pip ..." logs pip's arguments; the CPU wheel finder
# prints FAKE_CPU_WHEEL
case "$1" in
  -m) if [ "$2" = venv ]; then mkdir -p "$3/bin"; cp "$0" "$3/bin/python"; exit 0; fi
      shift; echo "$*" >> "$FAKE_LOG"; exit 0;;
  -c) [ "$FAKE_INDEX" = reachable ]; exit $?;;
  tools/cpu_torch_wheel.py) echo "$FAKE_CPU_WHEEL"; exit 0;;
esac
exit 3
"""

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs GNU make")


def make(tmp_path: Path, venv: str, *settings: str, gpu: bool = False, index: str = "reachable",
         cpu_wheel: str = "", said: list | None = None) -> list[str]:
    """``make venv`` into ``tmp_path/venv``; the pip commands it ran (and what it said on stderr,
    appended to ``said``)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    python = bin_dir / "python"
    python.write_text(FAKE_PYTHON)
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)'\n" if gpu else "#!/bin/sh\nexit 9\n")
    for tool in (python, smi):
        tool.chmod(0o755)
    log = tmp_path / f"{venv}.log"
    log.touch()
    before = log.read_text().splitlines()
    # (without the settings of a make this runs under: `make test TORCH=...` passes its
    # variables to every make below it through MAKEFLAGS)
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "TORCH", "TORCH_INDEX")}
    env.update(PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", FAKE_LOG=str(log), FAKE_INDEX=index,
               FAKE_CPU_WHEEL=cpu_wheel)
    done = subprocess.run(["make", "-C", str(ROOT), "venv", f"VENV={tmp_path / venv}", f"PYTHON={python}",
                           *settings], env=env, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    if said is not None:
        said.append(done.stderr)
    return log.read_text().splitlines()[len(before):]


def test_without_an_nvidia_gpu_pytorch_comes_from_the_cpu_index_and_a_new_choice_reinstalls(tmp_path):
    assert make(tmp_path, "v") == [f"pip install -q --extra-index-url {CPU_INDEX} torch", "pip install -q -e ."]
    assert make(tmp_path, "v") == []  # nothing changed: nothing installed
    assert make(tmp_path, "v", "TORCH=torch==2.13.0") == [
        f"pip install -q --extra-index-url {CPU_INDEX} torch==2.13.0", "pip install -q -e ."]
    assert make(tmp_path, "v", "TORCH=torch==2.13.0") == []
    assert make(tmp_path, "v", "TORCH=torch==2.13.0", "TORCH_INDEX=") == ["pip install -q torch==2.13.0",
                                                                          "pip install -q -e ."]


def test_with_an_nvidia_gpu_or_no_reachable_index_pip_decides(tmp_path):
    assert make(tmp_path, "gpu", gpu=True)[0] == "pip install -q torch"
    assert make(tmp_path, "offline", index="unreachable")[0] == "pip install -q torch"
    assert make(tmp_path, "mirror", "TORCH_INDEX=https://mirror.example/whl/cu130", gpu=True)[0] == \
        "pip install -q --extra-index-url https://mirror.example/whl/cu130 torch"


def test_without_a_gpu_or_the_cpu_index_a_cpu_build_from_pips_own_sources_or_one_line_why_not(tmp_path):
    said = []
    assert make(tmp_path, "local", index="unreachable", cpu_wheel="torch==2.13.0+cpu", said=said)[0] == \
        "pip install -q torch==2.13.0+cpu"
    assert "several GB" not in said[-1]
    assert make(tmp_path, "none", index="unreachable", said=said)[0] == "pip install -q torch"
    assert "pip's own sources hold no CPU build" in said[-1] and "TORCH=" in said[-1]
    assert make(tmp_path, "chosen", "TORCH=torch==2.14.1", index="unreachable", cpu_wheel="torch==2.13.0+cpu",
                said=said)[0] == "pip install -q torch==2.14.1"  # (a choice of the user's stands)
