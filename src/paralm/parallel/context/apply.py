"""Context parallelism applied: every block's attention swapped through the family's spec, the MoE layers'
per-sequence statistics completed over the cp ranks, and the batch shard the step takes."""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from paralm.models.spec import ModelSpec
from paralm.parallel.context.alltoall import AllToAllAttention
from paralm.parallel.context.layout import SequenceShard
from paralm.parallel.context.ring import RingAttention
from paralm.parallel.sequence_routing import split_context_routing


def sequence_shard(cp_mesh: DeviceMesh, method: str) -> SequenceShard:
    """This rank's share of every sequence under `method` (`parallel.cp_method`)."""
    return SequenceShard(cp_mesh.get_local_rank(), cp_mesh.size(), zigzag=method == "ring", group=cp_mesh.get_group())


def apply_context_parallel(model: nn.Module, spec: ModelSpec, cp_mesh: DeviceMesh, method: str) -> None:
    """Each block's attention (`spec.attention`) attends across the cp ranks, in place (after tensor
    parallelism: it sees this rank's heads; before activation checkpointing, which recomputes it). MoE layers
    route this rank's positions of each sequence: their balance terms and counts complete over the cp ranks
    (`split_context_routing`)."""
    group = cp_mesh.get_group()
    attention = RingAttention(group) if method == "ring" else AllToAllAttention(group)
    for block in model.get_submodule(spec.blocks).values():
        block.get_submodule(spec.attention).attend = attention
    split_context_routing(model, group)
