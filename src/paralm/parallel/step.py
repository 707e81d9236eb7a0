"""Running one step's forward and backward on a module that is not pipelined (a pipeline runs its
schedule instead: `paralm.parallel.pipeline.Pipeline` has the same two methods)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from paralm.models.loss import cross_entropy_loss
from paralm.models.moe import pop_auxiliary_loss
from paralm.parallel.context.layout import SequenceShard
from paralm.parallel.ddp import gradient_sync
from paralm.parallel.precision import autocast
from paralm.parallel.tensor import local_value, loss_context

Batches = list[tuple[torch.Tensor, torch.Tensor]]
LossScale = Callable[[torch.Tensor], torch.Tensor]  # multiplies the loss before backward (fp16 loss scaling)


class StepRunner(Protocol):
    def forward_backward(self, batches: Batches, scale: LossScale) -> torch.Tensor: ...

    def eval_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor | None: ...


@dataclass
class PlainStep:
    """Micro-batches through `module` one after the other, gradients synced only on the last."""

    module: nn.Module
    device: torch.device
    dtype: str  # the compute dtype (`precision.dtype`)
    tp: int = 1  # tensor-parallel degree: the loss is then computed on vocabulary-sharded logits
    shard: SequenceShard | None = None  # context parallelism: this rank's positions of every sequence
    sync_every_microstep: bool = False  # FSDP reduce-scatters every micro-step (`parallel.shard_grads_every_microstep`)

    def _loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Mean loss of the batch, or of this rank's positions of it (with their global positions)."""
        if self.shard is None:
            return cross_entropy_loss(self.module(x), y)
        x, y, positions = self.shard(x, y)
        return cross_entropy_loss(self.module(x, positions=positions), y)

    def forward_backward(self, batches: Batches, scale: LossScale) -> torch.Tensor:
        """Accumulate gradients over the micro-batches; returns this rank's mean loss over them."""
        loss_sum = torch.zeros((), device=self.device)
        for i, (x, y) in enumerate(batches):
            last = i == len(batches) - 1
            with gradient_sync(self.module, last or self.sync_every_microstep), loss_context(self.tp):
                with autocast(self.device, self.dtype):
                    loss = self._loss(x, y) / len(batches)
                    aux = pop_auxiliary_loss(self.module)  # MoE balancing: trained, not reported as the loss
                scale(loss if aux is None else loss + aux / len(batches)).backward()
            loss_sum += local_value(loss.detach())
        return loss_sum

    def eval_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Mean loss of one batch."""
        with autocast(self.device, self.dtype), loss_context(self.tp):
            return local_value(self._loss(x, y))
