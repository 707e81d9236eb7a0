"""Mixture-of-experts layers that route this rank's part of each sequence, under sequence or context
parallelism.

The tensor-parallel plan (`paralm.models.tensor_plan`) hands a token-wise MoE layer (`MoE.token_wise`)
this rank's positions instead of the gathered sequence, so the tp ranks split the routing, the experts'
matmuls and, under expert parallelism, the all-to-all's tokens, where they would each repeat all of it.
That leaves two things partial, which this module completes (Megatron-Core routes sequence-parallel
tokens alike):
- the balance terms are per-sequence means (`MoE.sequence_mean`): each rank's means over its part are
  averaged over the group in forward; backward hands each part 1/tp of the mean's gradient, the share of
  the whole that its positions make up, as every rank adds the same auxiliary loss;
- every parameter of such a layer (router, shared and routed experts) has a gradient from this rank's
  positions only: `reduce_gradients` sums them over the group once per step, in one all-reduce. An expert
  split by expert parallelism has the same shard on its tp peers (tp is the innermost mesh dim of both
  meshes), so its local gradient sums alike.
The loss-free bias counts the tokens of the whole step: each such layer is marked with the group
(`MoE.position_groups`), over which its counts sum too (`paralm.models.moe.routing_groups`).

Context parallelism splits every layer's sequences alike (`split_context_routing`): the means complete
over the cp group too, but there each part keeps the whole of the mean's gradient, because the cp
ranks' gradients are averaged with the data-parallel ones (each holds the mean loss of its share of the
positions), where the tp ranks' are summed. The two compose: under both, a part's gradient is 1/tp.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from paralm.models.moe import MoE, moe_layers


def sequence_routed_layers(model: nn.Module, sequence_parallel: bool) -> list[MoE]:
    """The MoE layers that the plan hands this rank's positions only."""
    return [layer for layer in moe_layers(model) if sequence_parallel and layer.token_wise]


def split_sequence_routing(model: nn.Module, sequence_parallel: bool, group: dist.ProcessGroup) -> None:
    """Each sequence-routed layer marked with `group`, the tp ranks holding the other parts of its sequences,
    and its per-sequence means averaged over them (each part's gradient 1/tp of the mean's: tp sums)."""
    for layer in sequence_routed_layers(model, sequence_parallel):
        _complete_over(layer, group, 1 / dist.get_world_size(group))


def split_context_routing(model: nn.Module, group: dist.ProcessGroup) -> None:
    """Every MoE layer marked with `group`, the cp ranks holding the other positions of its sequences, and its
    per-sequence means averaged over them (each part keeps the mean's whole gradient: cp averages)."""
    for layer in moe_layers(model):
        _complete_over(layer, group, 1.0)


def _complete_over(layer: MoE, group: dist.ProcessGroup, gradient_share: float) -> None:
    layer.position_groups.append(group)
    layer.sequence_mean.register_forward_hook(partial(_mean_over, group, gradient_share))


def _mean_over(
    group: dist.ProcessGroup, gradient_share: float, module: nn.Module, inputs: Any, part: torch.Tensor
) -> torch.Tensor:
    """The mean of the ranks' `part`s (equal numbers of positions each), with `gradient_share` of the mean's
    gradient flowing to this rank's part."""
    total = part.detach().clone()
    dist.all_reduce(total, group=group)
    kept = part * gradient_share
    return kept + (total / dist.get_world_size(group) - kept.detach())


class SequenceRoutedGradients:
    """The gradients of the sequence-routed layers' parameters, summed over the tensor-parallel group."""

    def __init__(self, layers: list[MoE], group: dist.ProcessGroup) -> None:
        """After every wrapping (FSDP replaces the parameters it shards)."""
        self.parameters = [p for layer in layers for p in layer.parameters() if p.requires_grad]
        self.group = group

    @torch.no_grad()
    def reduce_gradients(self) -> None:
        grads = [p.grad for p in self.parameters if p.grad is not None]
        if not grads:
            return
        parts = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
        flat = torch.cat([part.reshape(-1) for part in parts])
        dist.all_reduce(flat, group=self.group)
        for part, summed in zip(parts, flat.split([part.numel() for part in parts]), strict=True):
            part.copy_(summed.view_as(part))
