"""Gradient clipping by one norm over the whole model, however its parameters are split over ranks."""

from __future__ import annotations

from collections.abc import Collection

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from paralm.parallel.runtime import Runtime


def clip_grad_norm_(model: nn.Module, max_norm: float, runtime: Runtime, copies: Collection[str] = ()) -> torch.Tensor:
    """Scale all gradients so their global L2 norm is at most `max_norm`; returns the norm before.

    - DTensor gradients (tensor-parallel or FSDP-sharded) are reduced over their mesh, so each
      element counts once.
    - Plain gradients are already equal on the ranks that share them (DDP all-reduced them; tensor
      parallelism replicates the norms' and the position embedding's), so this rank's sum is theirs.
    - Pipeline stages hold different parameters: their squared norms add up over the pp group, and
      a tied weight's copy (`copies`: the names of `ModelSpec.tied`) is counted once, as its source.
    The result is the same on every rank, hence the same clipping everywhere.
    """
    pipelined = runtime.dims.pp_enabled
    groups: dict[object, list[tuple[str, nn.Parameter]]] = {}  # by DTensor mesh: torch's norm does not mix them
    for name, param in model.named_parameters():
        if param.grad is not None:
            mesh = param.grad.device_mesh if isinstance(param.grad, DTensor) else None
            groups.setdefault(mesh, []).append((name, param))
    squares = torch.zeros((), dtype=torch.float32, device=runtime.device)
    for mesh, members in groups.items():
        counted = [p.grad for name, p in members if not (pipelined and name in copies)]
        if counted:
            norm = torch.nn.utils.get_total_norm(counted)
            squares += (norm.full_tensor() if mesh is not None else norm).float() ** 2
    if pipelined:
        dist.all_reduce(squares, group=runtime.mesh["pp"].get_group())
    norm = squares.sqrt()
    for members in groups.values():
        torch.nn.utils.clip_grads_with_norm_([p for _, p in members], max_norm, norm)
    return norm
