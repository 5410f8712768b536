"""The whole training step as one CUDA graph: forward, loss, backward, the gradient
all-reduce of data parallel, gradient clipping, the optimizer's update and the weight
average, replayed with a single launch.

Why: torch.compile's CUDA graphs (mode reduce-overhead) cover the forward and the backward
pass as separate graphs, each replayed through Python bookkeeping, with the loss, the
optimizer and the weight average launched kernel by kernel around them. For a small
network that bookkeeping, not the GPU, sets the pace: measured on an H200 host, 3.6 ms of
host time per FastNet step against about 2 ms of GPU work. Here the model is compiled
without graphs (inductor's fused kernels) and the step is captured once, as in PyTorch's
"whole network capture" recipe; a replay costs the host a few copies and one launch.

What changes per step enters through tensors the graph reads: the batch (its inputs and
targets, any tuple or dict of tensors, copied into static ones), each parameter group's learning rate and the weight average's blend
weight (filled on the host before the replay). The optimizer keeps float learning rates
for the scheduler, logs and checkpoints; only while the graph is captured do its groups
hold the tensors. Momentum buffers are created before the capture (zeros: the same update
as a first step), so the captured update is the steady-state one.

State must stay where the graph was captured: parameters, buffers, gradients and optimizer
state are updated in place, and loading state into them must copy in place too; capture
again after replacing any of them (``Trainer.warm_up`` captures last, after restoring).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten, tree_map

from ..errors import GpuaccelError
from ..tasks import call_model
from .ema import WeightAverage


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


def _copy_into(static, new) -> None:
    tree_map(lambda s, n: s.copy_(n), static, new)


def load_learning_rates(optimizer: torch.optim.Optimizer, lrs: list[torch.Tensor]) -> None:
    """The groups' current (float) learning rates into the tensors a captured step reads."""
    for group, lr in zip(optimizer.param_groups, lrs):
        lr.fill_(group["lr"])


@contextlib.contextmanager
def tensor_learning_rates(optimizer: torch.optim.Optimizer, lrs: list[torch.Tensor]):
    """While inside, each group's learning rate is its tensor in ``lrs`` (filled from the float
    first), so that a step captured here reads the rate at replay, not the one of the capture."""
    load_learning_rates(optimizer, lrs)
    groups = optimizer.param_groups
    rates = [group["lr"] for group in groups]
    for group, lr in zip(groups, lrs):
        group["lr"] = lr
    try:
        yield
    finally:
        for group, rate in zip(groups, rates):
            group["lr"] = rate


def prepare_graph_state(optimizer: torch.optim.Optimizer) -> None:
    """Creates the optimizer state a captured step reads, as the first eager step would: SGD
    momentum buffers as zeros (the first update is then the same as PyTorch's first step,
    which copies the gradient); Adam's moments as zeros and its step count as a device
    tensor (capturable). Created inside the capture, they would be zeroed by every replay."""
    adam = isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW))
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state[p]
            if adam and not state:
                state.update(step=torch.zeros((), dtype=torch.float32, device=p.device),
                             exp_avg=torch.zeros_like(p, memory_format=torch.preserve_format),
                             exp_avg_sq=torch.zeros_like(p, memory_format=torch.preserve_format))
            elif group.get("momentum") and not adam and state.get("momentum_buffer") is None:
                state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def batch_shapes(*trees) -> tuple:
    """What a recording is specific to: the shapes and dtypes of the batch's tensors."""
    return tuple((tuple(t.shape), t.dtype) for t in tree_flatten(trees)[0] if isinstance(t, torch.Tensor))


class _Recording:
    """One captured step: its graph and the tensors it reads (the batch) and writes (the loss)."""

    def __init__(self, inputs, targets):
        self.inputs, self.targets = inputs, targets
        self.graph: torch.cuda.CUDAGraph | None = None
        self.loss: torch.Tensor | None = None


class StepGraph:
    """The training step, captured once per batch shape that :meth:`warm` saw (one, or one per
    size of a progressive-resizing schedule); each recording has its own memory pool, so they
    may be replayed in any order."""

    def __init__(self, model: nn.Module, forward: Callable, optimizer: torch.optim.Optimizer, *,
                 loss_fn: Callable, autocast: Callable[[], contextlib.AbstractContextManager],
                 grad_clip: float | None = None, ema: WeightAverage | None = None,
                 reduce_gradients: Callable[[list[torch.Tensor]], None] | None = None):
        """``forward``: the (compiled) model's call; ``loss_fn(outputs, targets)``: the task's
        loss; ``autocast()``: a fresh autocast context with its weight cache off (a cache would
        hold tensors from before the capture); ``reduce_gradients(grads)``: averages them in
        place over data-parallel processes."""
        self.model, self.forward, self.optimizer, self.loss_fn = model, forward, optimizer, loss_fn
        self.autocast, self.grad_clip, self.ema = autocast, grad_clip, ema
        self.reduce_gradients = reduce_gradients
        device = next(model.parameters()).device
        self.lrs = [torch.zeros((), device=device) for _ in optimizer.param_groups]
        self.ema_weight = torch.zeros((), device=device)
        self.recordings: dict[tuple, _Recording] = {}

    @property
    def captured(self) -> bool:
        return any(r.graph is not None for r in self.recordings.values())

    def _body(self, inputs, targets) -> torch.Tensor:
        self.optimizer.zero_grad(set_to_none=True)  # gradients are then allocated by the graph, once
        with self.autocast():
            loss = self.loss_fn(call_model(self.forward, inputs), targets)
        loss.backward()
        if self.reduce_gradients is not None:
            self.reduce_gradients([p.grad for p in self.model.parameters() if p.grad is not None])
        if self.grad_clip is not None:
            nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
        self.optimizer.step()
        if self.ema is not None:
            self.ema.blend(self.model, self.ema_weight)
        return loss.detach()

    def _load_lrs(self) -> None:
        load_learning_rates(self.optimizer, self.lrs)

    def _tensor_lrs(self):
        return tensor_learning_rates(self.optimizer, self.lrs)

    def warm(self, inputs, targets, steps: int = 3) -> None:
        """Runs the step's code eagerly on a side stream (compilation, cuDNN's algorithm search,
        per-stream library workspaces), as ``torch.cuda.make_graphed_callables`` does, and
        keeps copies of the batch for :meth:`capture` to record this shape with. It trains:
        save and restore the state around it, then call :meth:`capture`."""
        recording = _Recording(tree_map(torch.clone, inputs), tree_map(torch.clone, targets))
        self.recordings.setdefault(batch_shapes(inputs, targets), recording)
        if self.ema is not None:
            self.ema_weight.fill_(1.0)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), self._tensor_lrs():
            for _ in range(steps):
                self._body(recording.inputs, recording.targets)
        torch.cuda.current_stream().wait_stream(side)

    def prepare(self) -> None:
        prepare_graph_state(self.optimizer)

    def capture(self) -> None:
        """Records the step for each shape :meth:`warm` saw. The state it records must not be
        replaced afterwards."""
        self.prepare()
        torch.cuda.synchronize()
        for recording in self.recordings.values():
            recording.graph = torch.cuda.CUDAGraph()
            with self._tensor_lrs(), _recording(recording.graph):
                recording.loss = self._body(recording.inputs, recording.targets)

    def release(self) -> None:
        """Frees the recorded graphs (the next :meth:`capture` records them again). A graph holding
        a captured NCCL all-reduce must go before its process group is destroyed: with one alive,
        every process of a 4-GPU run hung at exit (torch 2.11, NCCL)."""
        if self.captured:
            torch.cuda.synchronize()
        for recording in self.recordings.values():
            if recording.graph is not None:
                recording.graph.reset()
                recording.graph = None

    def run(self, inputs, targets) -> torch.Tensor:
        """One training step on this batch; returns the loss (overwritten by the next step of
        this shape). Before :meth:`capture`, or for a shape that was not warmed, the same code
        runs eagerly (on any device)."""
        if self.ema is not None:
            self.ema_weight.fill_(self.ema.advance())
        recording = self.recordings.get(batch_shapes(inputs, targets))
        if recording is None or recording.graph is None:
            with self._tensor_lrs():
                return self._body(inputs, targets)
        self._load_lrs()
        _copy_into(recording.inputs, inputs)
        _copy_into(recording.targets, targets)
        recording.graph.replay()
        return recording.loss


class CapturedStep:
    """A user's own training step, ``fn(*batch)``, captured as one CUDA graph and replayed:
    what :class:`StepGraph` does for ``Trainer``, for a loop the user keeps
    (``Accelerator.capture``).

    The first ``warmup`` calls run ``fn`` eagerly on a side stream, as real steps (compilation,
    cuDNN's algorithm search and library workspaces happen there, not in the graph). The next
    call records ``fn`` on copies of its arguments, then replays the recording once: recording
    runs nothing. Every later call copies its tensors into those copies and replays. What
    ``fn`` returns is the recording's output, overwritten by the next call.

    ``optimizers``' learning rates are read from tensors at replay, so schedulers keep working;
    Adam's step count moves to the device (``capturable``). Off a GPU, ``fn`` is called as it
    is."""

    def __init__(self, fn: Callable, optimizers: list[torch.optim.Optimizer], device: torch.device, *,
                 warmup: int = 3):
        self.fn, self.optimizers, self.device, self.warmup = fn, optimizers, device, warmup
        self.lrs = [[torch.zeros((), device=device) for _ in opt.param_groups] for opt in optimizers]
        self.calls = 0
        self.graph: torch.cuda.CUDAGraph | None = None
        self.static_args = self.outputs = None

    @property
    def captured(self) -> bool:
        return self.graph is not None

    @contextlib.contextmanager
    def _tensor_lrs(self):
        with contextlib.ExitStack() as stack:
            for optimizer, lrs in zip(self.optimizers, self.lrs):
                stack.enter_context(tensor_learning_rates(optimizer, lrs))
            yield

    def __call__(self, *args):
        if self.device.type != "cuda":
            return self.fn(*args)
        if self.graph is not None:
            return self._replay(args)
        if self.calls == 0:
            for optimizer in self.optimizers:
                _make_capturable(optimizer)
        self.calls += 1
        if self.calls <= self.warmup:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side), self._tensor_lrs():
                outputs = self.fn(*args)
            torch.cuda.current_stream().wait_stream(side)
            return outputs
        return self._capture(args)

    def _capture(self, args):
        self.static_args = tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, args)
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=True)  # gradients are then allocated by the graph, once
            prepare_graph_state(optimizer)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        try:
            with self._tensor_lrs(), _recording(graph):
                outputs = self.fn(*self.static_args)
        except RuntimeError as exc:
            while isinstance(exc.__context__, RuntimeError):  # the first failure, not the capture's end
                exc = exc.__context__
            cause = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise GpuaccelError(
                f"the step cannot be captured as one CUDA graph: {cause}. A captured step must launch the same "
                f"kernels every call without waiting for the GPU: no .item(), .cpu(), .tolist(), print(tensor) or "
                f"'if tensor ...' inside it, no shapes that change; move those out of the step, or call it "
                f"uncaptured") from None
        self.graph, self.outputs = graph, outputs
        graph.replay()  # this call's step: recording ran nothing
        return outputs

    def _replay(self, args):
        def copy(static, new):
            if isinstance(static, torch.Tensor):
                if not isinstance(new, torch.Tensor) or new.shape != static.shape or new.dtype != static.dtype:
                    got = f"{tuple(new.shape)} {new.dtype}" if isinstance(new, torch.Tensor) else repr(new)
                    raise GpuaccelError(f"a captured step takes tensors of the shapes it was captured with: "
                                        f"{tuple(static.shape)} {static.dtype}, got {got} (drop_last=True keeps "
                                        f"the last batch from being short)")
                static.copy_(new, non_blocking=True)
            elif static != new:
                raise GpuaccelError(f"a captured step keeps the non-tensor arguments it was captured with "
                                    f"({static!r}); got {new!r}")

        try:
            tree_map(copy, self.static_args, args)
        except ValueError:  # the structure differs: another number or nesting of arguments
            raise GpuaccelError("a captured step takes arguments of the structure it was captured with") from None
        for optimizer, lrs in zip(self.optimizers, self.lrs):
            load_learning_rates(optimizer, lrs)
        self.graph.replay()
        return self.outputs

    def release(self) -> None:
        """Frees the recording; the next call records again."""
        if self.graph is not None:
            torch.cuda.synchronize()
            self.graph.reset()
            self.graph, self.calls = None, 0


def _make_capturable(optimizer: torch.optim.Optimizer) -> None:
    """An update a graph can hold, reading its learning rate from a tensor: Adam's and AdamW's
    step count on the device (``capturable``); SGD's fused kernel (its multi-tensor path reads
    a tensor rate on the host). Other optimizers are left as they are."""
    if isinstance(optimizer, torch.optim.SGD):
        for group in optimizer.param_groups:
            if not group.get("differentiable"):
                group.update(fused=True, foreach=False)
        return
    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return
    for group in optimizer.param_groups:
        group["capturable"] = True
        for p in group["params"]:
            step = optimizer.state.get(p, {}).get("step")
            if isinstance(step, torch.Tensor) and step.device != p.device:
                optimizer.state[p]["step"] = step.to(p.device, torch.float32)
