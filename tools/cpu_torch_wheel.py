"""Prints the pip requirement of a CPU build of PyTorch that pip's own sources hold for this
Python (a ``torch-*+cpu-cpXY-*.whl`` in a find-links folder: ``PIP_FIND_LINKS`` or pip's
configuration), the newest if several; prints nothing where there is none.

The Makefile asks it on a machine without an NVIDIA GPU where PyTorch's CPU index cannot be
reached: pip alone would choose the newest build on PyPI, a CUDA build of several GB.
"""

import os
import re
import subprocess
import sys


def find_links() -> list[str]:
    folders = os.environ.get("PIP_FIND_LINKS", "").split()
    try:
        listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True,
                                timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        listed = ""
    for line in listed.splitlines():
        key, _, value = line.partition("=")
        if key.strip().endswith("find-links"):
            folders += value.strip().strip("'\"").split()
    return [f[len("file://"):] if f.startswith("file://") else f for f in folders]


def main() -> None:
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    found = []
    for folder in find_links():
        if os.path.isdir(folder):
            for name in os.listdir(folder):
                match = re.fullmatch(rf"torch-(\d+(?:\.\d+)*)\+cpu-{tag}-{tag}-[^-]+\.whl", name)
                if match:
                    found.append(tuple(int(part) for part in match[1].split(".")))
    if found:
        print("torch==" + ".".join(map(str, max(found))) + "+cpu")


if __name__ == "__main__":
    main()
