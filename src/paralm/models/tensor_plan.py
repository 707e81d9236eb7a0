"""The Megatron-LM tensor-parallel plan of a pre-norm decoder, from a family's submodule names.

Per block, each part (attention, MLP) gathers its input once, shards its input projections
column-wise (whole heads, or slices of the hidden width, per rank) and its output projection
row-wise; under sequence parallelism its norm and the residual stream stay sharded along the
sequence (Korthikanti et al. 2022). The embedding is row-wise over the vocabulary and the head
column-wise with its output left sharded for `loss_parallel`, so a tied weight (both shard dim 0 of
the same `(vocab, d_model)` matrix) stays one parameter.

A module whose heads all read one projection (MLA's shared RoPE key, its low-rank query and key/value
paths) takes its input as a plain tensor and keeps those layers replicated; the shared projection's
output passes a `compat.SumGradients` style, so its gradient, read by this rank's heads only, is summed over
the group (Megatron's "f" operator).

A mixture-of-experts feed-forward is replicated over the group (its router and experts; expert
parallelism, if any, splits the experts over data-parallel ranks instead) and takes a plain tensor.
Under sequence parallelism a token-wise layer (`MoE.token_wise`: no capacity) routes this rank's
positions only, so the group splits the routing and the experts' work instead of repeating it
(`paralm.parallel.sequence_routing` sums what that leaves partial); otherwise, and a layer with a
capacity (which drops tokens by their place in the whole micro-batch), it takes the gathered input,
every rank routes the same tokens alike, and its output is cut back to this rank's positions.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
)

from paralm.compat import SumGradients
from paralm.models.moe import MoE
from paralm.models.spec import ShardedRegion


@dataclass(frozen=True)
class BlockPart:
    """One residual branch of a block: its norm, the module it feeds, the column-parallel input
    projections and the row-parallel output projection (names inside the module), and norms inside
    the module that act on each head of a (batch, seq, heads, head_dim) activation where it has them:
    replicated, their input read as sharded by heads, so their gradients are summed over the group."""

    norm: str
    module: str
    inputs: tuple[str, ...]
    output: str
    head_norms: tuple[str, ...] = ()
    # submodules (identities) whose output every head reads: their gradients are summed over the group, and
    # the module takes a plain tensor (its layers outside `inputs` and `output` stay replicated)
    shared: tuple[str, ...] = ()


@dataclass(frozen=True)
class DecoderNames:
    embedding: str
    blocks: str
    parts: tuple[BlockPart, ...]
    final_norm: str
    head: str


def decoder_plan(model: nn.Module, names: DecoderNames, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """The plan for the parts `model` holds (a pipeline stage may lack the embedding or the head)."""
    residual = Shard(1) if sequence_parallel else Replicate()  # the residual stream between blocks
    plan: dict[str, ParallelStyle] = {}
    if getattr(model, names.embedding) is not None:
        plan[names.embedding] = RowwiseParallel(input_layouts=Replicate(), output_layouts=residual)
    for key in model.get_submodule(names.blocks):
        prefix = f"{names.blocks}.{key}."
        for part in names.parts:
            if sequence_parallel:
                plan[prefix + part.norm] = SequenceParallel()
            module = model.get_submodule(prefix + part.module)
            if isinstance(module, MoE):
                routed = residual if module.token_wise else Replicate()  # this rank's positions, or all
                plan[prefix + part.module] = PrepareModuleInputOutput(
                    input_layouts=(residual,),
                    desired_input_layouts=(routed,),
                    use_local_input=True,
                    output_layouts=(routed,),
                    desired_output_layouts=(residual,),
                )
                continue
            # one gathered input shared by the column-parallel projections: their input gradients add
            # up locally and are reduced once; keyword arguments (positions, a cache) pass as they are
            plan[prefix + part.module] = PrepareModuleInput(
                input_layouts=(residual,), desired_input_layouts=(Replicate(),), use_local_output=bool(part.shared)
            )
            for name in part.shared:
                plan[f"{prefix}{part.module}.{name}"] = SumGradients()
            for name in part.inputs:
                plan[f"{prefix}{part.module}.{name}"] = ColwiseParallel()
            for name in part.head_norms:
                if getattr(model.get_submodule(prefix + part.module), name, None) is not None:
                    # DTensor's SequenceParallel style: parameters replicated, the input sharded on dim 2 (heads)
                    plan[f"{prefix}{part.module}.{name}"] = SequenceParallel(sequence_dim=2, use_local_output=True)
            plan[f"{prefix}{part.module}.{part.output}"] = RowwiseParallel(output_layouts=residual)
    if getattr(model, names.head) is not None:
        if sequence_parallel:
            plan[names.final_norm] = SequenceParallel()
        plan[names.head] = ColwiseParallel(input_layouts=residual, output_layouts=Shard(-1), use_local_output=False)
    return plan


def decoder_sharded_regions(model: nn.Module, names: DecoderNames, sequence_parallel: bool) -> list[ShardedRegion]:
    """Megatron's model-parallel RNG regions. Under sequence parallelism every activation a dropout sees
    is sharded (the embedding's and the residual branches' by sequence, attention's by heads): the whole
    module. Otherwise each part up to its row-parallel output (its heads' attention probabilities);
    the residual dropout after it sees the replicated output and must draw the shared mask."""
    if sequence_parallel:
        return [ShardedRegion("")]
    return [
        ShardedRegion(f"{names.blocks}.{key}.{part.module}", f"{names.blocks}.{key}.{part.module}.{part.output}")
        for key in model.get_submodule(names.blocks)
        for part in names.parts
        if not isinstance(model.get_submodule(f"{names.blocks}.{key}.{part.module}"), MoE)  # replicated
    ]
