"""`train.compile`: `torch.compile` per transformer block (`blocks`, as torchtitan does) or of the whole step's
forward (`model`), and the count of what torch compiled (`CompileCounts`).

`blocks`: blocks are compiled one by one rather than the whole model: every block has the same code, so one
compiled graph serves them all (compile time does not grow with depth), and the wrappers applied around a
block stay outside the compiled region: FSDP's all-gather and reduce-scatter hooks, a pipeline's stages and
DDP's gradient hooks run eagerly as usual. Applied after activation checkpointing, so a checkpointed block's
recomputation is compiled with it, and before FSDP/DDP. Each block's `forward` is replaced by its compiled
version (rather than wrapping the block in an `OptimizedModule`), so parameter names, and with them
checkpoints, are those of the plain model.

`model`: the step's forward from token ids to loss (embedding, blocks, final norm, head and cross-entropy) is
one graph, so inductor may fuse across the head and the loss too. Shapes are static (`dynamic=False`): every
training micro-batch has the same, document masks included. The layouts that put hooks or collectives between
blocks, or Python bookkeeping around the forward (DDP), are refused (`paralm.config.compile_rules`). With
`train.cuda_graphs` the graph is replayed as CUDA graphs (inductor's `reduce-overhead`).

Neither passes `fullgraph=True`: a graph break (torch runs the rest of that frame eagerly) or a recompile (a
guard failed: a shape or a flag changed) leaves the run correct but slower every step, so both are counted
and reported rather than fatal, and the tests hold them at zero.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from paralm import compat
from paralm.models.step import StepHook
from paralm.parallel.step import LossFn


def apply_compile(blocks: nn.ModuleDict) -> None:
    """Compile the forward of each block in place (a pipeline stage holds some of them). Sizes read from
    tensors (MoE's tokens per expert) are traced as symbols, so a block compiles as one graph."""
    compat.capture_scalar_outputs()
    for block in blocks.values():
        block.forward = torch.compile(block.forward)


def compiled_loss(loss: LossFn, cuda_graphs: bool) -> LossFn:
    """`loss` (a step's forward and loss, `PlainStep.loss`) compiled as one graph. A masked loss's divisor (the
    global batch's trained targets) enters as a tensor: as a number it would be a constant of the graph,
    compiled again for every batch."""
    compat.capture_scalar_outputs()
    compiled = torch.compile(loss, dynamic=False, mode="reduce-overhead" if cuda_graphs else None)

    def run(x: torch.Tensor, y: torch.Tensor, *rest: torch.Tensor | None, tokens: float | None = None) -> Any:
        return compiled(x, y, *rest, tokens=None if tokens is None else _on_device(tokens, x.device))

    return run


def _on_device(value: float, device: torch.device) -> torch.Tensor:
    """`value` as a 0-d tensor on `device`; on a GPU copied from pinned memory, so the host does not wait for it."""
    if device.type != "cuda":
        return torch.tensor(value, device=device)
    return torch.tensor(value).pin_memory().to(device, non_blocking=True)


class CompileCounts(StepHook):
    """What torch compiled during this process's training steps, for the metrics rows: graphs, graph breaks,
    and recompiles, the graphs compiled in any step after the first (which compiles everything once). Counted
    between each step's start and end, so evaluation's own graphs (no gradients, another batch size) are not."""

    def __init__(self) -> None:
        self.graphs = self.breaks = self.recompiles = self.steps = 0
        self._before = (0, 0)

    def started(self, step: int) -> None:
        self._before = compat.compile_counters()

    def ended(self, step: int, skipped: torch.Tensor) -> dict[str, Any]:
        graphs, breaks = (now - before for now, before in zip(compat.compile_counters(), self._before, strict=True))
        self.graphs, self.breaks = self.graphs + graphs, self.breaks + breaks
        self.recompiles += graphs if self.steps else 0
        self.steps += 1
        return {
            "compile_graphs": self.graphs,
            "compile_graph_breaks": self.breaks,
            "compile_recompiles": self.recompiles,
        }


def describe_compiled(row: dict[str, Any]) -> str | None:
    """The line a run prints once its first steps compiled; None for a row of an eager run."""
    if "compile_graphs" not in row:
        return None
    return (
        f"compile: {row['compile_graphs']} graphs, {row['compile_graph_breaks']} graph breaks, "
        f"{row['compile_recompiles']} recompiles"
    )
