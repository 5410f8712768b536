"""Triton for gpuaccel's own kernels (max pooling, the language model's loss, FastNet's whitening,
the streaming loader's resampler), imported once here.

Imported only where a kernel can run: a CUDA or ROCm build of PyTorch, or with
``TRITON_INTERPRET=1`` set before this import (the kernels then run on CPU tensors through
Triton's interpreter: how the tests check them). Elsewhere ``triton`` is None, and importing it
would cost about 0.2 s for nothing. CPU builds of PyTorch come without Triton."""

from __future__ import annotations

import os

import torch

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
triton = tl = None
if torch.version.cuda or torch.version.hip or INTERPRETED:
    try:
        import triton
        import triton.language as tl  # noqa: F401 (for the kernels, from here)
    except ImportError:
        pass


def runs_on(x: torch.Tensor) -> bool:
    """Whether a kernel can run on ``x`` here: compiled on a GPU, or interpreted."""
    return triton is not None and (x.is_cuda or INTERPRETED)
