"""Tensor and sequence parallelism (Megatron-LM; Korthikanti et al. 2022) through DTensor's `parallelize_module`.

What is sharded how is the model family's plan (`ModelSpec.tensor_parallel_plan`); here is what every
family shares. The loss runs on vocabulary-sharded logits under `loss_parallel` (a max, a sum of
exponentials and the target logit are reduced; the full-vocabulary logits never exist). Under
sequence parallelism the norms' replicated weights see only their rank's part of the sequence, so
their gradients are partial sums: `reduce_partial_gradients` sums them once per step.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate
from torch.distributed.tensor.parallel import (
    loss_parallel,
    parallelize_module,
)

from paralm.models.spec import ModelSpec, tied_parameters


def apply_tensor_parallel(model: nn.Module, spec: ModelSpec, tp_mesh: DeviceMesh, sequence_parallel: bool) -> None:
    """Shard `model` in place over `tp_mesh` by its family's plan; tied weights stay one parameter
    (each style registers its own DTensor copy; the plan shards both the same way)."""
    tied = tied_parameters(model, spec)  # a pipeline stage may hold one end or its own copy
    parallelize_module(model, tp_mesh, spec.tensor_parallel_plan(model, sequence_parallel))
    for name, source in tied.items():
        module, attribute = name.rsplit(".", 1)
        setattr(model.get_submodule(module), attribute, model.get_parameter(source))


def reduce_partial_gradients(model: nn.Module) -> None:
    """Sum the gradients autograd left as pending partial sums, one all-reduce per mesh and layout.

    DTensor reduces a `Partial` gradient lazily, at every use: clipping's norm and each of AdamW's
    foreach ops, 4 blocking collectives per LayerNorm parameter per step under sequence parallelism,
    where Megatron-LM reduces them once. After this they are `Replicate`, as their parameters are."""
    pending: dict[tuple[DeviceMesh, tuple, torch.dtype], list[nn.Parameter]] = {}
    for param in model.parameters():
        grad = param.grad
        if isinstance(grad, DTensor) and any(p.is_partial() for p in grad.placements):
            pending.setdefault((grad.device_mesh, grad.placements, grad.dtype), []).append(param)
    for (mesh, placements, _), params in pending.items():
        replicated = tuple(Replicate() if p.is_partial() else p for p in placements)
        if any(p.is_partial() and p != Partial("sum") for p in placements):  # avg, max, ...: DTensor's own way
            for param in params:
                param.grad = param.grad.redistribute(placements=replicated)
            continue
        parts = [param.grad.to_local() for param in params]
        flat = torch.cat([part.reshape(-1) for part in parts])  # on the gradients' (the group's) device
        for dim, placement in enumerate(placements):
            if placement.is_partial():
                dist.all_reduce(flat, group=mesh.get_group(dim))
        for param, part, summed in zip(params, parts, flat.split([part.numel() for part in parts]), strict=True):
            param.grad = DTensor.from_local(summed.view_as(part), mesh, replicated, run_check=False)


def loss_context(tp: int) -> contextlib.AbstractContextManager:
    """Where the loss and its backward run: `loss_parallel` on vocabulary-sharded logits when tp > 1."""
    return loss_parallel() if tp > 1 else contextlib.nullcontext()


def local_value(tensor: Any) -> Any:
    """This rank's part of a DTensor as a plain tensor (all of it when replicated, as a TP loss is), or
    the tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def dropout_rank(rank: int, tp: int) -> int:
    """The rank that seeds dropout: shared by the TP group (tp is the innermost mesh dim), so the ranks
    that hold the same replicated activations draw the same masks."""
    return rank // tp
