"""A convolution that also returns its output's per-channel sum and sum of squares, computed
on a GPU inside cuDNN's convolution kernel (a cuDNN graph: convolution, then ``genstats``).

Why: in training, a batch norm first reads its convolution's whole output only to take these
statistics. In gpuaccel's compiled ResNet-50 step at 224 px (batch 256, bf16, H200) inductor's
18 kernels doing that took 2.7 ms of a 34.5 ms step, running at 2.0 TB/s over 5.8 GB
(benchmarks/results/resnet50-kernels-h200, run3). NVIDIA's MLPerf ResNet-50 computes them in
the convolution's epilogue instead.

Needs NVIDIA's cuDNN frontend (``pip install nvidia-cudnn-frontend``), a GPU and bf16 or fp16
inputs; everywhere else, and for any shape cuDNN declines, the same results come from
``F.conv2d`` and two sums. The output is channels-last. Its gradient is that of the
convolution, the statistics' own gradients folded into the output's first.
"""

from __future__ import annotations

import functools
import threading
import warnings

import torch
import torch.nn.functional as F
from torch import Tensor

_PLANS_TIMED = 8  # cuDNN's first execution plans, each timed once per shape: the fastest is kept


@functools.cache
def cudnn_frontend():
    """NVIDIA's cuDNN frontend module (``cudnn``), or None where it is not installed."""
    try:
        import cudnn
    except (ImportError, OSError, RuntimeError):  # missing, or without a cuDNN library to load
        return None
    return cudnn


@torch.library.custom_op("gpuaccel::conv2d_stats", mutates_args=())
def conv2d_stats(x: Tensor, weight: Tensor, stride: int, padding: int) -> tuple[Tensor, Tensor, Tensor]:
    """``F.conv2d(x, weight, stride=stride, padding=padding)`` in channels-last layout, and the
    sum and sum of squares of each of its output channels, in fp32 (fp64 for fp64 inputs)."""
    x = x.contiguous(memory_format=torch.channels_last)
    weight = weight.contiguous(memory_format=torch.channels_last)
    graph = _graphs.get(x, weight, stride, padding) if _fusable(x, weight) else None
    if graph is not None:
        return graph.run(x, weight)
    y = F.conv2d(x, weight, stride=stride, padding=padding).contiguous(memory_format=torch.channels_last)
    wide = y.to(_statistics_dtype(y))
    return y, wide.sum((0, 2, 3)), wide.square().sum((0, 2, 3))


@conv2d_stats.register_fake
def _(x, weight, stride, padding):
    y = _output(x, weight, stride, padding)
    return y, y.new_empty(y.shape[1], dtype=_statistics_dtype(y)), y.new_empty(y.shape[1], dtype=_statistics_dtype(y))


def _statistics_dtype(y: Tensor) -> torch.dtype:
    return torch.promote_types(y.dtype, torch.float32)


def _output(x: Tensor, weight: Tensor, stride: int, padding: int) -> Tensor:
    n, _, h, w = x.shape
    k, _, r, s = weight.shape
    shape = (n, k, (h + 2 * padding - r) // stride + 1, (w + 2 * padding - s) // stride + 1)
    return torch.empty(shape, dtype=x.dtype, device=x.device, memory_format=torch.channels_last)


def _setup_context(ctx, inputs, output):
    x, weight, stride, padding = inputs
    ctx.save_for_backward(x, weight, output[0])
    ctx.stride, ctx.padding = stride, padding


def _backward(ctx, grad, grad_sum, grad_squares):
    x, weight, y = ctx.saved_tensors
    # the sums' gradients reach each output element: d(sum)/dy = 1, d(sum of squares)/dy = 2y
    wide = _statistics_dtype(y)
    grad = (grad.to(wide) + grad_sum.view(1, -1, 1, 1) + 2 * y.to(wide) * grad_squares.view(1, -1, 1, 1)).to(y.dtype)
    grad_x, grad_weight, _ = torch.ops.aten.convolution_backward(
        grad, x, weight, None, [ctx.stride] * 2, [ctx.padding] * 2, [1, 1], False, [0, 0], 1,
        [ctx.needs_input_grad[0], ctx.needs_input_grad[1], False])
    return grad_x, grad_weight, None, None


conv2d_stats.register_autograd(_backward, setup_context=_setup_context)


def _fusable(x: Tensor, weight: Tensor) -> bool:
    return x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype \
        and cudnn_frontend() is not None


class _Graph:
    """One cuDNN graph (convolution, then statistics) for one shape, and its fastest plan."""

    def __init__(self, cudnn, handle: int, x: Tensor, weight: Tensor, stride: int, padding: int):
        io_type = cudnn.data_type.BFLOAT16 if x.dtype == torch.bfloat16 else cudnn.data_type.HALF
        graph = cudnn.pygraph(io_data_type=io_type, intermediate_data_type=cudnn.data_type.FLOAT,
                              compute_data_type=cudnn.data_type.FLOAT, handle=handle)
        self.x = graph.tensor(name="x", dim=list(x.shape), stride=list(x.stride()), data_type=io_type)
        self.w = graph.tensor(name="w", dim=list(weight.shape), stride=list(weight.stride()), data_type=io_type)
        self.y = graph.conv_fprop(image=self.x, weight=self.w, padding=[padding] * 2, stride=[stride] * 2,
                                  dilation=[1, 1], name="conv")
        y = _output(x, weight, stride, padding)
        self.y.set_output(True).set_data_type(io_type).set_dim(list(y.shape)).set_stride(list(y.stride()))
        self.sum, self.squares = graph.genstats(input=self.y, name="stats")
        channels = y.shape[1]
        for stat in (self.sum, self.squares):
            stat.set_output(True).set_data_type(cudnn.data_type.FLOAT).set_dim([1, channels, 1, 1]) \
                .set_stride([channels, 1, channels, channels])
        graph.validate()
        graph.build_operation_graph()
        graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        graph.check_support()
        graph.build_plans(cudnn.build_plan_policy.ALL)
        self.graph, self.handle, self.cudnn = graph, handle, cudnn
        self.shape = (stride, padding)
        self.plans = min(graph.get_execution_plan_count(), _PLANS_TIMED)
        self.workspace_bytes = max([graph.get_workspace_size_plan_at_index(i) for i in range(self.plans)] + [0])
        self.plan = self._fastest(x, weight)

    def run(self, x: Tensor, weight: Tensor, plan: int | None = None) -> tuple[Tensor, Tensor, Tensor]:
        y = _output(x, weight, *self.shape)
        # zeroed: whether genstats adds to its outputs or writes them is not documented
        total = torch.zeros(y.shape[1], dtype=torch.float32, device=y.device)
        squares = torch.zeros_like(total)
        workspace = torch.empty(self.workspace_bytes, dtype=torch.uint8, device=y.device)
        self.cudnn.set_stream(handle=self.handle, stream=torch.cuda.current_stream(y.device).cuda_stream)
        self.graph.execute_plan_at_index({self.x: x, self.w: weight, self.y: y, self.sum: total,
                                          self.squares: squares}, workspace, self.plan if plan is None else plan,
                                         handle=self.handle)
        return y, total, squares

    def _fastest(self, x: Tensor, weight: Tensor) -> int:
        """The plan that ran these inputs fastest (as cudnn.benchmark picks convolution
        algorithms); plans that fail to run are passed over."""
        times = {}
        for plan in range(self.plans):
            try:
                self.run(x, weight, plan)  # warm-up
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(3):
                    self.run(x, weight, plan)
                end.record()
                end.synchronize()
                times[plan] = start.elapsed_time(end)
            except Exception:  # a plan cuDNN built but cannot run here
                continue
        if not times:
            raise RuntimeError("none of cuDNN's plans ran")
        return min(times, key=times.get)


class _GraphCache:
    """A graph per (device, shapes, strides, dtype), built on first use; None for shapes cuDNN
    declines (those use the PyTorch path, with a warning; ``declined`` says why)."""

    def __init__(self):
        self._graphs: dict[tuple, _Graph | None] = {}
        self.declined: dict[tuple, str] = {}
        self._handles: dict[int, int] = {}
        self._lock = threading.Lock()

    def summary(self) -> dict:
        """How many shapes run fused, and why cuDNN declined the others."""
        return {"fused": sum(graph is not None for graph in self._graphs.values()),
                "declined": sorted(set(self.declined.values()))}

    def get(self, x: Tensor, weight: Tensor, stride: int, padding: int) -> _Graph | None:
        key = (x.device.index, tuple(x.shape), x.stride(), tuple(weight.shape), weight.stride(), x.dtype,
               stride, padding)
        if key in self._graphs:
            return self._graphs[key]
        if torch.cuda.is_current_stream_capturing():  # graphs are built and timed before capture
            return None
        with self._lock:
            if key not in self._graphs:
                cudnn = cudnn_frontend()
                device = x.device.index
                if device not in self._handles:
                    with torch.cuda.device(device):
                        self._handles[device] = cudnn.create_handle()
                try:
                    self._graphs[key] = _Graph(cudnn, self._handles[device], x, weight, stride, padding)
                except (cudnn.cudnnGraphNotSupportedError, RuntimeError) as exc:
                    self._graphs[key] = None
                    self.declined[key] = f"{type(exc).__name__}: {exc}"
                    warnings.warn(f"cuDNN cannot fuse the statistics into the convolution of {tuple(x.shape)} by "
                                  f"{tuple(weight.shape)} (stride {stride}); it runs unfused "
                                  f"({self.declined[key][:200]})", stacklevel=3)
        return self._graphs[key]


_graphs = _GraphCache()
