"""A training step as every floor sees it: its batch (`StepBatch`) and the hooks the loop runs (`StepHook`).

Defined on the lowest floor that knows tensors, so that converters (`paralm.convert.hooks`), strategies
(`paralm.parallel`), observers (`paralm.observe.run`) and the loop's own meters implement them without
importing upward. The loop (`paralm.train.trainer`) runs one list of hooks at three points of each step
instead of naming each piece of work there: `started`, `batches` (the step's batch is loaded) and
`ended` (values for the step's metrics row).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

MicroBatch = tuple[torch.Tensor, ...]  # (x, y) or (x, y, documents)


@dataclass
class StepBatch:
    """This rank's micro-batches of one step, each (x, y) or (x, y, documents) (`documents`: which document
    each input token belongs to, with `data.document_mask`). With a loss mask, `loss_tokens` is the
    global batch's trained target count divided by the loss replicas: each micro-batch's summed loss
    over it makes the replicas' averaged gradients those of the global batch's mean over its trained
    tokens. None: each micro-batch's mean over the accumulation steps, as without a mask. A replica group
    logs the loss of the share it read, as it does without a mask: `reported_tokens` (its share's trained
    targets over its own loss replicas) normalises the logged loss in place of `loss_tokens` (None: the same);
    a share without a trained target logs 0."""

    micro_batches: list[MicroBatch] = field(default_factory=list)
    loss_tokens: float | None = None
    reported_tokens: float | None = None
    trained: int | None = None  # trained targets in the job's share of the global batch (for the metrics)


class StepHook:
    """Work at the three points of every step: a hook overrides what it needs, the defaults do nothing."""

    def started(self, step: int) -> None:
        """The step begins, at the position the sync strategy gave it (a healed replica's)."""

    def batches(self, batch: StepBatch) -> StepBatch:
        """The step's batch is loaded (data and host work done); returns what forward and backward run."""
        return batch

    def ended(self, step: int, skipped: torch.Tensor) -> dict[str, Any]:
        """The optimizer stepped, or skipped where `skipped` (a bool on the device). Returns values for the
        step's metrics row without the host waiting for the device: device tensors under the names
        `paralm.train.step_metrics` knows, or host numbers the row carries as they are."""
        return {}


class StepHooks(StepHook):
    """The hooks of a loop, run in the order given: each sees the batch the one before returned, and their
    metrics values merge into one row (each hook under names of its own)."""

    def __init__(self, hooks: Iterable[StepHook]) -> None:
        self.hooks = list(hooks)

    def started(self, step: int) -> None:
        for hook in self.hooks:
            hook.started(step)

    def batches(self, batch: StepBatch) -> StepBatch:
        for hook in self.hooks:
            batch = hook.batches(batch)
        return batch

    def ended(self, step: int, skipped: torch.Tensor) -> dict[str, Any]:
        values: dict[str, Any] = {}
        for hook in self.hooks:
            values |= hook.ended(step, skipped)
        return values
