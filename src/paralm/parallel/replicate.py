"""Data parallelism for tensor- or pipeline-parallel models: FSDP2's `replicate` (DDP semantics).

Every data-parallel rank keeps all of its (stage's, TP shard's) parameters and gradients are averaged
by all-reduce, as with DDP. Plain DDP does not fit here (torch 2.13): it cannot hold DTensor
(tensor-parallel) parameters, and under `torch.distributed.pipelining` the stage's metadata-inference
forward leaves DDP's reducer expecting a backward, so the first micro-batch's backward all-reduces
early and the bucket rebuild then fails ("rebuilt parameter indices size is not same"). `replicate`
is built on FSDP2's machinery, which takes DTensor parameters and which the pipeline stages drive
(they sync gradients on the last micro-batch and clean up after metadata inference).
"""

from __future__ import annotations

from torch import nn

from paralm.compat import replicate
from paralm.parallel.runtime import Runtime


def apply_replicate(model: nn.Module, runtime: Runtime) -> nn.Module:
    """Replicate `model` over the data-parallel (and cp) ranks in place; its class becomes a `ReplicateModule`."""
    return replicate(model, mesh=runtime.grad_mesh)
