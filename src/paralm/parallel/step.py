"""Running one step's forward and backward on a module that is not pipelined (a pipeline runs its
schedule instead: `paralm.parallel.pipeline.Pipeline` has the same two methods)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from paralm.models.loss import IGNORE_INDEX
from paralm.models.moe import pop_auxiliary_loss
from paralm.models.mtp import prediction_loss
from paralm.models.step import StepBatch
from paralm.parallel.context.layout import SequenceShard
from paralm.parallel.ddp import gradient_sync
from paralm.parallel.loss_head import LossHead, PlainHead
from paralm.parallel.precision import autocast
from paralm.parallel.tensor import local_value, loss_context


def document_kwargs(rest: tuple | list) -> dict[str, torch.Tensor]:
    """The model's `documents` keyword from what follows (x, y) in a micro-batch (nothing: none)."""
    return {"documents": rest[0]} if rest and rest[0] is not None else {}


class _AuxiliaryGradient(torch.autograd.Function):
    """Identity on `output`; in backward, `aux` gets the gradient `weight` (Megatron-LM's
    MoEAuxLossAutoScaler): the auxiliary loss trains where it was computed, without travelling. A copy,
    not a view: zero-bubble pipeline schedules detach a stage's output in place, which a view refuses."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux: torch.Tensor, weight: float) -> torch.Tensor:  # noqa: ANN001
        ctx.weight, ctx.aux_shape = weight, aux.shape
        return output.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:  # noqa: ANN001
        return grad, torch.full(ctx.aux_shape, ctx.weight, device=grad.device), None


def carry_auxiliary_loss(module: nn.Module, output: torch.Tensor, weight: float) -> torch.Tensor:
    """`output` of `module`, carrying the auxiliary loss its MoE layers kept in this forward, weighted by
    `weight`, into backward (where a pipeline stage's loss is not computed on its rank)."""
    aux = pop_auxiliary_loss(module)
    return output if aux is None else _AuxiliaryGradient.apply(output, aux, weight)


def _like(loss: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
    """`aux` as a DTensor laid out as a tensor-parallel `loss` (replicated experts compute it alike on every
    rank), so that backward does not meet a plain tensor and a DTensor in one op; else itself."""
    if isinstance(loss, DTensor):
        return DTensor.from_local(aux, loss.device_mesh, loss.placements, run_check=False)
    return aux


LossScale = Callable[[torch.Tensor], torch.Tensor]  # multiplies the loss before backward (fp16 loss scaling)
LossFn = Callable[..., torch.Tensor]  # (x, y, *rest, tokens=None) -> the loss: `PlainStep`'s forward and loss


class StepRunner(Protocol):
    def forward_backward(self, batch: StepBatch, scale: LossScale) -> torch.Tensor: ...

    def eval_loss(
        self, x: torch.Tensor, y: torch.Tensor, documents: torch.Tensor | None = None
    ) -> torch.Tensor | None: ...


@dataclass
class PlainStep:
    """Micro-batches through `module` one after the other, gradients synced only on the last."""

    module: nn.Module
    device: torch.device
    dtype: str  # the compute dtype (`precision.dtype`)
    tp: int = 1  # tensor-parallel degree: the loss is then computed on vocabulary-sharded logits
    shard: SequenceShard | None = None  # context parallelism: this rank's positions of every sequence
    sync_every_microstep: bool = False  # FSDP reduce-scatters every micro-step (`parallel.shard_grads_every_microstep`)
    head: LossHead = PlainHead()  # the head's matmul and cross-entropy (`train.loss_impl`)
    compiler: Callable[[LossFn], LossFn] | None = None  # `train.compile = "model"`: `parallel.compile.compiled_loss`

    def __post_init__(self) -> None:
        # training and evaluation both call `self.loss`: compiled, the whole forward and loss are one graph
        self.loss: LossFn = self._loss if self.compiler is None else self.compiler(self._loss)

    def _loss(self, x: torch.Tensor, y: torch.Tensor, *rest: torch.Tensor | None, tokens: float | None = None):
        """Loss of the batch (`self.head`'s), or of this rank's positions of it (with their global
        positions; document masks are refused with context parallelism)."""
        if self.shard is None:
            return self.head(self.module(x, hidden=self.head.hidden, **document_kwargs(rest)), y, tokens)
        x, y, positions = self.shard(x, y)
        return self.head(self.module(x, positions=positions, hidden=self.head.hidden), y, tokens)

    def forward_backward(self, batch: StepBatch, scale: LossScale) -> torch.Tensor:
        """Accumulate gradients over the micro-batches; returns this rank's share of the step's loss: its
        mean over them, or with a loss mask its trained targets' loss over `loss_tokens`."""
        loss_sum = torch.zeros((), device=self.device)
        tokens, batches = batch.loss_tokens, batch.micro_batches
        for i, (x, y, *rest) in enumerate(batches):
            last = i == len(batches) - 1
            with gradient_sync(self.module, last or self.sync_every_microstep), loss_context(self.tp):
                with autocast(self.device, self.dtype):
                    if tokens is None:
                        loss = self.loss(x, y, *rest) / len(batches)
                    else:
                        loss = self.loss(x, y, *rest, tokens=tokens)
                    aux = pop_auxiliary_loss(self.module)  # MoE balancing: trained, not reported as the loss
                    share = 1.0 if tokens is not None else 1 / len(batches)
                    ahead = prediction_loss(self.module, self.head, y, tokens, share)  # multi-token prediction's
                total = loss if aux is None else loss + _like(loss, aux) / len(batches)
                scale(total if ahead is None else total + ahead).backward()
            loss_sum += local_value(loss.detach())
        return loss_sum

    def eval_loss(self, x: torch.Tensor, y: torch.Tensor, documents: torch.Tensor | None = None) -> torch.Tensor:
        """Mean loss of one batch (over its trained targets, with a loss mask), on every rank. Under context
        parallelism each cp rank sums its positions' losses over the whole batch's trained targets and the
        shares are added up: a mean of the shards' means would weigh targets unequally (or be 0/0 on a
        shard that trains none)."""
        tokens = None if self.shard is None else float((y != IGNORE_INDEX).sum())
        with autocast(self.device, self.dtype), loss_context(self.tp):
            loss = local_value(self.loss(x, y, documents, tokens=tokens))
        if self.shard is not None:
            dist.all_reduce(loss, group=self.shard.group)
        return loss
