"""Convolutions that take batch norm's work into their own kernels, through cuDNN's graphs.

In a training step a batch norm reads its convolution's output once for its statistics and
once to normalise it (writing the normalised copy, which the next convolution reads), and in
the backward pass reads the gradient and the input again for its two sums. In gpuaccel's
compiled ResNet-50 step at 224 px (batch 256, bf16, H200) inductor's statistics kernels took
2.7 ms and its backward reductions 4.9 ms of a 34.5 ms step
(benchmarks/results/resnet50-kernels-h200, run3). NVIDIA's MLPerf ResNet-50 moves that work
into cuDNN's convolution kernels, as here:

- :func:`conv2d_stats`: ``conv2d(relu(x * scale + shift), weight)`` (the previous batch norm
  and its ReLU applied as the convolution loads its input, so the normalised tensor is never
  written), or ``conv2d(x, weight)``; and the per-channel sum and sum of squares of the output,
  from the convolution's epilogue (cuDNN's ``genstats``).
- Its backward pass, where there is a prologue: the input gradient through the ReLU, with the
  two sums the previous batch norm needs taken in the same kernel, and the weight gradient with
  the same prologue (without one, PyTorch's convolution gradients).

Each graph needs NVIDIA's cuDNN frontend (``pip install nvidia-cudnn-frontend``), a GPU and
bf16 or fp16 tensors. Everywhere else, and for any graph cuDNN declines (with a warning;
:func:`summary` says which), the same results come from PyTorch's operators, which the tests
check the graphs against.
"""

from __future__ import annotations

import functools
import threading
import time
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

_PLANS_TIMED = 4  # cuDNN's first execution plans that build, each timed once per shape: the fastest is kept

# The graphs cuDNN is asked to run; the others' work is left to PyTorch's operators (to measure
# each graph's share)
CUDNN_GRAPHS = {"forward", "weight_grad", "prologue_grad"}


@functools.cache
def cudnn_frontend():
    """NVIDIA's cuDNN frontend module (``cudnn``), or None where it is not installed."""
    try:
        import cudnn
    except Exception:  # missing, or unable to find or load a cuDNN library (it asserts on some layouts)
        return None
    return cudnn


# ---------------------------------------------------------------------------------------------
# The operators

@torch.library.custom_op("gpuaccel::conv2d_stats", mutates_args=())
def conv2d_stats(x: Tensor, weight: Tensor, scale: Tensor | None, shift: Tensor | None, stride: int,
                 padding: int) -> tuple[Tensor, Tensor, Tensor]:
    """``F.conv2d(input, weight, stride=stride, padding=padding)`` in channels-last layout, and
    the sum and sum of squares of each of its output channels (fp32; fp64 for fp64 inputs). The
    input is ``relu(x * scale + shift)`` with per-channel ``scale`` and ``shift`` (fp32, one
    value per input channel), or ``x`` when they are None."""
    x, weight = _channels_last(x), _channels_last(weight)
    y = _output(x, weight, stride, padding)
    total, squares = _statistics(y), _statistics(y)
    buffers = {"x": x, "w": weight, "y": y, "sum": total, "squares": squares,
               **_affine(scale, shift)}
    if _run_graph("forward", buffers, stride, padding):
        return y, total, squares
    return reference_forward(x, weight, scale, shift, stride, padding)


def reference_forward(x, weight, scale, shift, stride, padding):
    """:func:`conv2d_stats` in PyTorch's operators."""
    y = _channels_last(F.conv2d(_prologue(x, scale, shift), weight, stride=stride, padding=padding))
    wide = y.to(torch.promote_types(y.dtype, torch.float32))
    return y, wide.sum((0, 2, 3)), wide.square().sum((0, 2, 3))


@conv2d_stats.register_fake
def _(x, weight, scale, shift, stride, padding):
    y = _output(x, weight, stride, padding)
    return y, _statistics(y), _statistics(y)


@torch.library.custom_op("gpuaccel::conv2d_weight_grad", mutates_args=())
def conv2d_weight_grad(x: Tensor, weight: Tensor, scale: Tensor | None, shift: Tensor | None, grad: Tensor,
                       stride: int, padding: int) -> Tensor:
    """The gradient of :func:`conv2d_stats`'s weight, given its output's gradient ``grad``."""
    x, grad = _channels_last(x), _channels_last(grad)
    grad_weight = torch.empty_like(weight, memory_format=torch.channels_last)
    if _run_graph("weight_grad", {"x": x, "grad": grad, "dw": grad_weight, **_affine(scale, shift)},
                  stride, padding):
        return grad_weight
    return reference_weight_grad(x, weight, scale, shift, grad, stride, padding)


def reference_weight_grad(x, weight, scale, shift, grad, stride, padding):
    """:func:`conv2d_weight_grad` in PyTorch's operators."""
    return torch.ops.aten.convolution_backward(
        grad, _prologue(x, scale, shift), weight, None, [stride] * 2, [padding] * 2, [1, 1], False, [0, 0], 1,
        [False, True, False])[1].contiguous(memory_format=torch.channels_last)


@conv2d_weight_grad.register_fake
def _(x, weight, scale, shift, grad, stride, padding):
    return torch.empty_like(weight, memory_format=torch.channels_last)


@torch.library.custom_op("gpuaccel::conv2d_prologue_grad", mutates_args=())
def conv2d_prologue_grad(x: Tensor, weight: Tensor, scale: Tensor, shift: Tensor, grad: Tensor, stride: int,
                         padding: int) -> tuple[Tensor, Tensor, Tensor]:
    """For :func:`conv2d_stats` with a prologue, given its output's gradient ``grad``: the
    gradient of ``x * scale + shift`` (through the ReLU), and its per-channel sums weighted by
    ``x`` and not (the gradients of ``scale`` and ``shift``)."""
    x, grad = _channels_last(x), _channels_last(grad)
    grad_pre = torch.empty_like(x, memory_format=torch.channels_last)
    by_x, total = _statistics(grad_pre), _statistics(grad_pre)
    buffers = {"x": x, "w": _channels_last(weight), "grad": grad, "grad_pre": grad_pre, "sum_by_x": by_x,
               "sum": total, **_affine(scale, shift)}
    if _run_graph("prologue_grad", buffers, stride, padding):
        return grad_pre, by_x, total
    return reference_prologue_grad(x, weight, scale, shift, grad, stride, padding)


def reference_prologue_grad(x, weight, scale, shift, grad, stride, padding):
    """:func:`conv2d_prologue_grad` in PyTorch's operators."""
    grad_input = torch.ops.aten.convolution_backward(
        grad, x, weight, None, [stride] * 2, [padding] * 2, [1, 1], False, [0, 0], 1, [True, False, False])[0]
    pre = per_channel_affine(x, scale, shift)
    grad_pre = _channels_last(torch.where(pre > 0, grad_input, 0))
    wide = grad_pre.to(torch.promote_types(grad_pre.dtype, torch.float32))
    return grad_pre, (wide * x).sum((0, 2, 3)), wide.sum((0, 2, 3))


@conv2d_prologue_grad.register_fake
def _(x, weight, scale, shift, grad, stride, padding):
    grad_pre = torch.empty_like(x, memory_format=torch.channels_last)
    return grad_pre, _statistics(grad_pre), _statistics(grad_pre)


def _setup_context(ctx, inputs, output):
    x, weight, scale, shift, stride, padding = inputs
    ctx.save_for_backward(x, weight, scale, shift, output[0])
    ctx.stride, ctx.padding = stride, padding


def _backward(ctx, grad, grad_sum, grad_squares):
    x, weight, scale, shift, y = ctx.saved_tensors
    # the sums' gradients reach each output element: d(sum)/dy = 1, d(sum of squares)/dy = 2y
    wide = grad.to(torch.promote_types(y.dtype, torch.float32))
    if grad_sum is not None:
        wide = wide + grad_sum.view(1, -1, 1, 1)
    if grad_squares is not None:
        wide = wide + 2 * y.to(wide.dtype) * grad_squares.view(1, -1, 1, 1)
    grad = wide.to(y.dtype)
    needs_x, needs_weight = ctx.needs_input_grad[:2]
    if scale is None:  # a plain convolution's gradients: PyTorch's own (cuDNN through ATen)
        grad_x, grad_weight, _ = torch.ops.aten.convolution_backward(
            grad, x, weight, None, [ctx.stride] * 2, [ctx.padding] * 2, [1, 1], False, [0, 0], 1,
            [needs_x, needs_weight, False])
        return grad_x, grad_weight, None, None, None, None
    # a graph left out of CUDNN_GRAPHS is written here in PyTorch's operators, where inductor can
    # fuse them with their neighbours (inside the custom operator it could not)
    weight_grad = conv2d_weight_grad if "weight_grad" in CUDNN_GRAPHS else reference_weight_grad
    prologue_grad = conv2d_prologue_grad if "prologue_grad" in CUDNN_GRAPHS else reference_prologue_grad
    grad_weight = weight_grad(x, weight, scale, shift, grad, ctx.stride, ctx.padding) if needs_weight else None
    grad_pre, grad_scale, grad_shift = prologue_grad(x, weight, scale, shift, grad, ctx.stride, ctx.padding)
    grad_x = (grad_pre * scale.view(1, -1, 1, 1)).to(x.dtype)
    return grad_x, grad_weight, grad_scale.to(scale.dtype), grad_shift.to(shift.dtype), None, None


conv2d_stats.register_autograd(_backward, setup_context=_setup_context)


def _channels_last(t: Tensor) -> Tensor:
    return t.contiguous(memory_format=torch.channels_last)


def _output(x: Tensor, weight: Tensor, stride: int, padding: int) -> Tensor:
    n, _, h, w = x.shape
    k, _, r, s = weight.shape
    shape = (n, k, (h + 2 * padding - r) // stride + 1, (w + 2 * padding - s) // stride + 1)
    return torch.empty(shape, dtype=x.dtype, device=x.device, memory_format=torch.channels_last)


def _statistics(t: Tensor) -> Tensor:
    """Room for one sum per channel of ``t``: fp32, or fp64 for fp64 tensors (a graph that adds
    to its sums has them zeroed first, see :meth:`_Graph.run`)."""
    return torch.empty(t.shape[1], dtype=torch.promote_types(t.dtype, torch.float32), device=t.device)


def _affine(scale: Tensor | None, shift: Tensor | None) -> dict:
    if (scale is None) != (shift is None):
        raise ValueError("a convolution's prologue needs both scale and shift")
    return {} if scale is None else {"scale": scale.contiguous(), "shift": shift.contiguous()}


def per_channel_affine(t: Tensor, scale: Tensor, shift: Tensor) -> Tensor:
    """``t * scale + shift`` with one scale and shift per channel of an (N, C, H, W) ``t``."""
    return t * scale.view(1, -1, 1, 1) + shift.view(1, -1, 1, 1)


def _prologue(x: Tensor, scale: Tensor | None, shift: Tensor | None) -> Tensor:
    if scale is None:
        return x
    return torch.relu(per_channel_affine(x, scale, shift)).to(x.dtype)


# ---------------------------------------------------------------------------------------------
# cuDNN's graphs

def _run_graph(kind: str, buffers: dict[str, Tensor], stride: int, padding: int) -> bool:
    """Runs the graph of ``kind`` on ``buffers`` (inputs and outputs by name) if cuDNN can;
    False leaves the outputs to PyTorch's operators."""
    x = buffers["x"]
    if not (kind in CUDNN_GRAPHS and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)
            and cudnn_frontend() is not None):
        return False
    graph = _graphs.get(kind, buffers, stride, padding)
    if graph is None:
        return False
    graph.run(buffers)
    return True


def _layout(t: Tensor) -> tuple[list[int], list[int]]:
    """``t``'s dimensions and strides in a graph; per-channel vectors become (1, C, 1, 1)."""
    if t.dim() == 1:
        return [1, t.numel(), 1, 1], [t.numel(), 1, t.numel(), t.numel()]
    return list(t.shape), list(t.stride())


def _like(graph, name: str, t: Tensor):
    """A graph input laid out as ``t``."""
    dims, strides = _layout(t)
    return graph.tensor(name=name, dim=dims, stride=strides, data_type=t.dtype)


def _as_output(tensor, t: Tensor, cudnn) -> None:
    """Marks a graph tensor as an output laid out as ``t``."""
    dims, strides = _layout(t)
    data_type = {torch.float32: cudnn.data_type.FLOAT, torch.bfloat16: cudnn.data_type.BFLOAT16,
                 torch.float16: cudnn.data_type.HALF}[t.dtype]
    tensor.set_output(True).set_dim(dims).set_stride(strides).set_data_type(data_type)


def _input_of(graph, tensors: dict, buffers: dict):
    """The convolution's input: x, or relu(x * scale + shift) when there are a scale and a shift."""
    if "scale" not in buffers:
        return tensors["x"]
    scaled = graph.scale(input=tensors["x"], scale=tensors["scale"], name="scale")
    return graph.relu(input=graph.bias(input=scaled, bias=tensors["shift"], name="shift"), name="relu")


def _build_forward(graph, cudnn, tensors: dict, buffers: dict, stride: int, padding: int) -> None:
    y = graph.conv_fprop(image=_input_of(graph, tensors, buffers), weight=tensors["w"], padding=[padding] * 2,
                         stride=[stride] * 2, dilation=[1, 1], name="conv")
    _as_output(y, buffers["y"], cudnn)
    tensors["y"] = y
    tensors["sum"], tensors["squares"] = graph.genstats(input=y, name="stats")
    _as_output(tensors["sum"], buffers["sum"], cudnn)
    _as_output(tensors["squares"], buffers["squares"], cudnn)


def _build_weight_grad(graph, cudnn, tensors: dict, buffers: dict, stride: int, padding: int) -> None:
    dw = graph.conv_wgrad(image=_input_of(graph, tensors, buffers), loss=tensors["grad"], padding=[padding] * 2,
                          stride=[stride] * 2, dilation=[1, 1], name="wgrad")
    _as_output(dw, buffers["dw"], cudnn)
    tensors["dw"] = dw


def _build_prologue_grad(graph, cudnn, tensors: dict, buffers: dict, stride: int, padding: int) -> None:
    x = buffers["x"]
    grad_input = graph.conv_dgrad(loss=tensors["grad"], filter=tensors["w"], padding=[padding] * 2,
                                  stride=[stride] * 2, dilation=[1, 1], name="dgrad")
    grad_input.set_dim(list(x.shape)).set_stride(list(x.stride()))
    pre = graph.bias(input=graph.scale(input=tensors["x"], scale=tensors["scale"], name="scale"),
                     bias=tensors["shift"], name="shift")
    grad_pre = graph.relu_backward(loss=grad_input, input=pre, name="drelu")
    _as_output(grad_pre, buffers["grad_pre"], cudnn)
    by_x = graph.reduction(input=graph.mul(a=grad_pre, b=tensors["x"], name="by_x"), mode=cudnn.reduction_mode.ADD,
                           name="sum_by_x")
    total = graph.reduction(input=grad_pre, mode=cudnn.reduction_mode.ADD, name="sum")
    _as_output(by_x, buffers["sum_by_x"], cudnn)
    _as_output(total, buffers["sum"], cudnn)
    tensors.update(grad_pre=grad_pre, sum_by_x=by_x, sum=total)


_BUILDERS: dict[str, Callable] = {"forward": _build_forward, "weight_grad": _build_weight_grad,
                                  "prologue_grad": _build_prologue_grad}
_INPUTS = {"forward": ("x", "w", "scale", "shift"), "weight_grad": ("x", "grad", "scale", "shift"),
           "prologue_grad": ("x", "w", "grad", "scale", "shift")}
_REDUCED = ("sum", "squares", "sum_by_x")  # per-channel sums: zeroed before each run if cuDNN adds to them


class _Graph:
    """One cuDNN graph for one kind and shape, with its fastest plan."""

    def __init__(self, cudnn, handle, kind: str, buffers: dict[str, Tensor], stride: int, padding: int):
        io_type = cudnn.data_type.BFLOAT16 if buffers["x"].dtype == torch.bfloat16 else cudnn.data_type.HALF
        graph = cudnn.pygraph(io_data_type=io_type, intermediate_data_type=cudnn.data_type.FLOAT,
                              compute_data_type=cudnn.data_type.FLOAT, handle=handle)
        self.tensors = {name: _like(graph, name, buffers[name]) for name in _INPUTS[kind] if name in buffers}
        _BUILDERS[kind](graph, cudnn, self.tensors, buffers, stride, padding)
        graph.validate()
        if handle is None:  # validated only: no GPU to build plans for
            self.graph = None
            return
        started = time.perf_counter()
        graph.build_operation_graph()
        graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        graph.check_support()
        self.graph, self.handle, self.cudnn = graph, handle, cudnn
        plans = self._build_plans()
        self.workspace_bytes = max(graph.get_workspace_size_plan_at_index(i) for i in plans)
        self.sums = [name for name in _REDUCED if name in buffers]
        self.zeroes = True  # until shown that cuDNN writes its sums rather than adding to them
        self.plan = self._fastest(buffers, plans)
        self.zeroes = self._adds_to_sums(buffers)
        self.plan_name = graph.get_plan_name_at_index(self.plan)
        self.build_seconds = time.perf_counter() - started

    def _build_plans(self) -> list[int]:
        """Builds the heuristics' first plans, up to _PLANS_TIMED that build: building a
        runtime-fusion plan compiles its kernel, so building all of them (dozens, for some
        graphs) would cost minutes at start-up."""
        built = []
        for index in range(self.graph.get_execution_plan_count()):
            try:
                self.graph.build_plan_at_index(index)
            except (self.cudnn.cudnnGraphNotSupportedError, RuntimeError):
                continue
            built.append(index)
            if len(built) == _PLANS_TIMED:
                break
        if not built:
            raise RuntimeError("cuDNN built none of its execution plans")
        return built

    def run(self, buffers: dict[str, Tensor], plan: int | None = None) -> None:
        if self.zeroes:
            for name in self.sums:
                buffers[name].zero_()
        device = buffers["x"].device
        workspace = torch.empty(self.workspace_bytes, dtype=torch.uint8, device=device)
        self.cudnn.set_stream(handle=self.handle, stream=torch.cuda.current_stream(device).cuda_stream)
        self.graph.execute_plan_at_index({self.tensors[name]: buffers[name] for name in self.tensors}, workspace,
                                         self.plan if plan is None else plan, handle=self.handle)

    def _adds_to_sums(self, buffers: dict[str, Tensor]) -> bool:
        """Whether the chosen plan adds its sums to what the outputs held (cuDNN does not say);
        if not, the zeroing kernels before each run are left out."""
        if not self.sums:
            return False
        self.run(buffers)
        written = {name: buffers[name].clone() for name in self.sums}
        for name in self.sums:
            buffers[name].fill_(1e6)
        self.zeroes = False
        self.run(buffers)
        self.zeroes = True
        return any(bool(((buffers[name] - written[name]).abs() > 1e5).any()) for name in self.sums)

    def _fastest(self, buffers: dict[str, Tensor], plans: list[int]) -> int:
        """The plan that ran these buffers fastest (as cudnn.benchmark picks convolution
        algorithms); plans that fail to run are passed over."""
        times = {}
        for plan in plans:
            try:
                self.run(buffers, plan)  # warm-up
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(3):
                    self.run(buffers, plan)
                end.record()
                end.synchronize()
                times[plan] = start.elapsed_time(end)
            except Exception:  # a plan cuDNN built but cannot run here
                continue
        if not times:
            raise RuntimeError("none of cuDNN's plans ran")
        return min(times, key=times.get)


class _GraphCache:
    """A graph per (kind, device, shapes, strides, dtypes), built on first use; None for those
    cuDNN declines (PyTorch's operators then run them, with a warning)."""

    def __init__(self):
        self._graphs: dict[tuple, _Graph | None] = {}
        self.declined: dict[tuple, str] = {}
        self._handles: dict[int, object] = {}
        self._lock = threading.Lock()

    def summary(self) -> dict:
        """How many graphs run, by kind; the engines cuDNN chose for them and the seconds it
        took to build and time them; and why cuDNN declined the others."""
        fused: dict[str, int] = {}
        engines: dict[str, int] = {}
        adding: set[str] = set()
        seconds = 0.0
        for key, graph in self._graphs.items():
            if graph is not None:
                fused[key[0]] = fused.get(key[0], 0) + 1
                engine = f"{key[0]}: {graph.plan_name}"
                engines[engine] = engines.get(engine, 0) + 1
                seconds += graph.build_seconds
                if graph.zeroes and graph.sums:
                    adding.add(key[0])
        return {"fused": fused, "engines": engines, "build_seconds": round(seconds, 2),
                "declined": sorted(set(self.declined.values())), "sums_added_to": sorted(adding)}

    def get(self, kind: str, buffers: dict[str, Tensor], stride: int, padding: int) -> _Graph | None:
        key = (kind, buffers["x"].device.index, stride, padding,
               *((name, tuple(t.shape), t.stride(), t.dtype) for name, t in sorted(buffers.items())))
        if key in self._graphs:
            return self._graphs[key]
        if torch.cuda.is_current_stream_capturing():  # graphs are built and timed before a capture
            return None
        with self._lock:
            if key not in self._graphs:
                cudnn = cudnn_frontend()
                device = buffers["x"].device.index
                if device not in self._handles:
                    with torch.cuda.device(device):
                        self._handles[device] = cudnn.create_handle()
                try:
                    self._graphs[key] = _Graph(cudnn, self._handles[device], kind, buffers, stride, padding)
                except (cudnn.cudnnGraphNotSupportedError, RuntimeError) as exc:
                    self._graphs[key] = None
                    self.declined[key] = f"{kind}: {type(exc).__name__}: {exc}"
                    shapes = ", ".join(f"{name} {tuple(t.shape)}" for name, t in buffers.items() if t.dim() == 4)
                    warnings.warn(f"cuDNN declined the fused {kind} graph for {shapes} (stride {stride}); "
                                  f"PyTorch's operators run it ({self.declined[key][:200]})", stacklevel=4)
        return self._graphs[key]


_graphs = _GraphCache()


def summary() -> dict:
    """Which of cuDNN's fused graphs this process runs, and why it declined others."""
    return _graphs.summary()


def validate_graphs(kind: str, buffers: dict[str, Tensor], stride: int, padding: int) -> None:
    """Builds the graph of ``kind`` for ``buffers`` (meta tensors will do) and runs the cuDNN
    frontend's own checks of it, without a GPU; raises what they raise."""
    _Graph(cudnn_frontend(), None, kind, buffers, stride, padding)
