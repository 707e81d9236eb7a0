"""Tensor and sequence parallelism (Megatron-LM; Korthikanti et al. 2022) through DTensor's `parallelize_module`.

Per block: q, k and v column-wise (each rank holds n_head / tp whole heads; attention reads its head
count from q's width), the output projection row-wise; the MLP's up projection column-wise, its down
projection row-wise. So a layer's forward costs two all-reduces of the activations, and its backward
two more (in the column-wise inputs).

Vocabulary: the embedding is row-wise over the vocabulary (each rank looks up the ids it holds, the
others contribute zeros, one all-reduce), the LM head column-wise over the vocabulary with its output
left sharded, and the loss runs on the sharded logits under `loss_parallel` (a max, a sum of
exponentials and the target logit are reduced; the full-vocabulary logits never exist). Both shard the
same `(vocab, d_model)` weight along dim 0, so the tied weight stays one parameter.

Sequence parallel: LayerNorms, dropout and the residual stream are sharded along the sequence; each
all-reduce becomes a reduce-scatter (after the row-wise projections) plus an all-gather (before the
column-wise ones), the same bytes with activations 1/tp the size in between. The learned position
embedding stays replicated (it is tiny) and each rank adds the slice of positions its sequence shard
holds, as Megatron does. The LayerNorms' replicated weights then see only their rank's part of the
sequence, so their gradients are partial sums: `reduce_partial_gradients` sums them once per step.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)
from torch.distributed.tensor.parallel.style import ParallelStyle

from paralm.model import GPT


def tensor_parallel_plan(model: GPT, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """The DTensor plan for the parts of `model` present (a pipeline stage may lack the embedding or head)."""
    residual = Shard(1) if sequence_parallel else Replicate()  # layout of the residual stream between blocks
    plan: dict[str, ParallelStyle] = {}
    if model.wte is not None:
        plan["wte"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=residual)
        if sequence_parallel:
            plan["wpe"] = PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(0))
    for key in model.blocks:
        plan |= block_plan(sequence_parallel, prefix=f"blocks.{key}.")
    if model.lm_head is not None:
        if sequence_parallel:
            plan["ln_f"] = SequenceParallel()
        plan["lm_head"] = ColwiseParallel(input_layouts=residual, output_layouts=Shard(-1), use_local_output=False)
    return plan


def block_plan(sequence_parallel: bool, prefix: str = "") -> dict[str, ParallelStyle]:
    """The DTensor plan of one `Block` whose submodules are named `prefix` + their names in the block."""
    residual = Shard(1) if sequence_parallel else Replicate()
    plan: dict[str, ParallelStyle] = {}
    for part, projections, output in (("attn", ("wq", "wk", "wv"), "wo"), ("mlp", ("fc",), "proj")):
        if sequence_parallel:
            plan[f"{prefix}ln_{1 if part == 'attn' else 2}"] = SequenceParallel()
        # one DTensor input shared by q, k and v: their input gradients add up locally and are
        # all-reduced (or reduce-scattered) once, not once per projection
        plan[f"{prefix}{part}"] = PrepareModuleInput(input_layouts=(residual,), desired_input_layouts=(Replicate(),))
        for name in projections:
            plan[f"{prefix}{part}.{name}"] = ColwiseParallel()
        plan[f"{prefix}{part}.{output}"] = RowwiseParallel(output_layouts=residual)
    return plan


def apply_tensor_parallel(model: GPT, tp_mesh: DeviceMesh, sequence_parallel: bool) -> GPT:
    """Shard `model` in place over `tp_mesh`; the tied embedding and head keep sharing one parameter."""
    tied = model.wte is not None and model.lm_head is not None and model.lm_head.weight is model.wte.weight
    parallelize_module(model, tp_mesh, tensor_parallel_plan(model, sequence_parallel))
    if tied:  # each style registered its own DTensor copy; both are Shard(0) over the vocabulary
        model.lm_head.weight = model.wte.weight
    return model


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
