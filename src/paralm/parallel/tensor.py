"""Tensor and sequence parallelism (Megatron-LM; Korthikanti et al. 2022) through DTensor's `parallelize_module`.

What is sharded how is the model family's plan (`ModelSpec.tensor_parallel_plan`); here is what every
family shares. The loss runs on vocabulary-sharded logits under `loss_parallel` (a max, a sum of
exponentials and the target logit are reduced; the full-vocabulary logits never exist). Under
sequence parallelism the norms' replicated weights see only their rank's part of the sequence, so
their gradients are partial sums: `reduce_partial_gradients` sums them once per step.

Dropout runs on local tensors (not DTensors, so DTensor's RNG tracker is not involved): where ranks
hold different shards (the family's `sharded_regions`) each draws its own masks, elsewhere the TP
group's shared masks keep the replicas identical (Megatron's model-parallel RNG).
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

from paralm.convert.registry import shard_converted
from paralm.models.spec import ModelSpec, ShardedRegion, tied_parameters
from paralm.parallel.reducers import GradientReducer
from paralm.parallel.sequence_routing import SequenceRoutedGradients, sequence_routed_layers, split_sequence_routing


def apply_tensor_parallel(
    model: nn.Module, spec: ModelSpec, tp_mesh: DeviceMesh, sequence_parallel: bool, dropout: bool = False
) -> None:
    """Shard `model` in place over `tp_mesh` by its family's plan; tied weights stay one parameter
    (each style registers its own DTensor copy; the plan shards both the same way). With `dropout`,
    its sharded regions draw per-rank masks (`draw_per_rank`)."""
    tied = tied_parameters(model, spec)  # a pipeline stage may hold one end or its own copy
    parallelize_module(model, tp_mesh, spec.tensor_parallel_plan(model, sequence_parallel))
    shard_converted(model)  # the parameters a converter added: placed to match the layers it converted
    for name, source in tied.items():
        module, attribute = name.rsplit(".", 1)
        setattr(model.get_submodule(module), attribute, model.get_parameter(source))
    split_sequence_routing(model, sequence_parallel, tp_mesh.get_group())
    if dropout:
        draw_per_rank(model, spec.sharded_regions(model, sequence_parallel), tp_mesh)


def draw_per_rank(model: nn.Module, regions: list[ShardedRegion], tp_mesh: DeviceMesh) -> None:
    """Run each region's forward on a generator forked for this TP rank, through hooks (the model stays plain).

    The fork's seed is drawn from the shared stream on entry, and the shared state is restored on exit:
    no state of its own, so per-step reseeding (`before_step`) fixes it for resumption, and
    activation checkpointing, which replays a block from the RNG state at its entry, redraws its masks."""
    rank = tp_mesh.get_local_rank()
    device = torch.device(tp_mesh.device_type)
    devices = [] if device.type == "cpu" else [torch.get_device_module(device.type).current_device()]
    forks: list[contextlib.AbstractContextManager] = []

    def enter(*_: Any) -> None:
        seed = int(torch.randint(2**62, ()).item())  # the same on every TP rank: their shared stream
        fork = torch.random.fork_rng(devices, device_type=device.type)
        fork.__enter__()
        forks.append(fork)
        torch.manual_seed(hash((seed, rank)) & 0x7FFF_FFFF_FFFF_FFFF)  # tuple hashes of ints are stable

    def leave(*_: Any) -> None:
        forks.pop().__exit__(None, None, None)

    for region in regions:
        start = model.get_submodule(region.start)
        start.register_forward_pre_hook(enter)
        if region.until is None:
            start.register_forward_hook(leave)
        else:
            model.get_submodule(region.until).register_forward_pre_hook(leave)


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


class PartialGradients:
    """The pending partial sums of `model`'s gradients, summed once per step (`reduce_partial_gradients`)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def reduce_gradients(self) -> None:
        reduce_partial_gradients(self.model)


def tensor_parallel_reducers(model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool) -> list[GradientReducer]:
    """What tensor parallelism leaves to sum after backward on this rank's `model` (all its stages, after every
    wrapping: FSDP replaces the parameters it shards): the partial sums, then the gradients of the MoE layers
    that route this rank's positions only (`SequenceRoutedGradients`)."""
    layers = sequence_routed_layers(model, sequence_parallel)
    routed = [SequenceRoutedGradients(layers, tp_mesh.get_group())] if layers else []
    return [PartialGradients(model), *routed]


def loss_context(tp: int) -> contextlib.AbstractContextManager:
    """Where the loss and its backward run: `loss_parallel` on vocabulary-sharded logits when tp > 1."""
    return loss_parallel() if tp > 1 else contextlib.nullcontext()


def local_value(tensor: Any) -> Any:
    """This rank's part of a DTensor as a plain tensor (all of it when replicated, as a TP loss is), or
    the tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def dropout_rank(rank: int, tp: int) -> int:
    """The rank that seeds dropout: shared by the TP group (tp is the innermost mesh dim), so the ranks
    that hold the same replicated activations draw the same masks (sharded ones fork: `draw_per_rank`)."""
    return rank // tp
