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
import threading
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


# ---------------------------------------------------------------------------------------------
# A loop's body captured where it is written


_ACTIVE = threading.local()  # the CapturedLoop whose body is running in this thread, if any


def active_loop() -> CapturedLoop | None:
    """The captured loop whose body is being run (warmed up or recorded) here, or None:
    ``Accelerator.timed`` functions hand their calls to it."""
    return getattr(_ACTIVE, "loop", None)


@contextlib.contextmanager
def _running(loop: CapturedLoop):
    if active_loop() is not None:
        raise GpuaccelError("acc.captured(): a captured loop inside another one's body (capture the outer one)")
    _ACTIVE.loop = loop
    try:
        yield
    finally:
        _ACTIVE.loop = None


class CapturedLoop:
    """``for item in acc.captured(items): body``: the loop's whole body, over all of ``items``,
    recorded as CUDA graphs and replayed, where it is written (``Accelerator.captured``).

    Python cannot skip a block, but a ``for`` runs its body once per item its iterable yields.
    This one yields ``items`` for ``warmup`` passes, run eagerly on a side stream, and once more
    while recording; from then on iterating it replays the recording and yields nothing, so the
    body is skipped. Code after the loop (clipping, the optimizer's step, zeroing) runs eagerly.

    A batch enters through a function wrapped by ``Accelerator.timed``, called inside the body
    (nanoGPT's ``X, Y = get_batch('train')``, halfway through a micro-step). The recording ends a
    graph at each such call, fetches eagerly into a buffer of its own and records on in the next
    graph; a replay runs graph, fetch, graph, ... The function is called again with the
    arguments of the recording, so it must draw its batches itself (a sampler, an iterator), and
    the sequence of calls must be the same every pass (checked over the warm-up). The batch the
    body reads before its first fetch, the one fetched last in the pass before, is a buffer too:
    the last fetch of the warm-up is returned in it, and each replay copies its last fetch in.

    Before recording, the last warm-up pass checks that the body never waits for the GPU
    (``.item()``, ``.cpu()``, a condition on a tensor): such a body, one that fetches no batch,
    or one whose fetches differ from pass to pass, runs eagerly from then on, after one warning
    naming the cause (``strict=True``: a :class:`GpuaccelError` instead).

    Gradients stay where the recording put them: after each replay they are put back on the
    parameters (a ``zero_grad(set_to_none=True)`` after the loop dropped them), and gradients
    the recording accumulated into are refilled from the parameters' before it."""

    def __init__(self, items: list, device: torch.device, parameters: Callable[[], list[torch.Tensor]], *,
                 warmup: int = 3, strict: bool = False, uncaptured: str | None = None):
        """``parameters``: returns the parameters whose gradients the body computes."""
        self.items, self.device, self.parameters = items, device, parameters
        self.warmup, self.strict, self.uncaptured = max(2, warmup), strict, uncaptured
        self.on_gpu = device.type == "cuda"
        self.passes = 0
        self.fetches: list[tuple] | None = None  # what the body fetched in its previous pass (keys)
        self.feed = None  # the batch the body reads before its first fetch (a buffer, from the last warm-up on)
        self.graphs: list[torch.cuda.CUDAGraph] = []  # one more than the fetches
        self.calls: list[tuple] = []  # (call, args, kwargs) of each fetch, as recorded
        self.buffers: list = []  # each fetch's batch, as the graphs read it
        self._seen: list[tuple] = []
        self._mode: str | None = None  # "warm", "probe" (the last warm-up pass), "record"
        self._graph: torch.cuda.CUDAGraph | None = None
        self._pool = None
        self._stream: torch.cuda.Stream | None = None
        self._grads_before: list[tuple] = []  # (parameter, its gradient when the recording began, or None)
        self._grads_after: list[tuple] = []  # (parameter, the gradient the graphs write)

    @property
    def captured(self) -> bool:
        return bool(self.graphs)

    def __iter__(self):
        if not self.on_gpu or (self.uncaptured is not None and self._stream is None):
            yield from self.items
            return
        if self.uncaptured is not None:  # (given up after warming up: on the stream the warm-up ran on, whose
            yield from self._on_side_stream()  # gradient-accumulation nodes a loss kept alive may still hold)
            return
        if self.graphs:
            self._replay()
            return
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        self.passes += 1
        if self.passes <= self.warmup:
            yield from self._warm(last=self.passes == self.warmup)
        else:
            yield from self._record()

    # ------------------------------------------------------------------ fetching

    def fetch(self, fn, call: Callable, args: tuple, kwargs: dict):
        """A ``timed`` function's call inside the body: ``call(*args, **kwargs)`` fetches the batch."""
        index = len(self._seen)
        key = _fetch_key(fn, args, kwargs)
        self._seen.append(key)
        if self._mode != "record":
            with _syncs_allowed():
                batch = call(*args, **kwargs)
            if self._mode == "probe" and self.fetches is not None and index == len(self.fetches) - 1:
                self.feed = tree_map(_same_layout_copy, batch)  # (what the next pass, the recording, reads first)
                return self.feed
            return batch
        if self.fetches is None or index >= len(self.fetches) or key != self.fetches[index]:
            raise GpuaccelError(f"acc.captured(): the body's fetch number {index + 1} ({_name(fn)}) differs from "
                                f"the warm-up's while it was being recorded")
        self._end_graph()
        batch = call(*args, **kwargs)
        self.calls.append((call, args, kwargs))
        self.buffers.append(tree_map(_same_layout_copy, batch))
        self._begin_graph()
        return self.buffers[-1]

    # ------------------------------------------------------------------ warming up, recording, replaying

    def _warm(self, last: bool):
        self._seen, self._mode = [], "probe" if last else "warm"
        current = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(current)
        completed = False
        try:
            with torch.cuda.stream(self._stream), capturable_region(), _running(self), \
                    _host_syncs_noted(last) as syncs:
                yield from self.items
            completed = True
        finally:
            self._mode = None
            current.wait_stream(self._stream)
        if not completed:
            return
        if self.fetches is not None and self._seen != self.fetches:
            self._give_up(f"the body fetched other batches than in the pass before ({len(self.fetches)} calls, "
                          f"then {len(self._seen)}; or other arguments)")
        self.fetches = self._seen
        if last and syncs:
            self._give_up(f"something in it waits for the GPU ({syncs[0]})")
        elif last and not self.fetches:
            self._give_up("its body fetches no batch through a function wrapped by acc.timed(), so every replay "
                          "would read the recording's batch")

    def _on_side_stream(self):
        current = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(current)
        try:
            with torch.cuda.stream(self._stream):
                yield from self.items
        finally:
            current.wait_stream(self._stream)

    def _record(self):
        parameters = self.parameters()
        self._grads_before = [(p, p.grad) for p in parameters]
        self._seen, self.calls, self.buffers, self.graphs = [], [], [], []
        current = torch.cuda.current_stream(self.device)
        torch.cuda.synchronize(self.device)
        generator = torch.cuda.default_generators[self.device.index if self.device.index is not None
                                                   else torch.cuda.current_device()]
        before = generator.clone_state()
        self._pool = torch.cuda.graph_pool_handle()
        self._stream.wait_stream(current)
        self._mode = "record"
        try:
            with torch.cuda.stream(self._stream), capturable_region(), _running(self):
                self._begin_graph()
                yield from self.items
                self._end_graph()
        except GeneratorExit:  # the body left the loop (a break, an exception): the recording is incomplete
            self._abandon(generator, before)
            self.uncaptured = "the body left the loop while it was being recorded (a break or an exception)"
            raise
        except RuntimeError as exc:  # (ending a graph failed: the pass ran nothing, so it cannot go unnoticed)
            self._abandon(generator, before)
            self.uncaptured = _cause(exc)
            raise GpuaccelError(f"acc.captured(): recording the loop failed: {self.uncaptured}") from None
        finally:
            self._mode = None
            current.wait_stream(self._stream)
        same = _same_structure(self.feed, self.buffers[-1]) if self.buffers else False
        self._run(fetching=False, feeding=same)  # (recording ran nothing; its fetches are in their buffers)
        self._grads_after = [(p, p.grad) for p in parameters if p.grad is not None]
        self._put_grads_back()
        if not same:
            self._give_up("its last fetch returns another structure or shape than the one its body reads first")

    def _begin_graph(self) -> None:
        self._graph = torch.cuda.CUDAGraph()
        self._graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")

    def _end_graph(self) -> None:
        with warnings.catch_warnings():  # (a body that fetches first begins with an empty graph: harmless)
            warnings.filterwarnings("ignore", message="The CUDA Graph is empty")
            self._graph.capture_end()
        self.graphs.append(self._graph)
        self._graph = None

    def _replay(self) -> None:
        stale = []
        for p, before in self._grads_before:
            if before is None or p.grad is before:
                continue
            if p.grad is None:
                stale.append(before)  # (set to None since: the recording accumulates into zeros)
            else:
                before.copy_(p.grad)
        if stale:
            torch._foreach_zero_(stale)
        self._run(fetching=True, feeding=True)
        self._put_grads_back()

    def _run(self, fetching: bool, feeding: bool) -> None:
        for i, graph in enumerate(self.graphs):
            graph.replay()
            if fetching and i < len(self.calls):
                call, args, kwargs = self.calls[i]
                _copy_batch(self.buffers[i], call(*args, **kwargs))
        if feeding and self.buffers:
            _copy_batch(self.feed, self.buffers[-1])

    def _put_grads_back(self) -> None:
        for p, grad in self._grads_after:
            if p.grad is not grad:
                p.grad = grad

    def _abandon(self, generator, state) -> None:
        """Ends a recording that cannot be completed, leaving the random number generator usable."""
        if self._graph is not None:
            with contextlib.suppress(RuntimeError):
                self._graph.capture_end()
            self._graph = None
        generator.graphsafe_set_state(state)
        self.release()

    def _give_up(self, cause: str) -> None:
        message = f"acc.captured(): the loop cannot be captured: {cause}"
        if self.strict:
            raise GpuaccelError(message)
        warnings.warn(message + "; it runs uncaptured", stacklevel=4)
        self.release()
        self.uncaptured = cause

    def release(self) -> None:
        """Frees the recording (the loop then warms up and records again, unless it gave up)."""
        if self.graphs:
            torch.cuda.synchronize(self.device)
        for graph in self.graphs:
            graph.reset()
        self.graphs, self.calls, self.buffers = [], [], []
        self._grads_before, self._grads_after, self.feed = [], [], None
        self.passes, self.fetches = 0, None


def _fetch_key(fn, args, kwargs) -> tuple:
    """Which call a fetch is: the function and its arguments (plain values by value, others by identity)."""
    leaves, spec = tree_flatten((args, kwargs))
    return (id(fn), spec) + tuple(x if isinstance(x, _PLAIN) else (type(x), id(x)) for x in leaves)


def _name(fn) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__name__


def _same_structure(a, b) -> bool:
    (xs, a_spec), (ys, b_spec) = tree_flatten(a), tree_flatten(b)
    return a_spec == b_spec and all(
        (x.shape, x.dtype, x.device) == (y.shape, y.dtype, y.device) if isinstance(x, torch.Tensor) else
        not isinstance(y, torch.Tensor) for x, y in zip(xs, ys))


def _copy_batch(buffer, batch) -> None:
    """Copies a fetched batch into the buffer the graphs read (a batch of another shape is refused:
    the graphs were recorded for the buffer's)."""
    if not _same_structure(buffer, batch):
        raise GpuaccelError("acc.captured(): a fetch returned a batch of another structure or shape than the "
                            "recorded one; a captured loop needs batches of one shape (capture a step function "
                            "instead: acc.capture records each shape)")
    for static, value in zip(tree_flatten(buffer)[0], tree_flatten(batch)[0]):
        if isinstance(static, torch.Tensor):
            static.copy_(value, non_blocking=True)


@contextlib.contextmanager
def _host_syncs_noted(on: bool):
    """While inside (when ``on``), notes each operation that waits for the GPU (PyTorch's sync debug
    mode), in the list it yields; other warnings are passed on."""
    if not on:
        yield []
        return
    found: list[str] = []
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _set_sync_debug_mode("warn")
        try:
            yield found
        finally:
            _set_sync_debug_mode(previous)
    for w in caught:
        if "called a synchronizing CUDA operation" in str(w.message):
            found.append(str(w.message).strip().splitlines()[0])
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)


def _set_sync_debug_mode(mode) -> None:
    with warnings.catch_warnings():  # ("a prototype feature": said once per process, not news to the user)
        warnings.filterwarnings("ignore", message="Synchronization debug mode is a prototype")
        torch.cuda.set_sync_debug_mode(mode)


@contextlib.contextmanager
def _syncs_allowed():
    """A fetch may wait for the GPU (a copy from pageable memory): not what the probe looks for."""
    if not torch.cuda.is_available():
        yield
        return
    previous = torch.cuda.get_sync_debug_mode()
    _set_sync_debug_mode(0)
    try:
        yield
    finally:
        _set_sync_debug_mode(previous)
