"""Optimizers and learning-rate schedules: PyTorch's own, and Muon for convolution filters.

Muon (Jordan et al., 2024) replaces a weight matrix's momentum update by the nearest
semi-orthogonal matrix, computed with a few Newton-Schulz iterations. PyTorch's
``torch.optim.Muon`` takes only 2-D parameters; a convolution's filters are a matrix once
flattened (out channels x in channels * kernel area), which is what :class:`Muon` adds. On
the CIFAR-10 speed-run networks it reaches the same accuracy in fewer epochs than SGD.
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch
import torch.nn as nn
from torch.optim.sgd import sgd



# Quintic Newton-Schulz coefficients of Muon's reference implementation (also torch.optim.Muon's
# defaults): they push every singular value into roughly [0.7, 1.2] in five steps, which trains as
# well as exact orthogonalisation and costs a few small matrix products.
_NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


def orthogonalize(matrices: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """Approximately U V^T for each matrix U S V^T of a (B, M, N) batch, in bf16."""
    a, b, c = _NS_COEFFICIENTS
    x = matrices.bfloat16()
    tall = x.size(1) > x.size(2)
    if tall:  # iterate on the smaller Gram matrix
        x = x.transpose(1, 2)
    x = x / (torch.linalg.vector_norm(x, dim=(1, 2), keepdim=True) + 1e-7)  # singular values <= 1
    for _ in range(steps):
        gram = torch.bmm(x, x.transpose(1, 2))
        poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.baddbmm(x, poly, x, beta=a)
    return x.transpose(1, 2) if tall else x


# Newton-Schulz products up to about this many multiply-adds take about as long whatever their
# size on a GPU (their kernels' launch and ramp-up, not their arithmetic): below it every filter
# bank goes into one zero-padded batch, one chain of products instead of one per shape
_ONE_BATCH_WORK = 2 ** 30


def newton_schulz_batches(shapes: list[tuple[int, int]]) -> list[list[int]]:
    """Which matrices (of these rows x columns) Newton-Schulz iterates on together, each batch
    zero-padded to its largest rows and columns (zero rows and columns leave a matrix's
    orthogonalisation unchanged): all of them in one batch when its products are small (below
    :data:`_ONE_BATCH_WORK`), else one batch per row count."""
    rows, columns = max(r for r, _ in shapes), max(c for _, c in shapes)
    if len(shapes) * rows * columns * min(rows, columns) <= _ONE_BATCH_WORK:
        return [list(range(len(shapes)))]
    by_rows = defaultdict(list)
    for i, (r, _) in enumerate(shapes):
        by_rows[r].append(i)
    return list(by_rows.values())


def muon_update(params: list[torch.Tensor], grads: list[torch.Tensor], buffers: list[torch.Tensor], lr,
                momentum: float, nesterov: bool, ns_steps: int, batches: list[list[int]]) -> None:
    """Muon's update of ``params`` in place (see :class:`Muon`), in few kernels: on a GPU these
    small kernels' launches and ramp-up, not their arithmetic, set its time, so the filter banks
    of one shape are updated together, batch by batch."""
    if momentum:
        torch._foreach_mul_(buffers, momentum)
        torch._foreach_add_(buffers, grads)
        grads = torch._foreach_add(grads, buffers, alpha=momentum) if nesterov else buffers
    # each filter bank is rescaled to sqrt(rows) norm before its update: the factors, all at once
    factors = torch._foreach_norm(params)
    torch._foreach_clamp_min_(factors, 1e-12)
    torch._foreach_reciprocal_(factors)
    torch._foreach_mul_(factors, [len(p) ** 0.5 for p in params])
    for indices in batches:
        shapes = [(len(params[i]), params[i].numel() // len(params[i])) for i in indices]
        rows, width = max(r for r, _ in shapes), max(c for _, c in shapes)
        # zero-padded, in bf16: each update copied into its corner (its layout and dtype converted on the way)
        packed = grads[indices[0]].new_zeros((len(indices), rows, width), dtype=torch.bfloat16)
        corners = [packed[k, :r, :c].view(params[i].shape) for k, (i, (r, c)) in enumerate(zip(indices, shapes))]
        for i, corner in zip(indices, corners):
            corner.copy_(grads[i])
        orthogonal = orthogonalize(packed, ns_steps)
        for k, (i, (r, c)) in enumerate(zip(indices, shapes)):
            p, update = params[i], orthogonal[k, :r, :c].view(params[i].shape)
            scale = max(1.0, r / c) ** 0.5  # orthogonal rows of a wide matrix have unit norm; a tall one's match
            p.mul_(factors[i])
            if torch.is_tensor(lr):  # one kernel: no product of the tensor rate per filter bank
                p.addcmul_(update, lr, value=-scale)
            else:
                p.add_(update, alpha=-lr * scale)


class Muon(torch.optim.Optimizer):
    """Muon for the parameter groups marked ``orthogonalize``, SGD for the others (biases,
    norms, the classifier), as one optimizer so that schedules, checkpoints and the step
    graph treat it like any other.

    Orthogonalised groups: Nesterov momentum, then each filter bank's update replaced by its
    orthogonalised matrix. Their weights are rescaled to unit norm per filter on average before
    each update instead of decayed: the layers that follow normalise, so the norm only sets the
    effective step size, and fixing it keeps the learning rate meaning the same all through
    training. Other groups: SGD with coupled weight decay and (Nesterov) momentum, through
    PyTorch's functional ``sgd``.

    Learning rates may be 0-d tensors (the step graph's), so every update is a tensor product.
    """

    def __init__(self, params, lr: float = 0.02, momentum: float = 0.9, nesterov: bool = True,
                 weight_decay: float = 0.0, orthogonalize: bool = False, ns_steps: int = 5):
        defaults = dict(lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay,
                        orthogonalize=orthogonalize, ns_steps=ns_steps)
        super().__init__(params, defaults)

    def _buffers(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        """Momentum buffers, created as zeros: the same first step as PyTorch's SGD, which
        copies the gradient (and the step graph creates them so before its capture)."""
        for p in params:
            if self.state[p].get("momentum_buffer") is None:
                self.state[p]["momentum_buffer"] = torch.zeros_like(p)
        return [self.state[p]["momentum_buffer"] for p in params]

    def init_state(self) -> None:
        """Creates every momentum buffer now (what a captured step needs before its recording:
        created inside it, they would be zeroed by every replay)."""
        for group in self.param_groups:
            if group["momentum"]:
                self._buffers(group["params"])

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if params and group["orthogonalize"]:
                muon_update(
                    params, [p.grad for p in params], self._buffers(params) if group["momentum"] else [],
                    group["lr"], group["momentum"], group["nesterov"], group["ns_steps"],
                    newton_schulz_batches([(len(p), p.numel() // len(p)) for p in params]))
            elif params:  # PyTorch's SGD, one fused kernel on a GPU
                momentum = group["momentum"]
                sgd(params, [p.grad for p in params],
                    self._buffers(params) if momentum else [None] * len(params),
                    weight_decay=group["weight_decay"], momentum=momentum, lr=group["lr"], dampening=0.0,
                    nesterov=group["nesterov"] and momentum > 0, maximize=False, fused=params[0].is_cuda)
        return loss


def build_optimizer(model: nn.Module, settings) -> torch.optim.Optimizer:
    """The optimizer ``settings`` (the config's ``OptimizerSettings``, whose ``build`` calls this)
    describe; how it runs on the device (fused or capturable kernels, sharded parameters) is
    ``Accelerator.prepare_optimizer``'s to decide, for both doors. Weight decay applies to weights
    only: decaying batch-norm scales and biases hurts accuracy. Those also take ``bias_lr_scale``
    times the learning rate. With ``muon``, convolution filters take Muon's orthogonalised
    updates at ``muon_lr`` and the rest SGD. Parameters a model updates itself in its backward
    pass (``updated_in_backward``, e.g. models/dlrm.py's embedding tables) are left out. A
    parameter with an ``lr_scale`` attribute takes that multiple of its group's rate (e.g.
    models/recsys.py's autorec, whose matrix factorisation member needs a tenfold rate)."""
    filters, grouped = [], {(True, 1.0): [], (False, 1.0): []}  # weights, then biases and norms: always both
    for p in model.parameters():
        if p.requires_grad and not getattr(p, "updated_in_backward", False):
            if settings.name == "muon" and p.ndim > 2:
                filters.append(p)
            else:
                grouped.setdefault((p.ndim > 1, getattr(p, "lr_scale", 1.0)), []).append(p)
    groups = [{"params": params, "weight_decay": settings.weight_decay if decayed else 0.0,
               "lr": settings.lr * scale * (1.0 if decayed else settings.bias_lr_scale)}
              for (decayed, scale), params in grouped.items()]
    if settings.name == "muon":
        groups.append({"params": filters, "lr": settings.muon_lr, "momentum": settings.muon_momentum,
                       "orthogonalize": True, "ns_steps": settings.muon_ns_steps})
        return Muon(groups, lr=settings.lr, momentum=settings.momentum, nesterov=settings.nesterov)
    if settings.name == "adamw":
        return torch.optim.AdamW(groups, lr=settings.lr, betas=(settings.momentum, settings.beta2))
    return torch.optim.SGD(groups, lr=settings.lr, momentum=settings.momentum,
                           nesterov=settings.nesterov and settings.momentum > 0)


def build_scheduler(optimizer: torch.optim.Optimizer, settings, epochs: float,
                    steps_per_epoch: int):
    """A ``LambdaLR`` stepped once per optimizer step; ``warmup_epochs`` sets the rising part.

    onecycle: linear from lr/10 up to lr, then linear down to lr/1000. cosine: linear warm-up
    from 0, then cosine to 0. constant: linear warm-up, then lr. The factor is computed from
    the settings and ``epochs``, so a resumed run given more epochs stretches its schedule to the new
    length.
    """
    total = max(1, math.ceil(epochs * steps_per_epoch))
    warmup = min(max(total - 1, 0), int(round(settings.warmup_epochs * steps_per_epoch)))

    def factor(step: int) -> float:
        if settings.schedule == "onecycle":
            if step < warmup:
                return 0.1 + 0.9 * step / warmup
            return max(1e-3, 1.0 - (1.0 - 1e-3) * (step - warmup) / max(1, total - warmup))
        if step < warmup:
            return (step + 1) / warmup
        if settings.schedule == "constant":
            return 1.0
        progress = (step - warmup) / max(1, total - warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
