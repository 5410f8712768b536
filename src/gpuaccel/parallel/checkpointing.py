"""Activation checkpointing applied to a plain model: each block's activations are dropped
after its forward pass and recomputed in the backward pass.

Memory for activations then grows with the number of blocks' *inputs* rather than with every
intermediate tensor, for about one more forward pass of compute (typically 20-35% slower
steps). The unit is a residual block (ResNet's BasicBlock/Bottleneck, MobileNet's inverted
residual, the fast CIFAR nets' conv stages, timm's blocks), found by type or by name, so a
user's or timm's model is covered when its blocks are named like that. PyTorch's own
``checkpoint_wrapper`` does the work (non-reentrant checkpointing, which composes with
torch.compile); its state-dict hooks keep parameter names unchanged, so checkpoints of
checkpointed and plain models are interchangeable.

Batch norm inside a checkpointed block runs twice in training mode, so its running
statistics take two momentum steps per batch (gradients are unaffected).
"""

from __future__ import annotations

from functools import partial

import torch.nn as nn

from ..errors import GpuaccelError

BLOCK_NAME_ENDINGS = ("Block", "Bottleneck", "InvertedResidual", "ConvStage", "Stage")


def is_block(module: nn.Module) -> bool:
    return type(module).__name__.endswith(BLOCK_NAME_ENDINGS) and any(True for _ in module.parameters())


def apply_activation_checkpointing(model: nn.Module) -> int:
    """Wraps every outermost block of ``model`` in place; returns how many were wrapped."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointWrapper, apply_activation_checkpointing as wrap_blocks)

    outermost = {id(m) for m in _outermost_blocks(model)}
    if not outermost:
        raise no_blocks_error(model)
    wrap_blocks(model, checkpoint_wrapper_fn=_wrapper(), check_fn=lambda m: id(m) in outermost)
    return sum(isinstance(m, CheckpointWrapper) for m in model.modules())


def checkpoint_submodules(root: nn.Module, names: list[str]) -> None:
    """Wraps the submodules of ``root`` at these dotted names in place (for models whose
    blocks are known by name only, such as the traced stages of a pipeline)."""
    wrap = _wrapper()
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = root.get_submodule(parent_name) if parent_name else root
        setattr(parent, child, wrap(parent.get_submodule(child)))


def no_blocks_error(model: nn.Module) -> GpuaccelError:
    return GpuaccelError(f"--activation-checkpointing found no blocks in {type(model).__name__} (modules "
                         f"whose class name ends with {', '.join(BLOCK_NAME_ENDINGS)})")


def _wrapper():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

    return partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT)


def _outermost_blocks(module: nn.Module):
    for child in module.children():
        if is_block(child):
            yield child  # a block inside a block would be recomputed twice: wrap the outer one only
        else:
            yield from _outermost_blocks(child)
