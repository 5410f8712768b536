"""Small generated fixtures in every real data format, with a learnable pattern per class."""

from __future__ import annotations

import gzip
import json
import os
import pickle
import signal
import struct
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from gpuaccel.cli import main

CLASSES = ["circle", "square", "stripe"]

# Tests start ``python -m gpuaccel`` and helper programs from other working directories (a run's
# tmp_path, say): a relative PYTHONPATH (``PYTHONPATH=src:tests``, the GPU tests' documented
# command) would no longer find the package there, so its entries are made absolute once.
if os.environ.get("PYTHONPATH"):
    os.environ["PYTHONPATH"] = os.pathsep.join(
        os.path.abspath(entry) if entry else entry for entry in os.environ["PYTHONPATH"].split(os.pathsep))


def as_from_a_terminal() -> None:
    """``preexec_fn`` for a command that a test stops with a signal: SIGINT and SIGTERM handled
    and unblocked in it, as in a command typed at a terminal, whatever this test process holds
    (a library in it may have left them ignored or blocked, and a child inherits both)."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` are skipped, with one reason, where no CUDA GPU is present."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


def pattern_images(labels: np.ndarray, size: int = 16, channels: int = 1, seed: int = 0) -> np.ndarray:
    """(N, H, W[, C]) uint8 images: each class brightens its own region, plus noise."""
    rng = np.random.default_rng(seed)
    n = len(labels)
    images = rng.integers(0, 60, size=(n, size, size), dtype=np.int64)
    third = size // 3
    for i, label in enumerate(labels):
        band = slice(int(label % 3) * third, int(label % 3) * third + third)
        if label < 3:
            images[i, band, :] += 170
        else:
            images[i, :, band] += 170
    images = np.clip(images, 0, 255).astype(np.uint8)
    if channels == 3:
        images = np.stack([images, images[:, ::-1], images // 2], axis=-1)
    return images


def balanced_labels(n: int, classes: int, seed: int = 0) -> np.ndarray:
    labels = np.arange(n) % classes
    np.random.default_rng(seed).shuffle(labels)
    return labels


def write_idx(path: Path, array: np.ndarray, gz: bool = True) -> None:
    header = struct.pack(">BBBB", 0, 0, 0x08, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    payload = header + array.astype(np.uint8).tobytes()
    if gz:
        with gzip.open(str(path) + ".gz", "wb") as f:
            f.write(payload)
    else:
        Path(path).write_bytes(payload)


@pytest.fixture
def mnist_dir(tmp_path) -> Path:
    root = tmp_path / "mnist"
    root.mkdir()
    for prefix, n, seed in (("train", 300, 0), ("t10k", 90, 1)):
        labels = balanced_labels(n, 6, seed)
        write_idx(root / f"{prefix}-images-idx3-ubyte", pattern_images(labels, 16, 1, seed))
        write_idx(root / f"{prefix}-labels-idx1-ubyte", labels.astype(np.uint8))
    return root


@pytest.fixture
def cifar_dir(tmp_path) -> Path:
    root = tmp_path / "cifar-10-batches-py"
    root.mkdir()
    def batch(n, seed):
        labels = balanced_labels(n, 10, seed)
        images = pattern_images(labels, 32, 3, seed).transpose(0, 3, 1, 2).reshape(n, -1)
        return {b"data": images, b"labels": labels.tolist()}
    for i in range(1, 3):
        with open(root / f"data_batch_{i}", "wb") as f:
            pickle.dump(batch(50, i), f)
    with open(root / "test_batch", "wb") as f:
        pickle.dump(batch(30, 9), f)
    with open(root / "batches.meta", "wb") as f:
        pickle.dump({b"label_names": [f"c{i}".encode() for i in range(10)]}, f)
    return tmp_path


def make_image_folder(root: Path, per_class=(12, 4), size=12, ext="png", mode="RGB", split=True) -> Path:
    """train/<class>/*.ext and test/<class>/*.ext (or <class>/*.ext when not split)."""
    counts = {"train": per_class[0], "test": per_class[1]} if split else {"": per_class[0]}
    for split_name, count in counts.items():
        for label, cls in enumerate(CLASSES):
            folder = root / split_name / cls if split_name else root / cls
            folder.mkdir(parents=True, exist_ok=True)
            images = pattern_images(np.full(count, label), size, 3, seed=label + len(split_name))
            for i, array in enumerate(images):
                img = Image.fromarray(array, "RGB")
                img = img.convert(mode) if mode != "RGB" else img
                img.save(folder / f"{i:04d}.{ext}")
    return root


@pytest.fixture
def image_folder(tmp_path) -> Path:
    return make_image_folder(tmp_path / "images")


@pytest.fixture
def cache_dir(tmp_path) -> Path:
    return tmp_path / "cache"


def make_tar(folder: Path, out: Path, wrap: str | None = "dataset") -> Path:
    with tarfile.open(out, "w:gz" if str(out).endswith("gz") else "w") as tar:
        tar.add(folder, arcname=wrap or ".")
    return out


@pytest.fixture
def npz_file(tmp_path) -> Path:
    train_y, test_y = balanced_labels(120, 4, 0), balanced_labels(40, 4, 1)
    path = tmp_path / "arrays.npz"
    np.savez(path, x_train=pattern_images(train_y, 12, 3, 0), y_train=train_y,
             x_test=pattern_images(test_y, 12, 3, 1), y_test=test_y)
    return path


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def assert_user_error(capsys, argv, *needles):
    code, out, err = run(capsys, *argv)
    lines = err.strip().splitlines()
    assert code == 2, (code, err)
    assert len(lines) == 1 and lines[0].startswith("gpuaccel: error: "), err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


# Programs that run gpuaccel's Triton kernels on CPU tensors through Triton's interpreter, by name: the
# test modules register theirs (interpreted()) when they are collected, and the first test that asks
# for the results runs them all in one child Python (each alone spent most of its time importing).
INTERPRETED_PROGRAMS: dict[str, str] = {}

_RUN_INTERPRETED = r"""
import contextlib, io, json, sys, traceback
results = {}
for name, program in json.loads(sys.stdin.read()).items():
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            exec(compile(program, name, "exec"), {"__name__": "__main__"})
        results[name] = [True, printed.getvalue()]
    except BaseException:
        results[name] = [False, printed.getvalue() + traceback.format_exc()]
with open(sys.argv[1], "w") as f:
    json.dump(results, f)
"""


def interpreted(name: str, program: str) -> str:
    """Registers ``program`` to run with ``TRITON_INTERPRET=1`` (set before Triton is imported:
    gpuaccel's Triton kernels then run on CPU tensors through Triton's interpreter); returns the
    name that :func:`assert_ran_interpreted` takes. Each program runs in its own namespace and puts
    back what it patches."""
    INTERPRETED_PROGRAMS[name] = program
    return name


@pytest.fixture(scope="session")
def interpreted_runs(tmp_path_factory) -> dict:
    """{name: (passed, what it printed and any traceback)} of every registered program, from one child."""
    pytest.importorskip("triton", reason="the test extra installs Triton; this environment lacks it")
    results = tmp_path_factory.mktemp("interpreted") / "results.json"
    done = subprocess.run([sys.executable, "-c", _RUN_INTERPRETED, str(results)],
                          input=json.dumps(INTERPRETED_PROGRAMS), capture_output=True, text=True,
                          env={**os.environ, "TRITON_INTERPRET": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(results.read_text())


def assert_ran_interpreted(runs: dict, name: str, done_marker: str) -> None:
    passed, output = runs[name]
    assert passed and done_marker in output, output[-3000:]
