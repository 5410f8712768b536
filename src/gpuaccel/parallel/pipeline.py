"""Pipeline parallelism: a plain model split into stages on consecutive processes, with
PyTorch's own ``torch.distributed.pipelining``.

How a model is split: ``pipeline()`` traces the whole model once (``torch.export``) and cuts
the graph before the modules named as split points, so any forward code (flattening, skip
connections, scaling) is kept and parameter names stay those of the plain model. Split
points are chosen automatically so that the stages' forward FLOPs, counted by
``torch.utils.flop_counter`` on meta tensors (no memory, no compute), are as even as
possible; ``split_points`` names them instead. (Adding the bytes each operator moves to the
estimate, so that memory-bound layers on large early feature maps weigh more, was tried:
it put fewer layers in the first stage and ResNet-50 trained slower.) Candidate points are the model's outermost blocks and the layers outside
blocks (the units of activation checkpointing and FSDP).

How a step runs: each batch is cut into ``microbatches`` that flow through the stages,
GPipe (all forwards, then all backwards) or 1F1B (one forward, one backward, which holds
fewer micro-batches' activations). The first stage reads the images, the last computes the
loss; activations and their gradients pass between neighbours as point-to-point sends.
Gradients are the mean over micro-batches, like gradient accumulation; batch norm normalises
each micro-batch by its own statistics.

With more processes than stages, the processes form a (replicas x stages) mesh: each
replica is a whole pipeline that reads its own shard of the data, and each stage's gradients
are averaged over the replicas by one all-reduce after the backward passes.

Training-mode and evaluation-mode behaviour (batch norm, dropout) is fixed when a model is
traced, so the model is traced twice, once in each mode; both traces share the model's
parameters and buffers. Traced stages keep the plain model's module names, which is how
activation checkpointing finds the blocks to wrap in them.
"""

from __future__ import annotations

import contextlib
import copy
import warnings

import torch
import torch.distributed as dist
import torch.fx
import torch.nn as nn
import torch.nn.functional as F

from ..device import new_host_copy
from ..errors import GpuaccelError
from .base import Strategy, refuse_backward_updates
from .checkpointing import checkpoint_submodules, is_block, no_blocks_error

SCHEDULES = ("1f1b", "gpipe")
_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


def split_units(model: nn.Module) -> list[str]:
    """Names of the modules a split may come before, in definition order: blocks, and layers
    outside blocks (containers are looked into)."""
    names = []

    def visit(module: nn.Module, prefix: str) -> None:
        for name, child in module.named_children():
            full = f"{prefix}{name}"
            if isinstance(child, _CONTAINERS) or (not is_block(child) and _holds_block(child)):
                visit(child, full + ".")
            else:
                names.append(full)

    visit(model, "")
    return names


def _holds_block(module: nn.Module) -> bool:
    return any(is_block(m) for m in module.modules())


def unit_costs(model: nn.Module, sample: torch.Tensor) -> list[tuple[str, int]]:
    """(unit name, forward FLOPs) in the order the forward pass runs the units, counted on a
    copy of the model on the meta device (no memory, no compute)."""
    from torch.utils.flop_counter import FlopCounterMode

    units = split_units(model)
    meta = copy.deepcopy(model).to("meta")
    order: list[str] = []
    modules = dict(meta.named_modules())
    handles = [modules[name].register_forward_pre_hook(lambda m, a, name=name: order.append(name))
               for name in units]
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        meta(sample.to("meta"))
    for h in handles:
        h.remove()
    counts = counter.get_flop_counts()
    root = type(model).__name__
    seen, ordered = set(), []
    for name in order:  # a module called twice is still one place to split
        if name not in seen:
            seen.add(name)
            ordered.append((name, int(sum(counts.get(f"{root}.{name}", {}).values()))))
    return ordered


def balanced_split(costs: list[tuple], stages: int) -> list[str]:
    """The ``stages - 1`` unit names to split before so that the costliest stage is as cheap as
    possible (the linear partition problem, by dynamic programming over prefix sums).
    ``costs``: (name, cost) in forward order."""
    n = len(costs)
    if stages > n:
        raise GpuaccelError(f"--pipeline-stages {stages} is more stages than the model has layers to split at "
                            f"({n}: {', '.join(c[0] for c in costs[:8])}{', ...' if n > 8 else ''})")
    prefix = [0]
    for _, c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[s][i]: the least possible largest stage cost when the first i units form s stages
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0
    for s in range(1, stages + 1):
        for i in range(s, n + 1):
            for j in range(s - 1, i):
                value = max(best[s - 1][j], prefix[i] - prefix[j])
                if value < best[s][i]:
                    best[s][i], cut[s][i] = value, j
    points, i = [], n
    for s in range(stages, 1, -1):
        i = cut[s][i]
        points.append(costs[i][0])
    return points[::-1]


class _Stage(nn.Module):
    """One traced stage, with the layout its neighbours expect: point-to-point sends move raw
    storage, so what crosses a stage boundary is contiguous (NCHW), and convolutions inside
    the stage get channels_last."""

    def __init__(self, traced: nn.Module, channels_last: bool):
        super().__init__()
        self.traced = traced
        self.channels_last = channels_last

    def forward(self, *inputs):
        if self.channels_last:
            inputs = tuple(x.contiguous(memory_format=torch.channels_last) if x.ndim == 4 else x for x in inputs)
        out = self.traced(*inputs)
        if isinstance(out, tuple):
            return tuple(o.contiguous() for o in out)
        return out.contiguous()


def _run_compiled_graphs(module: nn.Module) -> None:
    """Traced submodules run their FX graph through an interpreter by default (Python per
    operation); their generated code is the same computation, run directly."""
    from torch.export.unflatten import InterpreterModule

    for m in module.modules():
        if isinstance(m, InterpreterModule) and hasattr(m, "_run_with_interpreter"):
            m._run_with_interpreter = False


class Pipeline:
    """This process's stage of a pipelined model, and the schedules that drive it.

    ``model`` stays whole on the CPU (every process builds it identically); the stage's
    parameters move to ``device``. ``batch_size`` must split into ``microbatches`` equal parts;
    evaluation batches are padded to ``eval_batch_size`` so that every micro-batch has one
    shape."""

    def __init__(self, model: nn.Module, *, stages: int, microbatches: int, schedule: str,
                 split_points: list[str] | None, device: torch.device, input_shape: tuple[int, ...],
                 input_dtype: torch.dtype = torch.float32,
                 batch_size: int, eval_batch_size: int, channels_last: bool, loss_fn=F.cross_entropy,
                 compile_options: dict | None = None, activation_checkpointing: bool = False,
                 autocast_dtype: torch.dtype | None = None):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, SplitPoint, pipeline

        # (stages >= 2, the schedule's name, the micro-batch split and the number of split points
        # are validated with the rest of the training configuration)
        units = unit_costs(model, torch.zeros(batch_size // microbatches, *input_shape, dtype=input_dtype))
        if split_points is None:
            self.split_points = balanced_split(units, stages)
        else:
            known = {name for name, _ in model.named_modules()}
            unknown = [p for p in split_points if p not in known]
            if unknown:
                raise GpuaccelError(f"--split-points: {', '.join(unknown)} is not a module of the model; "
                                    f"candidates: {', '.join(u[0] for u in units[:12])}"
                                    f"{', ...' if len(units) > 12 else ''}")
            self.split_points = list(split_points)
        world = dist.get_world_size() if dist.is_initialized() else 1
        if world % stages:
            raise GpuaccelError(f"--pipeline-stages {stages} needs a multiple of {stages} processes (one per "
                                f"stage in each pipeline; launch with --gpus or torchrun); this run has {world}")
        self.stages, self.replicas, self.microbatches = stages, world // stages, microbatches
        mesh = init_device_mesh(device.type, (self.replicas, stages), mesh_dim_names=("replica", "stage"))
        self.stage_index = mesh["stage"].get_local_rank()
        self.replica_index = mesh["replica"].get_local_rank()
        stage_group = mesh["stage"].get_group()
        micro = batch_size // microbatches
        self.is_first, self.is_last = self.stage_index == 0, self.stage_index == stages - 1

        def trace(train: bool, micro_batch: int):
            model.train(train)
            spec = {name: SplitPoint.BEGINNING for name in self.split_points}
            try:
                with warnings.catch_warnings():  # torch 2.13's pipelining calls a pytree test it deprecates
                    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)")
                    with tracing_precision(model, autocast_dtype):
                        pipe = pipeline(model, mb_args=(torch.zeros(micro_batch, *input_shape, dtype=input_dtype),),
                                        split_spec=spec)
            except Exception as exc:  # export failures are long; the first line says what
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                raise GpuaccelError(f"could not split {type(model).__name__} into pipeline stages "
                                    f"(torch.export: {first})") from None
            finally:
                _remove_split_markers(model, spec)
            if pipe.num_stages != stages:
                raise GpuaccelError(f"split points {', '.join(self.split_points)} gave {pipe.num_stages} stages, "
                                    f"not {stages}: each must be a module the forward pass calls, in order")
            _check_chain(pipe, self.split_points)
            traced = pipe.get_stage_module(self.stage_index)
            _drop_traced_metadata_checks(traced)
            _run_compiled_graphs(traced)
            return traced

        train_traced = trace(True, micro)
        self.eval_batch_size = -(-eval_batch_size // microbatches) * microbatches
        eval_traced = trace(False, self.eval_batch_size // microbatches)
        model.train()
        _share_tied_parameters(model, [train_traced, eval_traced])
        _move_in_place(train_traced, device, channels_last)
        self.module = train_traced  # this stage's parameters, named as in the plain model
        mine = _units_of(units, self.split_points, self.stage_index)
        self.checkpointed = []
        if activation_checkpointing:  # the traced stage keeps the model's module names: wrap its blocks by name
            if not any(is_block(model.get_submodule(name)) for name, _ in units):
                raise no_blocks_error(model)
            self.checkpointed = [name for name, _ in mine if is_block(model.get_submodule(name))]
            checkpoint_submodules(train_traced, self.checkpointed)
        self.stage_flops = sum(flops for _, flops in mine)
        self.stage_share = self.stage_flops / max(1, sum(flops for _, flops in units))

        train_module = _Stage(train_traced, channels_last)
        eval_module = _Stage(eval_traced, channels_last)
        if compile_options is not None:  # (gpuaccel.compiling.compile_arguments)
            train_module.compile(dynamic=False, **compile_options)
            eval_module.compile(dynamic=False, **compile_options)
        self.replica_group = mesh["replica"].get_group() if self.replicas > 1 else None
        # the stages' shapes and dtypes (under autocast) are inferred on the first step
        kind = Schedule1F1B if schedule == "1f1b" else ScheduleGPipe
        self._train = kind(PipelineStage(train_module, self.stage_index, stages, device, group=stage_group),
                           microbatches, loss_fn=loss_fn)
        self._eval = ScheduleGPipe(PipelineStage(eval_module, self.stage_index, stages, device, group=stage_group),
                                   microbatches)
        self.device = device
        self.stage_group = stage_group
        self.tied, self.tied_group = self._tie_across_stages(model, mesh)

    def describe(self) -> str:
        return (f"pipeline of {self.stages} stages split before {', '.join(self.split_points)}, "
                f"{self.microbatches} micro-batches, {self.replicas} replica(s); this process: stage "
                f"{self.stage_index} ({100 * self.stage_share:.0f}% of the FLOPs, "
                f"{self.stage_flops / 1e9:,.2f} GFLOP per micro-batch forward"
                + (f", {len(self.checkpointed)} block{'s' * (len(self.checkpointed) > 1)} checkpointed)"
                   if self.checkpointed else ")"))

    def train_step(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Forward and backward over one batch; gradients land in this stage's parameters.
        Returns the mean loss on the last stage, 0 elsewhere (detached, on the device)."""
        losses: list[torch.Tensor] = []
        if self.is_first:  # (torch 2.11 checks each micro-batch's strides against a contiguous one's)
            self._train.step(images.contiguous())
        elif self.is_last:
            self._train.step(target=labels, losses=losses)
        else:
            self._train.step()
        if self.tied_group is not None:  # a weight shared by several stages
            self._sum_tied_gradients()
        if self.replica_group is not None:
            self._average_gradients()
        if not self.is_last:
            return torch.zeros((), device=self.device)
        return torch.stack([x.detach().float() for x in losses]).mean()

    def _tie_across_stages(self, model: nn.Module, mesh) -> tuple[list, object]:
        """A parameter the plain model uses under several names (GPT's token embedding and output
        layer) is used by several stages, each process updating its own. The copies start equal
        and stay equal if each takes the sum of all the stages' gradients. Returns, per such
        parameter, it and whether this stage holds it, and the group of this pipeline's stages
        that hold one (None where fewer than two do)."""
        mine = dict(self.module.named_parameters(remove_duplicate=False))
        tied = [(model.get_parameter(names[0]), any(n in mine for n in names)) for names in _tied_names(model)]
        holders = [None] * self.stages
        dist.all_gather_object(holders, any(held for _, held in tied), group=mesh["stage"].get_group())
        stages = [s for s, holds in enumerate(holders) if holds]
        if len(stages) < 2:
            return [], None
        group = None
        for replica in range(self.replicas):  # every process creates every group, in one order
            made = dist.new_group([replica * self.stages + s for s in stages])
            if replica == self.replica_index and self.stage_index in stages:
                group = made
        return tied, group

    def _sum_tied_gradients(self) -> None:
        for p, held in self.tied:  # one all-reduce per shared parameter, on every holding stage
            grad = p.grad if held and p.grad is not None else torch.zeros(p.shape, device=self.device)
            dist.all_reduce(grad, group=self.tied_group)
            if held:
                p.grad = grad

    def _average_gradients(self) -> None:
        """Averages this stage's gradients over the replicas in one all-reduce. (Not
        DistributedDataParallel: its reducer expects each forward pass to be followed by its
        backward pass, and a pipeline stage runs several micro-batches' forwards first.)"""
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self.replica_group)  # gloo has no AVG: sum, then divide
        flat /= self.replicas
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view(g.shape))
            offset += g.numel()

    def clip_gradients(self, max_norm: float) -> torch.Tensor:
        """Scales this stage's gradients so that the norm of the whole model's gradient (all
        stages: one all-reduce of squared norms) is at most ``max_norm``, as
        ``torch.nn.utils.clip_grad_norm_`` does for a whole model. Returns that norm."""
        parameters = list(self.module.parameters())
        squares = nn.utils.get_total_norm([p.grad for p in parameters if p.grad is not None]) ** 2
        dist.all_reduce(squares, group=self.stage_group)
        norm = squares.sqrt()
        nn.utils.clip_grads_with_norm_(parameters, max_norm, norm)
        return norm

    def logits(self, images: torch.Tensor) -> torch.Tensor:
        """The model's output for ``images`` on the last stage; elsewhere a (batch, 1) zero
        placeholder. Every stage of the pipeline must call this with its copy of the batch."""
        count = images.shape[0]
        if count < self.eval_batch_size:  # one shape for every micro-batch: pad, then drop the padding
            images = torch.cat([images, images.new_zeros(self.eval_batch_size - count, *images.shape[1:])])
        elif count > self.eval_batch_size:
            raise GpuaccelError(f"evaluation batch of {count} images is larger than {self.eval_batch_size}")
        out = self._eval.step(images.contiguous()) if self.is_first else self._eval.step()
        return out[:count] if self.is_last else images.new_zeros(count, 1)

    def gather_to_first(self, obj):
        """``obj`` of every stage of replica 0, as a list by stage, on global rank 0 (None
        elsewhere). A collective over all processes."""
        world = dist.get_world_size()
        out = [None] * world if dist.get_rank() == 0 else None
        dist.gather_object((self.replica_index, self.stage_index, obj), out, dst=0)
        if out is None:
            return None
        by_stage = [None] * self.stages
        for replica, stage, value in out:
            if replica == 0:
                by_stage[stage] = value
        return by_stage


def tracing_precision(model: nn.Module, autocast_dtype: torch.dtype | None):
    """The run's autocast dtype on the device the weights are on while the model is traced (the
    CPU, where the run's autocast is the GPU's, which CPU tensors ignore). Traced in fp32, a cast
    that is a no-op there (the rotary embedding's ``x.float()``) becomes export's check that x is
    fp32, which the run's bf16 activations fail."""
    if autocast_dtype is None:
        return contextlib.nullcontext()
    weights = next(model.parameters(), None)
    return torch.autocast(weights.device.type if weights is not None else "cpu", dtype=autocast_dtype)


def _drop_traced_metadata_checks(module: nn.Module) -> None:
    """``torch.export`` records each cast (the rotary embedding's ``x.float()``) with a check
    that x has the dtype and the device it had while traced. The trace ran on the CPU, where the
    weights were; the stage runs on its GPU, where every such check fails ("Tensor device
    mismatch! Expected: cpu"). The checks are assertions only: the casts stay."""
    check = torch.ops.aten._assert_tensor_metadata.default
    for m in module.modules():
        graph = getattr(m, "graph", None)
        if not isinstance(graph, torch.fx.Graph):
            continue
        found = [n for n in graph.nodes if n.op == "call_function" and n.target is check]
        for node in found:
            graph.erase_node(node)
        if found and isinstance(m, torch.fx.GraphModule):
            m.recompile()
        elif found and hasattr(m, "finalize"):  # torch.export.unflatten's InterpreterModule
            m.finalize()


def _check_chain(pipe, points: list[str]) -> None:
    """Each stage must take exactly what the stage before it returns (one activation, or the
    same tuple): a tensor that skips a stage, or a model input used past the first stage,
    cannot be sent."""
    calls = [node for node in pipe.split_gm.graph.nodes if node.op == "call_module"]
    inputs = [node for node in pipe.split_gm.graph.nodes if node.op == "placeholder"]
    for i, node in enumerate(calls):
        expected = tuple(inputs) if i == 0 else (calls[i - 1],)
        if tuple(node.args) != expected or node.kwargs:
            raise GpuaccelError(f"splitting before {points[i - 1] if i else points[0]} passes more than one "
                                f"activation between stages (a skip connection crosses it); split at block "
                                f"boundaries instead")


def _tied_names(model: nn.Module) -> list[list[str]]:
    """The names of each parameter the model holds under more than one name."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return [aliases for aliases in names.values() if len(aliases) > 1]


def _share_tied_parameters(model: nn.Module, traced: list[nn.Module]) -> None:
    """Tracing gives a parameter the model uses under several names (a tied embedding and output
    layer) a copy per stage module, where the optimizer (built on the model) would never see
    it: each traced module gets the model's own parameter back under every such name."""
    shared = {name: model.get_parameter(names[0]) for names in _tied_names(model) for name in names}
    for module in traced:
        for name, _ in list(module.named_parameters(remove_duplicate=False)):
            if name in shared:
                owner, _, leaf = name.rpartition(".")
                setattr(module.get_submodule(owner), leaf, shared[name])


def _remove_split_markers(model: nn.Module, spec: dict) -> None:
    """``pipeline()`` marks each split module by replacing its ``forward`` on the instance; a
    second trace would wrap the wrapper (endless recursion), so the marks are removed."""
    for name in spec:
        module = model.get_submodule(name)
        for attr in ("forward", "_orig_forward"):
            module.__dict__.pop(attr, None)


def _move_in_place(module: nn.Module, device: torch.device, channels_last: bool) -> None:
    """Moves parameters and buffers by swapping their data, so that every module holding the
    same tensor objects (the evaluation trace, the plain model) sees them moved.
    ``Module.to`` would replace buffers with new objects."""
    for t in [*module.parameters(), *module.buffers()]:
        layout = torch.channels_last if channels_last and t.ndim == 4 else torch.preserve_format
        t.data = t.data.to(device, memory_format=layout)


def _units_of(units: list[tuple], points: list[str], stage: int) -> list[tuple]:
    """The units in ``stage`` (for reporting its cost)."""
    names = [u[0] for u in units]
    bounds = [0] + [names.index(p) if p in names else 0 for p in points] + [len(names)]
    return units[bounds[stage]:bounds[stage + 1]]


class PipelineParallel(Strategy):
    """This process keeps one stage of the model; micro-batches flow through the stages on
    consecutive processes (``stages`` per pipeline; several pipelines train data parallel)."""

    name = "pipeline parallel"
    collective_state = True
    needs_warm_up = True  # the first steps infer the shapes that pass between stages
    local_forward = False  # (a collective across the processes)
    places_parameters = True  # each process moves its stage's parameters only

    def __init__(self, device: torch.device, rank: int, world_size: int, *, stages: int, microbatches: int,
                 schedule: str, split_points: list[str] | None, batch_size: int, eval_batch_size: int,
                 channels_last: bool, compile_options: dict | None, activation_checkpointing: bool, autocast,
                 autocast_dtype: torch.dtype | None):
        super().__init__(device, rank, world_size)
        self.stages, self.autocast = stages, autocast
        self.options = dict(stages=stages, microbatches=microbatches, schedule=schedule, split_points=split_points,
                            device=device, batch_size=batch_size, eval_batch_size=eval_batch_size,
                            channels_last=channels_last, compile_options=compile_options,
                            activation_checkpointing=activation_checkpointing, autocast_dtype=autocast_dtype)
        self.pipeline: Pipeline | None = None

    @property
    def data_rank(self) -> int:
        return self.rank // self.stages  # a pipeline's stages share a batch

    @property
    def data_ranks(self) -> int:
        return max(1, self.world_size // self.stages)

    def wrap(self, model, *, first_inputs=None, loss_fn=F.cross_entropy):
        refuse_backward_updates(model, "--pipeline-stages")
        # a traced stage keeps the model's non-persistent buffers (e.g. rotary tables) as state:
        # checkpoints hold what the plain model's state_dict holds, no more
        self.saved_keys = set(model.state_dict())
        example = first_inputs()
        self.pipeline = Pipeline(model, input_shape=tuple(example.shape[1:]), input_dtype=example.dtype,
                                 loss_fn=loss_fn, **self.options)
        self.model = self.pipeline.module  # this stage's parameters, named as in the plain model
        self.counts_metrics = self.pipeline.is_last  # where the outputs and losses are
        return self.model

    def training_forward(self, compile):
        return None  # the schedule runs the stage

    def eval_forward(self, compile, training_forward, average):
        return self.pipeline.logits

    def forward_backward(self, step, inputs, targets, sync):
        with self.autocast():  # (accumulation is not allowed: micro-batches are the pipeline's own)
            return self.pipeline.train_step(inputs, targets)

    def clip_gradients(self, max_norm):
        self.pipeline.clip_gradients(max_norm)  # the norm of the whole model's gradient, over all stages

    def gather_state(self, optimizer, to_host=None):
        """The whole model's state (and each stage's optimizer state, as a list by stage) on rank
        0; empty elsewhere. A collective (into new host memory: ``to_host`` is not used)."""
        from torch.utils._pytree import tree_map_only

        mine = tree_map_only(torch.Tensor, new_host_copy,
                             (self.model.state_dict(), optimizer.state_dict() if optimizer is not None else None))
        parts = self.pipeline.gather_to_first(mine)
        if parts is None:
            return {}, None
        model_state = {key: value for stage_state, _ in parts for key, value in stage_state.items()
                       if key in self.saved_keys}
        return model_state, [stage_optimizer for _, stage_optimizer in parts] if optimizer is not None else None

    def load_state(self, optimizer, model_state, optimizer_state):
        part = {key: model_state[key] for key in self.model.state_dict() if key in self.saved_keys}  # this stage's
        self.model.load_state_dict(part, strict=False)  # (what it leaves out: non-persistent buffers)
        optimizer.load_state_dict(optimizer_state[self.pipeline.stage_index])

    def describe(self) -> str:
        return self.pipeline.describe()
