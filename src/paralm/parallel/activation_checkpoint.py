"""Activation checkpointing: keep only a block's input in forward, recompute the rest in backward.

`full` wraps every block, `selective` every k-th (`train.ac_every`), counting layers from 1 by their
index in the whole model, so a pipeline stage picks the same blocks as the unsplit model. PyTorch's
`checkpoint_wrapper` is used because checkpoint state dicts (DCP's `get_state_dict`) strip its
prefix: parameter names stay those of the plain model. The recomputation runs inside `recomputing`,
so an MoE layer replayed in backward neither counts its routing statistics nor keeps an auxiliary loss
a second time.
"""

from __future__ import annotations

import contextlib

from torch import nn

from paralm.compat import checkpoint_wrapper
from paralm.config.schema import TrainConfig
from paralm.models.moe import moe_layers, recomputing


def apply_activation_checkpointing(blocks: nn.ModuleDict, train: TrainConfig) -> None:
    """Wrap the chosen blocks (keyed by layer index) in place (before FSDP, which then shards the wrappers)."""
    if train.activation_checkpointing == "none":
        return
    every = 1 if train.activation_checkpointing == "full" else train.ac_every
    for name, block in list(blocks.items()):
        if (int(name) + 1) % every == 0:
            # Non-reentrant recomputation restores the RNG state, so dropout draws the same masks twice. Only
            # MoE blocks take the recomputation context: torch.compile accepts no `context_fn` but
            # dispatch modes, and a dense block needs none.
            contexts = {"context_fn": _contexts} if moe_layers(block) else {}
            blocks[name] = checkpoint_wrapper(block, **contexts)


def _contexts() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    """(the first forward's context, the recomputation's)."""
    return contextlib.nullcontext(), recomputing()
