"""torch.compile's modes as gpuaccel names them: PyTorch's own, plus "tuned"."""

from __future__ import annotations

COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs", "tuned")


def compile_arguments(mode: str) -> dict:
    """Keyword arguments of ``torch.compile`` (or ``nn.Module.compile``) for ``mode``.

    "tuned" is inductor's default code with each of its Triton kernels' block sizes tuned by
    coordinate descent: PyTorch's max-autotune-no-cudagraphs without the search over
    convolution and matrix-product templates, whose compile time did not fit ResNet-50. For
    ResNet-50 at 224 px on an H200 it gave 1.08x the default step and 217 s of compilation
    instead of 38 s, once per machine (benchmarks/resnet50_kernels.py)."""
    if mode == "tuned":
        return {"options": {"coordinate_descent_tuning": True}}
    return {"mode": mode}
