"""The loss head a step asks for: the head's matmul and the cross-entropy, as `train.loss_impl` computes them.

- plain: the model applies its head and the loss reads the whole (tokens, vocab) logits (`cross_entropy_loss`;
  under tensor parallelism sharded over the vocabulary, under `loss_parallel`).
- chunked: the model stops at its final norm (`forward(hidden=True)`) and `chunked_cross_entropy` multiplies by
  the weight of the family's head (`ModelSpec.head`) a slice of the tokens at a time, computing each slice's
  gradients in forward with its loss (plain's three head matmuls; backward only scales them). Under tensor
  parallelism each rank multiplies by its vocabulary rows of the weight and the log-sum-exp is reduced over the
  group, as `loss_parallel` does: no rank holds the whole vocabulary's logits.
- fused: Liger Kernel's fused linear cross-entropy (Triton kernels: CUDA only, and one tensor-parallel rank).

The target mask and the normalisation over the global batch's trained tokens are the loss's, whichever computes
it; a pipeline computes it on its last stage (`paralm.parallel.pipeline`).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from paralm.config.dtypes import torch_dtype
from paralm.config.schema import TrainConfig
from paralm.errors import UserError
from paralm.models.loss import VocabShard, chunked_cross_entropy, cross_entropy_loss, normalised


class LossHead(Protocol):
    hidden: bool  # the model returns its final norm's output for this head (`forward(hidden=True)`), else logits

    def __call__(self, output: torch.Tensor, targets: torch.Tensor, tokens: float | None = None) -> torch.Tensor: ...


@dataclass(frozen=True)
class PlainHead:
    """The loss of the model's whole logits."""

    hidden: bool = False

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor, tokens: float | None = None) -> torch.Tensor:
        return cross_entropy_loss(logits, targets, tokens)


@dataclass(frozen=True)
class ChunkedHead:
    """The loss of the final norm's output times `head`'s weight, computed a slice of the tokens at a time."""

    head: nn.Module  # its weight is read at each call: FSDP swaps its gathered weight in for forward
    chunks: int
    dtype: torch.dtype  # of the matmul: the compute dtype
    hidden: bool = True

    def __call__(self, hidden: torch.Tensor, targets: torch.Tensor, tokens: float | None = None) -> torch.Tensor:
        weight, shard = self.head.weight, VocabShard()
        if isinstance(weight, DTensor):
            hidden, weight, shard = _vocabulary_parallel(hidden, weight)
        return chunked_cross_entropy(hidden, weight, targets, self.chunks, self.dtype, tokens, shard)


@dataclass(frozen=True)
class FusedHead:
    """The loss of the final norm's output times `head`'s weight, by Liger Kernel's fused linear cross-entropy."""

    head: nn.Module
    dtype: torch.dtype
    hidden: bool = True

    def __call__(self, hidden: torch.Tensor, targets: torch.Tensor, tokens: float | None = None) -> torch.Tensor:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss  # installed where `loss_impl` allows

        summed = LigerFusedLinearCrossEntropyLoss(reduction="sum")(
            self.head.weight.to(self.dtype), hidden.flatten(0, -2).to(self.dtype), targets.flatten()
        )
        return normalised(summed, targets, tokens)


def build_loss_head(train: TrainConfig, dtype: str, device: torch.device, tp: int, head: nn.Module) -> LossHead:
    """The loss head `train.loss_impl` names for a module whose head is `head`, computing in `dtype`."""
    impl = loss_impl(train.loss_impl, device.type, tp)
    if impl == "chunked":
        return ChunkedHead(head, train.loss_chunks, torch_dtype(dtype))
    if impl == "fused":
        return FusedHead(head, torch_dtype(dtype))
    return PlainHead()


def loss_impl(name: str, device_type: str, tp: int, liger_installed: bool | None = None) -> str:
    """`train.loss_impl` with auto resolved (fused where it runs, else chunked); a one-line `UserError` where
    fused is asked for and cannot run. `liger_installed`: whether Liger Kernel is there (None: look here; the
    planner assumes it on the GPUs it plans for)."""
    problem = _fused_problem(device_type, tp, liger_installed)
    if name == "auto":
        return "chunked" if problem else "fused"
    if name == "fused" and problem:
        raise UserError(f"train.loss_impl = fused {problem}: use train.loss_impl = chunked (the same memory saving)")
    return name


def _fused_problem(device_type: str, tp: int, liger_installed: bool | None) -> str | None:
    if device_type != "cuda":
        return f"runs Liger Kernel's Triton kernels, which need a CUDA GPU (the device is {device_type})"
    if liger_installed is None:
        liger_installed = importlib.util.find_spec("liger_kernel") is not None
    if not liger_installed:
        return "needs Liger Kernel, which is not installed (pip install liger-kernel)"
    if tp > 1:
        return "computes the whole vocabulary on one rank, and parallel.tp > 1 shards it"
    return None


def _vocabulary_parallel(hidden: torch.Tensor, weight: DTensor) -> tuple[torch.Tensor, torch.Tensor, VocabShard]:
    """This rank's hidden states (every position, gathered under sequence parallelism) and vocabulary rows of the
    head as plain tensors, and where its rows lie. The hidden states' gradient is this rank's partial sum: DTensor
    all-reduces it (reduce-scatters it, to a sequence shard) on its way back, as `ColwiseParallel` does."""
    if weight.placements != (Shard(0),):
        raise ValueError(f"a vocabulary-parallel head's weight is Shard(0) over the TP mesh, not {weight.placements}")
    mesh = weight.device_mesh
    if isinstance(hidden, DTensor):
        hidden = hidden.redistribute(placements=[Replicate()])
    else:
        hidden = DTensor.from_local(hidden, mesh, [Replicate()], run_check=False)
    rows = weight.to_local()
    shard = VocabShard(mesh.get_group(), mesh.get_local_rank() * rows.shape[0])
    return hidden.to_local(grad_placements=[Partial()]), rows, shard
