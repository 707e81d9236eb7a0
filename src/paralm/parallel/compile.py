"""`torch.compile` per transformer block (`train.compile`), as torchtitan does.

Blocks are compiled one by one rather than the whole model: every block has the same code, so one
compiled graph serves them all (compile time does not grow with depth), and the wrappers applied
around a block stay outside the compiled region: FSDP's all-gather and reduce-scatter hooks and
DDP's gradient hooks run eagerly as usual. Applied after activation checkpointing, so a checkpointed
block's recomputation is compiled with it, and before FSDP/DDP. Each block's `forward` is replaced
by its compiled version (rather than wrapping the block in an `OptimizedModule`), so parameter
names, and with them checkpoints, are those of the plain model.
"""

from __future__ import annotations

import torch
from torch import nn

from paralm import compat


def apply_compile(blocks: nn.ModuleDict) -> None:
    """Compile the forward of each block in place (a pipeline stage holds some of them). Sizes read from
    tensors (MoE's tokens per expert) are traced as symbols, so a block compiles as one graph."""
    compat.capture_scalar_outputs()
    for block in blocks.values():
        block.forward = torch.compile(block.forward, fullgraph=True)
