"""A training step captured as CUDA graphs and replayed: forward, loss, backward, the gradient
all-reduce of data parallel, clipping, the optimizer's update, anything else the step does,
replayed with a single launch. ``Trainer`` (``--compile-mode reduce-overhead``) and
``Accelerator.capture`` both use :class:`CapturedStep`.

Why: eager PyTorch launches each kernel from Python, and torch.compile's own graphs (mode
reduce-overhead) cover the forward and backward passes separately, replayed through Python
bookkeeping, with the optimizer launched kernel by kernel around them. For a small network
the host, not the GPU, then sets the pace: launching a step's kernels takes longer than the GPU
takes to run them. Captured once (PyTorch's "whole network capture"), a replay costs
the host a few copies and one launch.

What changes per step enters through tensors the graph reads: the step's tensor arguments
(copied into static ones) and each optimizer group's learning rate (filled from the float the
scheduler set). Optimizers become capturable (:func:`make_capturable`); their state is created
before the recording, as the first eager step would (:func:`prepare_graph_state`). State must
stay where it was recorded: parameters, buffers, gradients and optimizer state are updated in
place, and state loaded into them must be copied in place too; after replacing any of them,
:meth:`CapturedStep.release` and record again.

A recording is specific to its arguments' shapes, dtypes and non-tensor values: each such
signature is recorded once (up to ``max_shapes``, each with its own memory pool, so they may be
replayed in any order); another runs the step eagerly.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable

import torch
from torch.utils._pytree import tree_flatten, tree_map

from ..device import capturable_region
from ..errors import GpuaccelError

# PyTorch optimizers whose fused CUDA kernel updates every parameter in one launch; it reads a
# tensor learning rate and keeps its step count on the device, so a graph can hold it
FUSED_ON_CUDA = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)


def capture_obstacle(device: torch.device, precision, *, sharded: bool = False, pipelined: bool = False,
                     sync_batchnorm: bool = False, checkpointed: bool = False,
                     compiled_graphs: bool = False) -> str | None:
    """None when a training step on these terms can be recorded as one CUDA graph, else why not.
    Both doors ask here: ``Trainer`` for its settings before it builds anything, and
    ``Accelerator.capture`` for what was prepared. ``sharded``: FSDP; ``pipelined``: pipeline
    stages; ``sync_batchnorm``: SyncBatchNorm layers; ``checkpointed``: activation checkpointing;
    ``compiled_graphs``: the model was compiled in a mode that records CUDA graphs of its own
    (reduce-overhead; a captured step compiles in mode default and captures those kernels). Every
    cause found is named, in one line."""
    causes = {"CUDA graphs need a GPU": device.type != "cuda",
              "fp16's loss scaling decides on the host whether each step is taken (use bf16)": precision.loss_scaling,
              "FSDP gathers and frees parameters on the host between layers": sharded,
              "pipeline stages exchange activations on a host-driven schedule": pipelined,
              "SyncBatchNorm masks out empty processes' statistics (a host synchronisation)": sync_batchnorm,
              "activation checkpointing is not recorded inside a step graph": checkpointed,
              "torch.compile's mode reduce-overhead records CUDA graphs of its own (compile in mode default; the "
              "captured step records the compiled kernels)": compiled_graphs}
    found = [cause for cause, present in causes.items() if present]
    return "; ".join(found) if found else None


def make_capturable(optimizer: torch.optim.Optimizer) -> str | None:
    """Prepares a PyTorch optimizer on CUDA parameters for a captured step, and for speed: the
    fused kernel where PyTorch has one (Adam, AdamW, SGD), and ``capturable=True`` where it has
    the option (its step count on the device, no host synchronisation: Adam, AdamW, Adadelta,
    Adamax, NAdam, RAdam, RMSprop, ...).
    Returns None, or why the optimizer cannot be captured. Off CUDA nothing changes."""
    groups = optimizer.param_groups
    params = [p for g in groups for p in g["params"]]
    if not params or not all(p.is_cuda for p in params):
        return None
    name = f"torch.optim.{type(optimizer).__name__}" if type(optimizer).__module__.startswith("torch.optim") \
        else type(optimizer).__qualname__
    if any(g.get("differentiable") for g in groups):
        return f"{name} was created with differentiable=True, which has no capturable update"
    fused = type(optimizer) in FUSED_ON_CUDA and all(p.is_floating_point() for p in params)
    if not fused and "capturable" not in optimizer.defaults and _holds_steps_on_host(optimizer):
        return f"{name} keeps its state on the host and has no capturable option"
    for group in groups:
        if fused:
            group.update(fused=True, foreach=False)
        if "capturable" in optimizer.defaults:  # (Adam's fused kernel still checks it under capture)
            group["capturable"] = True
    for p in params:  # a step count loaded from a checkpoint (or made eagerly) moves to the device
        step = optimizer.state.get(p, {}).get("step")
        if isinstance(step, torch.Tensor) and step.device != p.device:
            optimizer.state[p]["step"] = step.to(p.device, torch.float32)
    return None


def _holds_steps_on_host(optimizer: torch.optim.Optimizer) -> bool:
    """PyTorch's own optimizers without a capturable or fused update (LBFGS, SparseAdam, ...)."""
    return type(optimizer).__module__.startswith("torch.optim")


def prepare_graph_state(optimizer: torch.optim.Optimizer) -> None:
    """Creates the optimizer state a captured step reads, as a first eager step would: Adam's
    moments as zeros and its step count on the device; SGD's momentum buffers as zeros (the
    first update is then the same as PyTorch's first step, which copies the gradient); an
    optimizer's own ``init_state()`` where it has one (gpuaccel's Muon). Created inside the
    recording, they would be zeroed again by every replay. Other optimizers' state comes from
    the eager steps before the recording."""
    if hasattr(optimizer, "init_state"):
        optimizer.init_state()
        return
    adam = isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW))
    sgd = isinstance(optimizer, torch.optim.SGD)
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state[p]
            if adam and not state:
                state.update(step=torch.zeros((), dtype=torch.float32, device=p.device),
                             exp_avg=torch.zeros_like(p, memory_format=torch.preserve_format),
                             exp_avg_sq=torch.zeros_like(p, memory_format=torch.preserve_format))
                if group.get("amsgrad"):
                    state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            elif sgd and group.get("momentum") and state.get("momentum_buffer") is None:
                state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)


@contextlib.contextmanager
def tensor_learning_rates(optimizers: list[torch.optim.Optimizer], rates: list[list[torch.Tensor]]):
    """While inside, each group's learning rate is its tensor in ``rates`` (filled from the float
    first), so that a step recorded here reads the rate at replay, not the one of the recording."""
    groups = [g for opt in optimizers for g in opt.param_groups]
    tensors = [t for per_optimizer in rates for t in per_optimizer]
    floats = [g["lr"] for g in groups]
    for group, tensor in zip(groups, tensors):
        tensor.fill_(group["lr"])
        group["lr"] = tensor
    try:
        yield
    finally:
        for group, rate in zip(groups, floats):
            group["lr"] = rate


_PLAIN = (int, float, str, bool, type(None))


def signature(args) -> tuple:
    """What a recording is specific to: the arguments' structure, their tensors' shapes, dtypes and
    devices, their plain values (numbers, strings) and which other objects they are (a model, an
    optimizer: the same object, whatever its state)."""
    leaves, spec = tree_flatten(args)
    return (spec,) + tuple((x.shape, x.dtype, x.device) if isinstance(x, torch.Tensor) else
                           x if isinstance(x, _PLAIN) else (type(x), id(x)) for x in leaves)


@contextlib.contextmanager
def _recording(graph: torch.cuda.CUDAGraph):
    """``torch.cuda.graph(graph)`` that leaves the device's random number generator usable when
    the capture fails. torch takes the generator out of its capturing state only at the end of a
    capture that succeeds; after a failed one, every random draw outside a graph raised "Offset
    increment outside graph capture encountered unexpectedly" (torch 2.11), in whatever the
    process did next. The generator gets back a copy of its state from before the capture."""
    generator = torch.cuda.default_generators[torch.cuda.current_device()]
    before = generator.clone_state()
    try:
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            yield
    except BaseException:
        generator.graphsafe_set_state(before)
        raise


class _Recording:
    """One signature's graph, the static tensors it reads (the arguments) and what it returns."""

    def __init__(self):
        self.calls = 0
        self.graph: torch.cuda.CUDAGraph | None = None
        self.outputs = None
        self.args = None
        self._static: list[tuple[int, torch.Tensor]] = []  # (position among the leaves, static tensor)

    def keep(self, args) -> None:
        """Copies of ``args``' tensors, stride for stride (a compiled model guards on strides: a
        contiguous copy of a strided view would be compiled again, inside the recording): what
        the recording reads, refilled before each replay."""
        self.args = tree_map(_same_layout_copy, args)
        self._static = [(i, x) for i, x in enumerate(tree_flatten(self.args)[0]) if isinstance(x, torch.Tensor)]

    def copy_in(self, args) -> None:
        leaves = tree_flatten(args)[0]
        for i, static in self._static:
            static.copy_(leaves[i], non_blocking=True)


class CapturedStep:
    """``fn(*args)``, a whole training step, captured as CUDA graphs and replayed.

    Called as it is (``Accelerator.capture``): for each argument signature, the first ``warmup``
    calls run ``fn`` eagerly on a side stream, as real steps (compilation, cuDNN's algorithm
    search and library workspaces happen there, not in the graph); the next call records ``fn``
    on copies of its arguments and replays the recording (recording runs nothing); every later
    call copies its tensors into those copies and replays. What ``fn`` returns is the recording's
    output, overwritten by the next replay. Driven (``Trainer``): :meth:`warm` runs the step on
    each signature training will see, the caller restores its state, then :meth:`record`.

    A step that cannot be captured (a host synchronisation such as ``.item()`` inside it, an
    optimizer without a capturable update) runs eagerly from then on, after one warning that
    names the cause; ``strict=True`` raises :class:`GpuaccelError` instead. Off a GPU ``fn`` runs
    as it is."""

    def __init__(self, fn: Callable, optimizers: list[torch.optim.Optimizer], device: torch.device, *,
                 warmup: int = 3, max_shapes: int = 4, strict: bool = False, uncaptured: str | None = None):
        """``optimizers``: those ``fn`` steps (made capturable, their learning rates read at replay);
        ``uncaptured``: why this step is never captured (it then always runs eagerly)."""
        self.fn, self.optimizers, self.device = fn, list(optimizers), device
        self.warmup, self.max_shapes, self.strict = warmup, max_shapes, strict
        self.recordings: dict[tuple, _Recording] = {}
        self.uncaptured = uncaptured  # why every call runs eagerly (None: it need not)
        self.on_gpu = device.type == "cuda"
        self._rates = [[torch.zeros((), device=device) for _ in opt.param_groups] for opt in self.optimizers] \
            if self.on_gpu else []
        self._prepared = False
        functools.update_wrapper(self, fn, updated=())

    @property
    def captured(self) -> bool:
        return any(r.graph is not None for r in self.recordings.values())

    def _learning_rates_as_tensors(self):
        return tensor_learning_rates(self.optimizers, self._rates)

    def _prepare_optimizers(self) -> None:
        if self._prepared:
            return
        self._prepared = True
        for optimizer in self.optimizers:
            obstacle = make_capturable(optimizer)
            if obstacle is not None:
                self._give_up(obstacle)
                return

    # ------------------------------------------------------------------ calling

    def __call__(self, *args):
        if not self.on_gpu or self.uncaptured is not None:
            return self.fn(*args)
        self._prepare_optimizers()
        if self.uncaptured is not None:  # (no capturable update)
            return self.fn(*args)
        key = signature(args)
        recording = self.recordings.get(key)
        if recording is None:
            if len(self.recordings) >= self.max_shapes:
                return self._call(args)  # (a rare signature: eagerly rather than one more memory pool)
            recording = self.recordings[key] = _Recording()
        if recording.graph is not None:
            return self._replay(recording, args)
        recording.calls += 1
        if recording.calls <= self.warmup:
            return self._on_side_stream(args)
        recording.keep(args)
        if not self._record(recording):
            return self.fn(*args)  # (the failed recording ran nothing: this call's step, eagerly, uncaptured now)
        recording.graph.replay()
        return recording.outputs

    def _on_side_stream(self, args):
        """An eager step on a side stream, as ``torch.cuda.make_graphed_callables`` warms up: the
        memory and library workspaces it sets up are then not tied to the capture stream."""
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side), self._learning_rates_as_tensors():
            outputs = self._call(args)
        torch.cuda.current_stream(self.device).wait_stream(side)
        return outputs

    def _call(self, args):
        """The step function on ``args``, as a step that is captured runs it (its autocast keeps
        no cache, in the warm-up as in the recording: ``device.capturable_region``), its outputs
        without their autograd graph (:func:`_without_autograd_graph`)."""
        with capturable_region():
            return _without_autograd_graph(self.fn(*args))

    def _replay(self, recording: _Recording, args):
        recording.copy_in(args)
        for optimizer, rates in zip(self.optimizers, self._rates):
            for group, rate in zip(optimizer.param_groups, rates):
                rate.fill_(group["lr"])
        recording.graph.replay()
        return recording.outputs

    # ------------------------------------------------------------------ driven by Trainer

    def warm(self, *args, steps: int = 3) -> None:
        """Runs the step ``steps`` times eagerly (on a side stream, off a GPU as it is) and keeps
        copies of ``args`` for :meth:`record`. It trains: save and restore the state around it."""
        if self.on_gpu and self.uncaptured is None:
            self._prepare_optimizers()
            recording = self.recordings.setdefault(signature(args), _Recording())
            if recording.args is None:
                recording.keep(args)
            else:  # (warmed again, e.g. step by step: the same tensors, refilled)
                recording.copy_in(args)
            args = recording.args  # (warmed on the very tensors the recording will read)
        for _ in range(steps):
            if self.on_gpu and self.uncaptured is None:
                self._on_side_stream(args)
            else:
                self.fn(*args)

    def record(self) -> None:
        """Records the step for each signature :meth:`warm` saw (on a GPU; a no-op elsewhere)."""
        if not self.on_gpu or self.uncaptured is not None:
            return
        for recording in self.recordings.values():
            if recording.graph is None and recording.args is not None and not self._record(recording):
                return

    def _record(self, recording: _Recording) -> bool:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=True)  # gradients are then allocated by the graph, once
            prepare_graph_state(optimizer)
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        try:
            with self._learning_rates_as_tensors(), _recording(graph):
                outputs = self._call(recording.args)
        except RuntimeError as exc:
            self._give_up(_cause(exc))
            return False
        recording.graph, recording.outputs = graph, outputs
        return True

    def _give_up(self, cause: str) -> None:
        message = (f"the step cannot be captured as one CUDA graph: {cause}. A captured step must launch the same "
                   f"kernels every call without waiting for the GPU: no .item(), .cpu(), .tolist(), print(tensor) "
                   f"or 'if tensor ...' inside it")
        if self.strict:
            raise GpuaccelError(message) from None
        warnings.warn(message + "; it runs uncaptured", stacklevel=4)
        self.release()
        self.uncaptured = cause

    def release(self) -> None:
        """Frees the recordings (the next calls warm up and record again). A graph holding a
        recorded NCCL all-reduce must go before its process group is destroyed: with one alive,
        every process of a 4-GPU run hung at exit (torch 2.11, NCCL)."""
        if self.captured:
            torch.cuda.synchronize(self.device)
        for recording in self.recordings.values():
            if recording.graph is not None:
                recording.graph.reset()
        self.recordings.clear()


def _without_autograd_graph(outputs):
    """A step's outputs detached. A returned loss that kept its autograd graph would keep the
    parameters' gradient-accumulation nodes alive into the next call, which records on another
    stream than the one they were made on (PyTorch warns "The AccumulateGrad node's stream does
    not match ..."). The step has run its backward pass already: the graph has no use after it."""
    return tree_map(lambda x: x.detach() if isinstance(x, torch.Tensor) else x, outputs)


def _same_layout_copy(value):
    if not isinstance(value, torch.Tensor):
        return value
    if 0 in value.stride():  # (an expanded tensor: its elements share memory; a dense copy will do)
        return value.clone()
    copy = torch.empty_strided(value.size(), value.stride(), dtype=value.dtype, device=value.device)
    return copy.copy_(value)


def _cause(exc: BaseException) -> str:
    """The first failure behind a failed capture (its end raises errors of its own), in words
    that say what to change where PyTorch's do not."""
    chain = []
    while exc is not None and len(chain) < 8:
        chain.append(exc)
        exc = exc.__context__ or exc.__cause__
    for failure in chain:  # e.g. "... for an instance of Adadelta but param_groups' capturable is False"
        text = str(failure)
        if "capturable is False" in text:
            name = text.split("instance of ")[-1].split()[0] if "instance of " in text else "the optimizer"
            return f"{name} was not capturable (create it with capturable=True, or pass it to prepare())"
    first = chain[-1]
    text = str(first).strip().splitlines()[0] if str(first).strip() else type(first).__name__
    if "not permitted when stream is capturing" in text:
        return f"something in it waits for the GPU ({text})"
    return text
